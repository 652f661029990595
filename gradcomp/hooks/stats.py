"""Per-step statistics every hook state keeps: bytes and time, summed over the buckets of a step."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch


class HookStats:
    """Counters a hook updates per bucket; ``summary()`` gives totals and per-step means.

    raw_bytes:  bytes the bucket would have sent uncompressed (its numel * itemsize).
    wire_bytes: bytes this rank actually handed to collectives for it (payload parts, padding).
    compress_s, decompress_s, comm_s: seconds in each phase (comm = until the collective's
        result was available to this rank, as seen from the hook). Work on CUDA tensors is timed
        with CUDA events on the current stream (:meth:`mark`), read when the statistics are: no
        host synchronisation in a hook; elsewhere wall time.

    Hooks update it from their own thread and from communication callbacks: updates are locked.
    """

    FIELDS = ("raw_bytes", "wire_bytes", "compress_s", "decompress_s", "comm_s")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.buckets = 0
        self.totals = dict.fromkeys(self.FIELDS, 0.0)
        self._pending: list = []  # (field, start event, end event) of CUDA intervals
        self._lock = threading.Lock()

    def add(self, **amounts: float) -> None:
        unknown = set(amounts) - set(self.FIELDS)
        if unknown:
            raise ValueError(f"unknown statistics {sorted(unknown)}; known: {self.FIELDS}")
        with self._lock:
            for key, value in amounts.items():
                self.totals[key] += value

    @staticmethod
    def mark(device=None):
        """Now: a CUDA event recorded on the current stream when ``device`` is a CUDA device (a
        point in the device's work, not the host's), else ``time.perf_counter()`` seconds."""
        if device is not None and torch.device(device).type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add_interval(self, field: str, start, end=None) -> None:
        """Add the time from ``start`` to ``end`` (two :meth:`mark` results of one kind; ``end``
        defaults to now) to ``field``. CUDA intervals are resolved when statistics are read."""
        if isinstance(start, float):
            self.add(**{field: (time.perf_counter() if end is None else end) - start})
            return
        if field not in self.FIELDS:
            raise ValueError(f"unknown statistics [{field!r}]; known: {self.FIELDS}")
        if end is None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        with self._lock:
            self._pending.append((field, start, end))

    @contextmanager
    def timed(self, field: str, device=None):
        """Add the time of the ``with`` body to ``field`` (on ``device``: see :meth:`mark`)."""
        start = self.mark(device)
        try:
            yield
        finally:
            self.add_interval(field, start)

    def _resolve(self) -> None:
        """Fold finished CUDA intervals into the totals (waits for their end events)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for field, start, end in pending:
            end.synchronize()
            self.add(**{field: start.elapsed_time(end) / 1e3})

    def summary(self) -> dict:
        """Totals, plus per-step means and the compression ratio raw_bytes / wire_bytes."""
        self._resolve()
        out = {"steps": self.steps, "buckets": self.buckets, **self.totals}
        steps = max(self.steps, 1)
        for key in self.FIELDS:
            out[f"{key}_per_step"] = self.totals[key] / steps
        out["ratio"] = self.totals["raw_bytes"] / self.totals["wire_bytes"] if self.totals["wire_bytes"] else float("nan")
        return out

    def __call__(self) -> dict:
        """``state.stats()``: the same as :meth:`summary`."""
        return self.summary()

    def __getstate__(self):
        self._resolve()
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_pending")}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock(), _pending=[])

    def state_dict(self) -> dict:
        self._resolve()
        return {"steps": self.steps, "buckets": self.buckets, "totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.buckets = int(state["steps"]), int(state["buckets"])
        self.totals = {k: float(state["totals"][k]) for k in self.FIELDS}
