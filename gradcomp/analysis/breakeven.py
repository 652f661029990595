"""The break-even search and the verdict, over the step simulator (gradcomp.analysis.costmodel).

``estimate`` simulates one step per choice against uncompressed and states whether the choice
pays (an ``Estimate`` each); with ``crossovers`` it also searches where the verdict flips: the
link bandwidth below which the choice pays (``breakeven_gbps``: a log grid over ``GBPS_RANGE``,
then bisection) and the world size at which the verdict differs from the one at 2 ranks
(``breakeven_world_size``: a log grid up to ``MAX_WORLD_SIZE``, then bisection).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..methods import UNCOMPRESSED
from .costmodel import Choice, Scenario, default_choices, simulate, step_buckets

GBPS_RANGE = (1e-3, 1e5)
MAX_WORLD_SIZE = 1 << 16


@dataclass(frozen=True)
class Estimate:
    """The verdict for one method (a JSON record through ``to_dict``). Seconds per step."""

    method: str
    scheme: str
    options: dict
    wire_bytes: int
    exact_bytes: int
    comm_s: float
    exposed_comm_s: float
    compress_s: float
    step_s: float
    speedup: float
    pays: bool
    breakeven_gbps: float | None
    breakeven_world_size: int | None
    pays_below_world_size: bool | None
    verdict: str

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class _Comparison:
    """Speedup of choices over uncompressed as the bandwidth or world size varies (the
    uncompressed step is simulated once per point and reused), the uncompressed step in
    ``baseline`` (default: the same scenario)."""

    def __init__(self, scenario: Scenario, baseline: Scenario | None = None):
        self.scenario, self.baseline = scenario, baseline or scenario
        self.buckets = step_buckets(scenario)
        self.baseline_buckets = self.buckets if baseline is None else step_buckets(baseline)
        self._baseline: dict = {}

    def speedup(self, choice: Choice, gbps: float | None = None, world_size: int | None = None) -> float:
        s, b = self.scenario, self.baseline
        if gbps is not None:
            s, b = s.with_bandwidth(gbps), b.with_bandwidth(gbps)
        if world_size is not None:
            s, b = s.with_world_size(world_size), b.with_world_size(world_size)
        key = (gbps, world_size)
        if key not in self._baseline:
            self._baseline[key] = simulate(b, Choice(UNCOMPRESSED), self.baseline_buckets).step_s
        return self._baseline[key] / simulate(s, choice, self.buckets).step_s


def _log_grid(lo: float, hi: float, points: int, integer: bool) -> list:
    grid = np.geomspace(lo, hi, points).tolist()
    return sorted({int(round(v)) for v in grid}) if integer else grid


def _bisect(pays, a, b, integer: bool):
    """Narrow [a, b], where pays(a) != pays(b), to the last value with pays(a)'s verdict."""
    side = pays(a)
    while (b - a > 1) if integer else (b / a > 1.001):
        mid = (a + b) // 2 if integer else math.sqrt(a * b)
        a, b = (mid, b) if pays(mid) == side else (a, mid)
    return a if integer else math.sqrt(a * b)


def breakeven_gbps(scenario: Scenario, choice: Choice, gbps_range=GBPS_RANGE,
                   comparison: _Comparison | None = None,
                   baseline: Scenario | None = None) -> float | None:
    """The link bandwidth (Gbit/s) below which ``choice`` beats uncompressed (the highest
    bandwidth where its verdict turns from pays to does-not-pay); None if it never pays in
    ``gbps_range``; the range's top if it still pays there. ``baseline``: the scenario the
    uncompressed step runs in when it is not ``scenario`` (e.g. Gloo's one ring over all ranks
    beside a hierarchical hook's two link classes), both at each tried bandwidth."""
    if choice.method == UNCOMPRESSED:
        return None
    compare = comparison or _Comparison(scenario, baseline)

    def pays(gbps):
        return compare.speedup(choice, gbps=gbps) > 1.0

    grid = _log_grid(*gbps_range, points=33, integer=False)
    verdicts = [pays(g) for g in grid]
    if not any(verdicts):
        return None
    last = max(i for i, v in enumerate(verdicts) if v)
    return grid[-1] if last == len(grid) - 1 else _bisect(pays, grid[last], grid[last + 1], integer=False)


def breakeven_world_size(scenario: Scenario, choice: Choice, max_world_size: int = MAX_WORLD_SIZE,
                         comparison: _Comparison | None = None) -> tuple[int | None, bool]:
    """(w, pays_at_2): w is the smallest world size (scanning up from 2) whose verdict differs
    from the verdict at 2 ranks (where an all-gather method stops paying, or where a summable one
    starts to), None if the verdict never changes up to ``max_world_size``. A hierarchical
    choice is scanned from two nodes (gpus_per_node + 1 ranks): inside one node it sends nothing
    compressed."""
    if choice.method == UNCOMPRESSED:
        return None, False
    compare = comparison or _Comparison(scenario)

    def pays(world_size):
        return compare.speedup(choice, world_size=int(world_size)) > 1.0

    lowest = scenario.network.gpus_per_node + 1 if choice.hierarchical else 2
    grid = _log_grid(lowest, max_world_size, points=17, integer=True)
    first = pays(grid[0])
    for a, b in zip(grid, grid[1:]):
        if pays(b) != first:
            return _bisect(pays, a, b, integer=True) + 1, first
    return None, first


def _verdict(choice: Choice, speedup: float, gbps: float | None, bandwidth_gbps: float,
             crossovers: bool) -> str:
    if choice.method == UNCOMPRESSED:
        return "baseline"
    text = f"{'pays' if speedup > 1.0 else 'does not pay'}: {speedup:.2f}x at {bandwidth_gbps:.3g} Gbit/s"
    if not crossovers:
        return text
    if gbps is None:
        return text + "; never pays at any bandwidth"
    if gbps >= GBPS_RANGE[1]:
        return text + "; pays at every bandwidth"
    return text + f"; pays below {gbps:.3g} Gbit/s"


def estimate(scenario: Scenario, choices: list[Choice] | None = None, crossovers: bool = True) -> list[Estimate]:
    """One Estimate per choice (``none`` first, added when missing); ``crossovers`` also searches
    the break-even bandwidth and world size (slower)."""
    choices = list(choices) if choices else default_choices(sharded=scenario.sharded)
    if not any(c.method == UNCOMPRESSED for c in choices):
        choices.insert(0, Choice(UNCOMPRESSED))
    compare = _Comparison(scenario)
    base = simulate(scenario, Choice(UNCOMPRESSED), compare.buckets)
    out = []
    for choice in choices:
        step = simulate(scenario, choice, compare.buckets)
        speedup = base.step_s / step.step_s
        gbps = breakeven_gbps(scenario, choice, comparison=compare) if crossovers else None
        world, below = breakeven_world_size(scenario, choice, comparison=compare) if crossovers else (None, None)
        verdict = _verdict(choice, speedup, gbps, scenario.network.link.bandwidth_gbps, crossovers)
        # under FSDP every method runs the same row exchange: the scheme is not part of its name
        label, scheme = (choice.method, "rows") if scenario.sharded else (choice.label, choice.scheme)
        out.append(Estimate(label, scheme, dict(choice.options), step.wire_bytes, step.exact_bytes, step.comm_s,
                            step.exposed_comm_s, step.compress_s, step.step_s, speedup,
                            choice.method != UNCOMPRESSED and speedup > 1.0, gbps, world,
                            below if world is not None else None, verdict))
    return out
