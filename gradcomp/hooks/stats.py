"""Per-step statistics every hook state keeps: bytes and time, summed over the buckets of a step."""
from __future__ import annotations

import time
from contextlib import contextmanager


class HookStats:
    """Counters a hook updates per bucket; ``summary()`` gives totals and per-step means.

    raw_bytes:  bytes the bucket would have sent uncompressed (its numel * itemsize).
    wire_bytes: bytes this rank actually handed to collectives for it (payload parts, padding).
    compress_s, decompress_s, comm_s: wall seconds in each phase (comm = until the collective's
        result was available to this rank, as seen from the hook).
    """

    FIELDS = ("raw_bytes", "wire_bytes", "compress_s", "decompress_s", "comm_s")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.buckets = 0
        self.totals = dict.fromkeys(self.FIELDS, 0.0)

    def add(self, **amounts: float) -> None:
        unknown = set(amounts) - set(self.FIELDS)
        if unknown:
            raise ValueError(f"unknown statistics {sorted(unknown)}; known: {self.FIELDS}")
        for key, value in amounts.items():
            self.totals[key] += value

    @contextmanager
    def timed(self, field: str):
        """Add the wall time of the ``with`` body to ``field``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(**{field: time.perf_counter() - start})

    def summary(self) -> dict:
        """Totals, plus per-step means and the compression ratio raw_bytes / wire_bytes."""
        out = {"steps": self.steps, "buckets": self.buckets, **self.totals}
        steps = max(self.steps, 1)
        for key in self.FIELDS:
            out[f"{key}_per_step"] = self.totals[key] / steps
        out["ratio"] = self.totals["raw_bytes"] / self.totals["wire_bytes"] if self.totals["wire_bytes"] else float("nan")
        return out

    def __call__(self) -> dict:
        """``state.stats()``: the same as :meth:`summary`."""
        return self.summary()

    def state_dict(self) -> dict:
        return {"steps": self.steps, "buckets": self.buckets, "totals": dict(self.totals)}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.buckets = int(state["steps"]), int(state["buckets"])
        self.totals = {k: float(state["totals"][k]) for k in self.FIELDS}
