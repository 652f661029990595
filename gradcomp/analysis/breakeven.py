"""The break-even search and the verdict, over the step simulator (gradcomp.analysis.costmodel).

With ``quality`` (a :class:`gradcomp.analysis.quality.Evidence`, what ``gradcomp breakeven``
always passes) the verdict is on **time to target**: step time x steps factor (the steps a choice
needs to reach the baseline's held-out loss over the baseline's steps, from recorded runs), as a
speedup over the baseline's time to target (the baseline's factor is 1: it sets the target).
A choice without evidence for the setting is never called ``pays`` ("faster per step, quality
unmeasured"), nor is one whose recorded miss is inside what rounding alone does to its workload
("quality unresolved": gradcomp.analysis.quality.null_row); one that did not reach the target
within the evidence's steps otherwise does not pay ("target not reached within Kx steps").
Without ``quality`` the verdict is on step time alone (the cost model's own question, e.g.
against published step-time measurements).

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
from dataclasses import dataclass, replace

import numpy as np


from ..methods import UNCOMPRESSED
from ..numfmt import plain
from .costmodel import Choice, Scenario, default_choices, simulate, step_buckets
from .profile import LinearCost, MethodCost

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


SIXTEEN_BIT = ("fp16", "bf16")
"""Baselines whose gradients are already 16-bit (mixed precision): their exchange is a plain
all-reduce of 16-bit values, no cast charged."""
BASELINE_ALIASES = {"fp32": UNCOMPRESSED}


def parse_baseline(baseline: Choice | str | None, options: dict | None = None) -> Choice:
    """The baseline choice: ``none``/``fp32`` (fp32 all-reduce, the default), ``fp16``, ``bf16`` or
    any [hier:]method[:scheme]."""
    if baseline is None:
        return Choice(UNCOMPRESSED)
    if isinstance(baseline, Choice):
        return baseline
    text = baseline.strip().lower()
    return Choice.parse(BASELINE_ALIASES.get(text, text), options)


def baseline_name(choice: Choice) -> str:
    """How a verdict names its baseline: ``fp32`` (uncompressed), ``fp16 gradients`` (a 16-bit
    run's own exchange), else the choice's label."""
    if choice.method == UNCOMPRESSED:
        return "fp32"
    if choice.method in SIXTEEN_BIT and not choice.hierarchical:
        return f"{choice.method} gradients"
    return choice.label


def baseline_scenario(scenario: Scenario, baseline: Choice) -> Scenario:
    """The scenario the baseline's step runs in: for a 16-bit baseline (fp16, bf16) its cast is
    free, since a mixed-precision run's gradients are 16-bit already."""
    if baseline.method not in SIXTEEN_BIT or baseline.hierarchical:
        return scenario
    free = MethodCost(LinearCost(0.0, 0.0), LinearCost(0.0, 0.0))
    return replace(scenario, profile=replace(scenario.profile,
                                             methods={**scenario.profile.methods, baseline.method: free}))


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
    steps_factor: float | None = None  # steps to target / the baseline's; None: unmeasured or not reached
    steps_factor_reached: bool | None = None  # None: unmeasured
    steps_factor_within: float | None = None  # the factor the evidence covers
    time_to_target: float | None = None  # baseline's time to target / this one's (None: unknown)
    judged_on: str = "step time"  # or "time to target"
    verdict_kind: str = ""  # baseline, pays, marginal, does not pay, unmeasured
    quality: dict | None = None  # where the steps factor came from (see quality.Match.to_dict)
    baseline_name: str = "fp32"

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
                   baseline: Scenario | None = None, threshold: float = 1.0) -> float | None:
    """The link bandwidth (Gbit/s) below which ``choice`` beats uncompressed (the highest
    bandwidth where its verdict turns from pays to does-not-pay); None if it never pays in
    ``gbps_range``; the range's top if it still pays there. ``baseline``: the scenario the
    uncompressed step runs in when it is not ``scenario`` (e.g. Gloo's one ring over all ranks
    beside a hierarchical hook's two link classes), both at each tried bandwidth. ``threshold``:
    the step speedup that counts as paying (a steps factor f: time to target needs f)."""
    compare = comparison or _Comparison(scenario, baseline)
    if choice == compare.against:
        return None

    def pays(gbps):
        return compare.speedup(choice, gbps=gbps) > threshold

    grid = _log_grid(*gbps_range, points=33, integer=False)
    last = next((i for i in reversed(range(len(grid))) if pays(grid[i])), None)  # the highest that pays
    if last is None:
        return None
    return grid[-1] if last == len(grid) - 1 else _bisect(pays, grid[last], grid[last + 1], integer=False)


def breakeven_world_size(scenario: Scenario, choice: Choice, max_world_size: int = MAX_WORLD_SIZE,
                         comparison: _Comparison | None = None, threshold: float = 1.0) -> tuple[int | None, bool]:
    """(w, pays_at_2): w is the smallest world size (scanning up from 2) whose verdict differs
    from the verdict at 2 ranks (where an all-gather method stops paying, or where a summable one
    starts to), None if the verdict never changes up to ``max_world_size``. A hierarchical
    choice is scanned from two nodes (gpus_per_node + 1 ranks): inside one node it sends nothing
    compressed."""
    compare = comparison or _Comparison(scenario)
    if choice == compare.against:
        return None, False

    def pays(world_size):
        return compare.speedup(choice, world_size=int(world_size)) > threshold

    lowest = scenario.network.gpus_per_node + 1 if choice.hierarchical else 2
    grid = _log_grid(lowest, max_world_size, points=17, integer=True)
    first = pays(grid[0])
    for a, b in zip(grid, grid[1:]):
        if pays(b) != first:
            return _bisect(pays, a, b, integer=True) + 1, first
    return None, first


def _crossover_text(gbps: float | None, what: str) -> str:
    if gbps is None:
        return f"; never {what} at any bandwidth"
    if gbps >= GBPS_RANGE[1]:
        return f"; {what} at every bandwidth"
    return f"; {what} below {plain(gbps)} Gbit/s"


def _verdict(is_baseline: bool, speedup: float, gbps: float | None, bandwidth_gbps: float,
             crossovers: bool, margin: float, baseline: str) -> str:
    """The step-time verdict (no quality evidence asked for)."""
    if is_baseline:
        return "baseline"
    against = "" if baseline == UNCOMPRESSED else f" over {baseline}"
    kind = verdict_class(speedup, margin)
    text = f"{kind}: {speedup:.2f}x{against} at {plain(bandwidth_gbps)} Gbit/s"
    if kind == "marginal":
        text += f" (within the {plain(margin)}x margin)"
    return text + _crossover_text(gbps, "faster") if crossovers else text


@dataclass(frozen=True)
class Judgement:
    """A choice judged on time to target: ``kind`` (pays, marginal, does not pay, unmeasured),
    its steps factor (a StepsFactor, None: unmeasured), the time-to-target speedup (None: not
    known), the evidence (Match.to_dict, or a record saying why none) and the verdict's text
    before the crossovers."""

    kind: str
    factor: object
    time_to_target: float | None
    evidence: dict
    text: str

    def fields(self) -> dict:
        """The record fields of a judged choice (Estimate's, and the optimizers' JSON)."""
        f = self.factor
        return {"steps_factor": f.value if f else None, "steps_factor_reached": f.reached if f else None,
                "steps_factor_within": f.within if f else None, "time_to_target": self.time_to_target,
                "judged_on": "time to target", "verdict_kind": self.kind, "quality": self.evidence}


def loss_gap_text(gap: float | None) -> str:
    """", final held-out loss +x.x%" (two decimals under 1%), or nothing without a gap."""
    return "" if gap is None else f", final held-out loss {gap:+.{2 if abs(gap) < 0.01 else 1}%}"


UNCOMPRESSED_EVIDENCE = {"source": "reference", "note": "every table row is measured against uncompressed "
                                                        "runs: uncompressed fp32 has factor 1 by definition"}


def judge(choice: Choice, speedup: float, margin: float, quality, sharded: bool, base: str,
          bandwidth_gbps: float):
    """Judge ``choice`` (per-step ``speedup`` over the baseline named ``base``) on time to target
    with the evidence ``quality`` (gradcomp.analysis.quality.Evidence)."""
    from .quality import StepsFactor

    at = f"at {plain(bandwidth_gbps)} Gbit/s"
    if choice.method == UNCOMPRESSED:
        match, evidence = None, dict(UNCOMPRESSED_EVIDENCE)
        factor = StepsFactor(1.0, True, 1.0)
    else:
        match = quality.lookup("fsdp" if sharded else "hook", choice.method, choice.options, choice.scheme)
        if match is None:
            factor, evidence = None, _unmeasured(choice.label, quality.family)
        else:
            factor, evidence = match.decisive_factor, match.to_dict()
            if choice.hierarchical:
                evidence["exact"] = False
                evidence["note"] = "; ".join(filter(None, [evidence["note"], "nearest setting: measured flat "
                                                           "(every rank compressing), not hierarchical"]))
    return _judged(speedup, margin, factor, evidence, base, at)


def _judged(speedup: float, margin: float, factor, evidence: dict, base: str, at: str) -> Judgement:
    if factor is None:
        kind = verdict_class(speedup, margin)
        per_step = {"pays": "faster per step", "marginal": "marginal per step",
                    "does not pay": "slower per step"}[kind]
        return Judgement("unmeasured", None, None, evidence,
                         f"{per_step}, quality {missing_quality(evidence)}: step {speedup:.2f}x over {base} {at}")
    if not factor.reached:
        gap = evidence.get("final_gap")
        tail = loss_gap_text(gap) + (" over the baseline's" if gap is not None else "")
        return Judgement("does not pay", factor, None, evidence,
                         f"does not pay (target not reached within {plain(factor.within)}x steps): step "
                         f"{speedup:.2f}x over {base} {at}{tail}")
    ttt = speedup / factor.value
    kind = verdict_class(ttt, margin)
    text = (f"{kind}: time to target {ttt:.2f}x over {base} (step {speedup:.2f}x, steps x{factor.value:.2f}) {at}")
    if kind == "marginal":
        text += f" (within the {plain(margin)}x margin)"
    return Judgement(kind, factor, ttt, evidence, text)


def missing_quality(evidence: dict) -> str:
    """Why a choice's verdict has no steps factor: "unresolved" (its row's miss is inside its
    workload's null) or "unmeasured" (no row)."""
    return "unresolved" if evidence.get("unresolved") else "unmeasured"


def _unmeasured(what: str, family) -> dict:
    return {"source": "none", "note": f"no recorded run of {what} for this setting (optimizer family: "
                                      f"{family or 'none given: --optimizer-family'})"}


def judge_optimizer(name: str, options: dict, speedup: float, margin: float, quality, base: str,
                    bandwidth_gbps: float) -> Judgement:
    """An optimizer that owns the exchange (gradcomp.analysis.optim: zeroone, dgc, diloco) with
    ``options``, judged as :func:`judge` judges a hook's choice."""
    from .optim import _options

    o = _options(name, options)
    if name == "zeroone":
        method, scheme = o["method"], o["scheme"] or None
    else:  # DGC's top-k; DiLoCo's outer method (None: fp32) with its own scheme, not recorded
        method, scheme = ("topk" if name == "dgc" else o["method"] or UNCOMPRESSED), None
    match = quality.lookup(name, method, options, scheme, error_feedback=None)
    factor, evidence = ((None, _unmeasured(name, quality.family)) if match is None
                        else (match.decisive_factor, match.to_dict()))
    return _judged(speedup, margin, factor, evidence, base, f"at {plain(bandwidth_gbps)} Gbit/s")


def estimate(scenario: Scenario, choices: list[Choice] | None = None, crossovers: bool = True,
             margin: float = DEFAULT_MARGIN, baseline: Choice | str | None = None,
             quality=None) -> list[Estimate]:
    """One Estimate per choice (the baseline first, added when missing: ``none``, uncompressed
    fp32, unless ``baseline`` names another choice, e.g. ``"fp16"`` or ``"bf16"``: a
    mixed-precision run, whose exchange is charged no cast); the speedup of each is its step
    against the baseline's. ``quality`` (gradcomp.analysis.quality.Evidence): the verdict is on
    time to target (module doc); without it, on step time. ``pays`` and the verdict need a
    speedup of at least ``margin``. ``crossovers`` also searches the break-even bandwidth and
    world size (slower): where time to target crosses the baseline's for a choice with a steps
    factor, where step time does otherwise (none for a choice that does not reach the target)."""
    margin = check_margin(margin)
    against = parse_baseline(baseline)
    choices = list(choices) if choices else default_choices(sharded=scenario.sharded)
    choices = [c for c in choices if c != against]
    choices.insert(0, against)
    if not any(c.method == UNCOMPRESSED for c in choices):
        choices.insert(1, Choice(UNCOMPRESSED))
    base_scenario = baseline_scenario(scenario, against)
    compare = _Comparison(scenario, None if base_scenario is scenario else base_scenario, against=against)
    base = simulate(base_scenario, against, compare.baseline_buckets)
    name = baseline_name(against)
    bandwidth = scenario.network.link.bandwidth_gbps
    out = []
    for choice in choices:
        is_baseline = choice == against
        step = base if is_baseline else simulate(scenario, choice, compare.buckets)
        speedup = base.step_s / step.step_s
        # uncompressed against a compressed baseline: no crossover searched (it wins at high bandwidth)
        search = crossovers and choice.method != UNCOMPRESSED and not is_baseline
        extra: dict = {"baseline_name": name}
        threshold = 1.0
        if quality is not None:
            if is_baseline:
                extra.update(steps_factor=1.0, steps_factor_reached=True, steps_factor_within=1.0, time_to_target=1.0,
                             judged_on="time to target", verdict_kind="baseline",
                             quality={"source": "baseline", "note": "the baseline sets the target: its own "
                                                                    "final held-out loss, factor 1"})
            else:
                j = judge(choice, speedup, margin, quality, scenario.sharded, name, bandwidth)
                extra.update(j.fields())
                if j.factor is not None:
                    if j.factor.reached:
                        threshold = j.factor.value
                    else:
                        search = False  # no bandwidth brings it to the target sooner
        gbps = breakeven_gbps(scenario, choice, comparison=compare, threshold=threshold) if search else None
        world, below = (breakeven_world_size(scenario, choice, comparison=compare, threshold=threshold)
                        if search else (None, None))
        if quality is None or is_baseline:
            verdict = _verdict(is_baseline, speedup, gbps, bandwidth, search, margin, against.label)
            kind = "baseline" if is_baseline else verdict_class(speedup, margin)
            pays = not is_baseline and speedup >= margin
            extra.setdefault("verdict_kind", kind)
        else:
            kind = extra["verdict_kind"]
            what = "sooner to the target" if extra["time_to_target"] is not None else "faster per step"
            verdict = j.text + (_crossover_text(gbps, what) if search else "")
            pays = kind == "pays"
        # under FSDP every method runs the same row exchange: the scheme is not part of its name
        label, scheme = (choice.method, "rows") if scenario.sharded else (choice.label, choice.scheme)
        out.append(Estimate(label, scheme, dict(choice.options), step.wire_bytes, step.exact_bytes, step.comm_s,
                            step.exposed_comm_s, step.compress_s, step.step_s, speedup,
                            pays, gbps, world, below if world is not None else None, verdict, margin, against.label,
                            **extra))
    return out
