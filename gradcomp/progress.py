"""A status line on stderr for commands that take more than a moment.

    with Progress("gradcomp calibrate", quiet=args.json):
        stage("sweeping the network on 2 ranks")
        ...

After ``GRADCOMP_PROGRESS_AFTER_S`` seconds (default 2) the line ``gradcomp calibrate: sweeping the
network on 2 ranks, 12 s`` appears and is redrawn every second; it is cleared before anything is
printed to stdout (or written to ``sys.stderr``: log lines, warnings) and when the block ends, so
results are never mixed with it. Nothing is drawn when stderr is not a terminal (a pipe, a file, a
test), with ``quiet`` (``--json``), in a rank other than 0 of a launched job (``RANK``), or inside
another Progress.
"""
from __future__ import annotations

import os
import sys
import threading
import time

_active: Progress | None = None


def stage(text: str) -> None:
    """Name what the running command does now (shown on the status line, if one is drawn)."""
    if _active is not None:
        _active.stage = text


class _ClearingStream:
    """stdout or stderr, clearing the status line before each write."""

    def __init__(self, stream, progress: Progress):
        self._stream, self._progress = stream, progress

    def write(self, text):
        self._progress.clear()
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class Progress:
    """Draw the status line of ``command`` on ``stream`` (default stderr) while the block runs."""

    def __init__(self, command: str, quiet: bool = False, stream=None, after_s: float | None = None,
                 every_s: float = 1.0):
        self.command, self.stage = command, "working"
        self.stream = sys.stderr if stream is None else stream
        if after_s is None:
            after_s = float(os.environ.get("GRADCOMP_PROGRESS_AFTER_S", "2") or 2)
        self.after_s, self.every_s = after_s, every_s
        self.enabled = (not quiet and _isatty(self.stream) and os.environ.get("RANK", "0") == "0"
                        and _active is None)
        self._lock = threading.Lock()
        self._drawn = False
        self._done = threading.Event()
        self._thread = None
        self._stdout = self._stderr = None

    def __enter__(self) -> Progress:
        global _active
        if self.enabled:
            _active = self
            self._start = time.monotonic()
            self._stdout, sys.stdout = sys.stdout, _ClearingStream(sys.stdout, self)
            self._stderr = sys.stderr  # a log line or warning on stderr clears the line first, too
            if self.stream is sys.stderr:
                sys.stderr = _ClearingStream(sys.stderr, self)
            self._thread = threading.Thread(target=self._run, name="gradcomp-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        if self.enabled:
            self._done.set()
            self._thread.join()
            self.clear()
            sys.stdout, sys.stderr, _active = self._stdout, self._stderr, None

    def _run(self) -> None:
        if self._done.wait(self.after_s):
            return
        while not self._done.is_set():
            with self._lock:
                try:
                    self.stream.write(f"\r\033[K{self.command}: {self.stage}, "
                                      f"{time.monotonic() - self._start:.0f} s")
                    self.stream.flush()
                    self._drawn = True
                except (OSError, ValueError):  # the terminal went away
                    return
            self._done.wait(self.every_s)

    def clear(self) -> None:
        """Erase the status line if it is drawn (it is drawn again at the next tick)."""
        with self._lock:
            if self._drawn:
                self._drawn = False
                try:
                    self.stream.write("\r\033[K")
                    self.stream.flush()
                except (OSError, ValueError):
                    pass


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
