"""Per-step statistics every hook state keeps: bytes and time, summed over the buckets of a step."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

from .. import comm


MAX_PENDING_INTERVALS = 256
"""CUDA intervals a HookStats holds before folding the finished ones into its totals (so its
memory stays bounded however long statistics go unread)."""


class Tally:
    """The totals of a :class:`HookStats` at one moment, its CUDA intervals not yet read
    included (:meth:`HookStats.tally`); reading them (:meth:`seconds`) waits for those intervals."""

    def __init__(self, totals: dict, pending: tuple):
        self._totals, self._pending = totals, pending

    def seconds(self, *fields: str) -> float:
        """The sum of ``fields``' totals at the tally's moment (a host synchronisation on CUDA)."""
        return sum(self._totals[f] for f in fields) + sum(
            comm.elapsed_s(start, end) for field, start, end in self._pending if field in fields)


class HookStats:
    """Counters a hook updates per bucket; ``summary()`` gives totals and per-step means.

    raw_bytes:  bytes the bucket would have sent uncompressed (its numel * itemsize).
    wire_bytes: bytes this rank actually handed to collectives for it (payload parts, padding).
    compress_s, decompress_s, comm_s: seconds in each phase (comm = until the collective's
        result was available to this rank, as seen from the hook). Work on CUDA tensors is timed
        with CUDA events on the current stream (:func:`gradcomp.comm.mark`), read when the
        statistics are (or, past MAX_PENDING_INTERVALS intervals, folded in as they finish): no
        host synchronisation in a hook; elsewhere wall time.
    dropped_entries: entries of peers' payloads that a decode dropped because their index lay
        outside the tensor (top-k; corrupt or hostile bytes), counted on the device
        (:meth:`dropped_counter`) and read when the statistics are.

    Hooks update it from their own thread and from communication callbacks: updates are locked.
    """

    FIELDS = ("raw_bytes", "wire_bytes", "compress_s", "decompress_s", "comm_s")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.buckets = 0
        self.totals = dict.fromkeys(self.FIELDS, 0.0)
        self._pending: list = []  # (field, start event, end event) of CUDA intervals, oldest first
        self._dropped: dict = {}  # (group size, device) -> int64 [group size] counter
        self._lock = threading.Lock()

    def dropped_counter(self, rows: int, device) -> torch.Tensor:
        """The int64 [rows] counter on ``device`` that decodes of ``rows`` stacked payloads add
        their dropped entries to (``Method.decode_sum``'s ``dropped``)."""
        key = (rows, str(torch.device(device)))
        with self._lock:
            if key not in self._dropped:
                self._dropped[key] = torch.zeros(rows, dtype=torch.int64, device=device)
            return self._dropped[key]

    def add(self, **amounts: float) -> None:
        unknown = set(amounts) - set(self.FIELDS)
        if unknown:
            raise ValueError(f"unknown statistics {sorted(unknown)}; known: {self.FIELDS}")
        with self._lock:
            for key, value in amounts.items():
                self.totals[key] += value

    mark = staticmethod(comm.mark)  # the hooks' spelling of gradcomp.comm.mark

    def add_interval(self, field: str, start, end=None) -> None:
        """Add the time from ``start`` to ``end`` (two :func:`gradcomp.comm.mark` results of one
        kind; ``end`` defaults to now) to ``field``. CUDA intervals are resolved when statistics
        are read, or folded in once finished when MAX_PENDING_INTERVALS are held."""
        if field not in self.FIELDS:
            raise ValueError(f"unknown statistics [{field!r}]; known: {self.FIELDS}")
        if isinstance(start, float):
            self.add(**{field: comm.elapsed_s(start, time.perf_counter() if end is None else end)})
            return
        if end is None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        with self._lock:
            self._pending.append((field, start, end))
            full = len(self._pending) > MAX_PENDING_INTERVALS
        if full:
            self._fold_finished()

    def _fold_finished(self) -> None:
        """Fold the intervals whose events have completed (``query()``: no synchronisation) into
        the totals; if the device is still more than MAX_PENDING_INTERVALS behind, wait for the
        oldest half (a host synchronisation only a host far ahead of its device pays)."""
        with self._lock:
            finished, kept = [], []
            for item in self._pending:
                (finished if item[2].query() and item[1].query() else kept).append(item)
            if len(kept) > MAX_PENDING_INTERVALS:
                half = len(kept) - MAX_PENDING_INTERVALS // 2
                finished, kept = finished + kept[:half], kept[half:]
            self._pending = kept
            self._fold(finished)

    def _fold(self, intervals) -> None:
        """Add CUDA ``intervals`` to the totals (the lock held: a tally never sees an interval
        in neither place)."""
        for field, start, end in intervals:
            self.totals[field] += comm.elapsed_s(start, end)

    @contextmanager
    def timed(self, field: str, device=None):
        """Add the time of the ``with`` body to ``field`` (on ``device``: see
        :func:`gradcomp.comm.mark`)."""
        start = self.mark(device)
        try:
            yield
        finally:
            self.add_interval(field, start)

    def tally(self) -> Tally:
        """The totals now, CUDA intervals still unread included (read later, no sync now)."""
        with self._lock:
            return Tally(dict(self.totals), tuple(self._pending))

    def _resolve(self) -> None:
        """Fold every CUDA interval into the totals (waits for their end events)."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._fold(pending)

    def summary(self) -> dict:
        """Totals, plus per-step means and the compression ratio raw_bytes / wire_bytes."""
        self._resolve()
        out = {"steps": self.steps, "buckets": self.buckets, **self.totals}
        steps = max(self.steps, 1)
        for key in self.FIELDS:
            out[f"{key}_per_step"] = self.totals[key] / steps
        out["ratio"] = self.totals["raw_bytes"] / self.totals["wire_bytes"] if self.totals["wire_bytes"] else float("nan")
        with self._lock:
            counters = list(self._dropped.values())
        out["dropped_entries"] = sum(int(counter.sum()) for counter in counters)
        return out

    def __call__(self) -> dict:
        """``state.stats()``: the same as :meth:`summary`."""
        return self.summary()

    def __getstate__(self):
        self._resolve()
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_pending")}

    def __setstate__(self, state):
        self.__dict__.update({"_dropped": {}, **state}, _lock=threading.Lock(), _pending=[])

    def state_dict(self) -> dict:
        self._resolve()
        return {"steps": self.steps, "buckets": self.buckets, "totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.buckets = int(state["steps"]), int(state["buckets"])
        self.totals = {k: float(state["totals"][k]) for k in self.FIELDS}
