"""The status line of long commands: drawn on a terminal's stderr only, never mixed into stdout,
absent with --json."""
from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
import time

import pytest

from gradcomp import progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_line_names_the_stage_and_is_cleared_before_stdout_and_at_the_end(capsys):
    term = Terminal()
    with progress.Progress("gradcomp test", stream=term, after_s=0, every_s=0.02):
        progress.stage("measuring the thing")
        deadline = time.monotonic() + 10
        while "measuring the thing, " not in term.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        drawn = len(term.getvalue())
        print("a result")
        assert term.getvalue()[drawn:].startswith("\r\033[K")  # erased before the result
    assert re.search(r"\r\033\[Kgradcomp test: measuring the thing, \d+ s", term.getvalue())
    assert term.getvalue().endswith("\r\033[K")
    assert capsys.readouterr().out == "a result\n"
    assert progress._active is None


def test_a_log_line_on_stderr_clears_the_line_first(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with progress.Progress("gradcomp test", after_s=0, every_s=0.02):
        deadline = time.monotonic() + 10
        while "working" not in term.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        print("gradcomp: a warning", file=sys.stderr)
    assert re.search(r"working, \d+ s\r\033\[Kgradcomp: a warning\n", term.getvalue())
    assert sys.stderr is term


@pytest.mark.parametrize("stream, quiet", [(Terminal(), True), (io.StringIO(), False)])
def test_quiet_or_not_a_terminal_draws_nothing(stream, quiet):
    with progress.Progress("gradcomp test", quiet=quiet, stream=stream, after_s=0, every_s=0.01) as shown:
        progress.stage("measuring")
        time.sleep(0.05)
    assert stream.getvalue() == "" and not shown.enabled


def test_nothing_before_the_delay():
    term = Terminal()
    with progress.Progress("gradcomp test", stream=term, after_s=30):
        time.sleep(0.05)
    assert term.getvalue() == ""


BREAKEVEN = ["breakeven", "--model", "gpt2-1.5b", "--world-size", "64", "--device", "h100", "--link", "100gbe"]


def _stderr_on_a_terminal(argv: list[str]) -> tuple[str, str]:
    """(stdout, stderr) of ``gradcomp argv`` run with its stderr on a pseudo-terminal, the status
    line drawn from the start (GRADCOMP_PROGRESS_AFTER_S=0)."""
    leader, follower = pty.openpty()
    env = {**os.environ, "GRADCOMP_PROGRESS_AFTER_S": "0"}
    env.pop("RANK", None)
    child = subprocess.Popen([sys.executable, "-m", "gradcomp.cli", *argv], stdout=subprocess.PIPE,
                             stderr=follower, env=env, text=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    out = child.stdout.read()
    assert child.wait(timeout=120) == 0
    os.close(leader)
    return out, b"".join(chunks).decode()


def test_a_command_on_a_terminal_shows_its_progress_and_json_stays_quiet():
    out, err = _stderr_on_a_terminal(BREAKEVEN)
    assert "gradcomp breakeven: working, " in err and "verdict" in out
    assert "\r" not in out and "gradcomp breakeven:" not in out
    out, err = _stderr_on_a_terminal([*BREAKEVEN, "--json"])
    assert err == "" and out.lstrip().startswith(("[", "{"))
