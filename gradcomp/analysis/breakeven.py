"""The break-even search and the verdict, over the step simulator (gradcomp.analysis.costmodel).

``estimate`` simulates one step per choice against a baseline (uncompressed fp32 by default; e.g.
``fp16`` for a mixed-precision run whose gradients are already 16-bit) and states whether the
choice pays (an ``Estimate`` each). The verdict has a margin: ``pays`` only at a speedup of at
least ``margin`` (default 1.05: a few per cent is within the run-to-run noise of a real cluster),
``does not pay`` at most 1 / ``margin``, ``marginal`` between; the raw speedup is kept. With
``crossovers`` it also searches where the speedup crosses 1 (break-even, without the margin): the
link bandwidth below which the choice beats the baseline (``breakeven_gbps``: a log grid over
``GBPS_RANGE``, then bisection) and the world size at which that changes from its state at 2
ranks (``breakeven_world_size``: a log grid up to ``MAX_WORLD_SIZE``, then bisection).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..methods import UNCOMPRESSED
from .costmodel import Choice, Scenario, default_choices, simulate, step_buckets

GBPS_RANGE = (1e-3, 1e5)
MAX_WORLD_SIZE = 1 << 16
DEFAULT_MARGIN = 1.05
"""A verdict of ``pays`` needs at least this speedup (``does not pay``: at most its inverse)."""


def check_margin(margin) -> float:
    """``margin`` as a float >= 1 (ValueError otherwise)."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 1:
        raise ValueError(f"the verdict's margin must be a finite number >= 1 (e.g. 1.05), got {margin!r}")
    return float(margin)


def verdict_class(speedup: float, margin: float = DEFAULT_MARGIN) -> str:
    """``pays`` (speedup >= margin), ``does not pay`` (<= 1 / margin) or ``marginal``."""
    if speedup >= margin:
        return "pays"
    return "does not pay" if speedup <= 1.0 / margin else "marginal"


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
    margin: float = DEFAULT_MARGIN
    baseline: str = UNCOMPRESSED

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class _Comparison:
    """Speedup of choices over ``against`` (default uncompressed) as the bandwidth or world size
    varies (its step is simulated once per point and reused), in the scenario ``baseline``
    (default: the same scenario)."""

    def __init__(self, scenario: Scenario, baseline: Scenario | None = None, against: Choice | None = None):
        self.scenario, self.baseline = scenario, baseline or scenario
        self.against = against or Choice(UNCOMPRESSED)
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
            self._baseline[key] = simulate(b, self.against, self.baseline_buckets).step_s
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
    compare = comparison or _Comparison(scenario, baseline)
    if choice == compare.against:
        return None

    def pays(gbps):
        return compare.speedup(choice, gbps=gbps) > 1.0

    grid = _log_grid(*gbps_range, points=33, integer=False)
    last = next((i for i in reversed(range(len(grid))) if pays(grid[i])), None)  # the highest that pays
    if last is None:
        return None
    return grid[-1] if last == len(grid) - 1 else _bisect(pays, grid[last], grid[last + 1], integer=False)


def breakeven_world_size(scenario: Scenario, choice: Choice, max_world_size: int = MAX_WORLD_SIZE,
                         comparison: _Comparison | None = None) -> tuple[int | None, bool]:
    """(w, pays_at_2): w is the smallest world size (scanning up from 2) whose verdict differs
    from the verdict at 2 ranks (where an all-gather method stops paying, or where a summable one
    starts to), None if the verdict never changes up to ``max_world_size``. A hierarchical
    choice is scanned from two nodes (gpus_per_node + 1 ranks): inside one node it sends nothing
    compressed."""
    compare = comparison or _Comparison(scenario)
    if choice == compare.against:
        return None, False

    def pays(world_size):
        return compare.speedup(choice, world_size=int(world_size)) > 1.0

    lowest = scenario.network.gpus_per_node + 1 if choice.hierarchical else 2
    grid = _log_grid(lowest, max_world_size, points=17, integer=True)
    first = pays(grid[0])
    for a, b in zip(grid, grid[1:]):
        if pays(b) != first:
            return _bisect(pays, a, b, integer=True) + 1, first
    return None, first


def _verdict(is_baseline: bool, speedup: float, gbps: float | None, bandwidth_gbps: float,
             crossovers: bool, margin: float, baseline: str) -> str:
    if is_baseline:
        return "baseline"
    against = "" if baseline == UNCOMPRESSED else f" over {baseline}"
    kind = verdict_class(speedup, margin)
    text = f"{kind}: {speedup:.2f}x{against} at {bandwidth_gbps:.3g} Gbit/s"
    if kind == "marginal":
        text += f" (within the {margin:.3g}x margin)"
    if not crossovers:
        return text
    if gbps is None:
        return text + "; never faster at any bandwidth"
    if gbps >= GBPS_RANGE[1]:
        return text + "; faster at every bandwidth"
    return text + f"; faster below {gbps:.3g} Gbit/s"


def estimate(scenario: Scenario, choices: list[Choice] | None = None, crossovers: bool = True,
             margin: float = DEFAULT_MARGIN, baseline: Choice | str | None = None) -> list[Estimate]:
    """One Estimate per choice (the baseline first, added when missing: ``none``, uncompressed
    fp32, unless ``baseline`` names another choice, e.g. ``"fp16"``); the speedup of each is its
    step against the baseline's; ``pays`` and the verdict need a speedup of at least ``margin``.
    ``crossovers`` also searches the break-even bandwidth and world size (slower)."""
    margin = check_margin(margin)
    against = Choice.parse(baseline) if isinstance(baseline, str) else (baseline or Choice(UNCOMPRESSED))
    choices = list(choices) if choices else default_choices(sharded=scenario.sharded)
    choices = [c for c in choices if c != against]
    choices.insert(0, against)
    if not any(c.method == UNCOMPRESSED for c in choices):
        choices.insert(1, Choice(UNCOMPRESSED))
    compare = _Comparison(scenario, against=against)
    base = simulate(scenario, against, compare.buckets)
    out = []
    for choice in choices:
        step = simulate(scenario, choice, compare.buckets)
        speedup = base.step_s / step.step_s
        is_baseline = choice == against
        # uncompressed against a compressed baseline: no crossover searched (it wins at high bandwidth)
        search = crossovers and choice.method != UNCOMPRESSED
        gbps = breakeven_gbps(scenario, choice, comparison=compare) if search else None
        world, below = breakeven_world_size(scenario, choice, comparison=compare) if search else (None, None)
        verdict = _verdict(is_baseline, speedup, gbps, scenario.network.link.bandwidth_gbps, search, margin,
                           against.label)
        # under FSDP every method runs the same row exchange: the scheme is not part of its name
        label, scheme = (choice.method, "rows") if scenario.sharded else (choice.label, choice.scheme)
        out.append(Estimate(label, scheme, dict(choice.options), step.wire_bytes, step.exact_bytes, step.comm_s,
                            step.exposed_comm_s, step.compress_s, step.step_s, speedup,
                            not is_baseline and speedup >= margin, gbps, world,
                            below if world is not None else None, verdict, margin, against.label))
    return out
