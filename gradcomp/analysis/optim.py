"""Wire bytes and step time of gradcomp.optim's optimizers over a run, warm-up amortised.

The optimizers exchange once per step after backward (no overlap with it): a step costs
forward + backward + optimizer + the exchange's compress, collectives and decode. Bytes per
exchange are what :class:`gradcomp.optim.exchange.Exchange` counts (the DDP hooks' rule):
fp32 all-reduce 4n; a payload all-gathered or all-reduced once; the two-phase all-reduce the
padded tensor's payload plus one re-compressed chunk. A run's bytes follow the optimizer's own
schedule (``exchange_schedule``, ``dgc_density``, DiLoCo's ``fragments_due``: one exchange of
each fragment's pseudo-gradient every ``sync_every`` inner steps), so the ratio includes the warm-up.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..methods import UNCOMPRESSED, get_method
from ..schemes import SCHEMES
from ..checks import check_number
from ..schedules import COMPRESSED, FULL, dgc_density, exchange_schedule, fragment_bounds, fragments_due
from .costmodel import Choice, simulate

OPTIMIZERS = ("zeroone", "dgc", "diloco")
FP32_BYTES = 4
ZEROONE_DEFAULTS = dict(warmup_steps=100, warmup_method=None, warmup_options=None, warmup_scheme="",
                        var_refresh_interval=0,
                        var_freeze_step=None, sync_every=1, sync_growth=0, method="sign", method_options=None,
                        scheme="twophase", local_updates="shared")  # local_updates: same bytes either way
DGC_DEFAULTS = dict(density=0.001, warmup_steps=0, initial_density=0.25, selector="exact")
DILOCO_DEFAULTS = dict(sync_every=100, method="int8", method_options=None, scheme="", fragments=1)  # bytes


def exchange_bytes(method, scheme: str, numel: int, world: int) -> int:
    """Wire bytes per rank of one exchange of ``numel`` fp32 elements (method None: fp32)."""
    if method is None:
        return FP32_BYTES * numel
    return SCHEMES[scheme].wire_bytes(method, numel, world)


def _options(name: str, options: dict) -> dict:
    defaults = {"zeroone": ZEROONE_DEFAULTS, "dgc": DGC_DEFAULTS, "diloco": DILOCO_DEFAULTS}.get(name)
    if defaults is None:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    unknown = set(options) - set(defaults)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **options}


def exchanges(name: str, numel: int, world: int, run_steps: int, **options) -> list[tuple]:
    """Per step of a ``run_steps`` run: (method or None, scheme, elements) exchanged, None on a
    local step."""
    o = _options(name, options)
    if name == "dgc":
        return [(get_method("topk", ratio=dgc_density(t, o["density"], o["warmup_steps"], o["initial_density"]),
                            selector=o["selector"]), "allgather", numel) for t in range(run_steps)]
    if name == "diloco":
        check_number("diloco", "sync_every", o["sync_every"], 1, integer=True)
        check_number("diloco", "fragments", o["fragments"], 1, o["sync_every"], integer=True)
        method = None if o["method"] is None else get_method(o["method"], **(o["method_options"] or {}))
        scheme = (o["scheme"] or method.schemes[0]) if method else ""
        sizes = [end - start for start, end in fragment_bounds(numel, o["fragments"])]
        due = (fragments_due(t, o["sync_every"], o["fragments"]) for t in range(run_steps))
        return [(method, scheme, sizes[fragments[0]]) if fragments else None for fragments in due]
    warm = None if o["warmup_method"] is None else get_method(o["warmup_method"], **(o["warmup_options"] or {}))
    compressed = (get_method(o["method"], **(o["method_options"] or {})), o["scheme"], numel)
    plan = {FULL: (warm, (o["warmup_scheme"] or warm.schemes[0]) if warm else "", numel), COMPRESSED: compressed}
    return [plan.get(phase) for phase in exchange_schedule(run_steps, o["warmup_steps"], o["var_refresh_interval"],
                                                            o["var_freeze_step"], o["sync_every"],
                                                            o["sync_growth"])]


@dataclass(frozen=True)
class OptimizerEstimate:
    """One optimizer over a run: bytes per rank (amortised per step) and mean seconds per step."""

    optimizer: str
    options: dict
    run_steps: int
    wire_bytes: int
    wire_bytes_per_step: float
    ratio: float
    comm_s: float
    compress_s: float
    step_s: float
    speedup: float

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def run_wire_bytes(name: str, numel: int, world: int, run_steps: int, **options) -> int:
    """Wire bytes per rank of a whole run (warm-up included)."""
    cache: dict = {}
    total = 0
    for exchange in exchanges(name, numel, world, run_steps, **options):
        if exchange is not None:
            if exchange not in cache:
                cache[exchange] = exchange_bytes(*exchange, world)
            total += cache[exchange]
    return total


def _exchange_seconds(exchange, scenario) -> tuple[float, float]:
    """(collective seconds, compress + decode seconds) of one exchange (method, scheme, elements)."""
    method, scheme, n = exchange
    net = scenario.network
    if method is None:
        return net.allreduce_s(FP32_BYTES * n), 0.0
    stages, _ = SCHEMES[scheme].stages(method, scenario.profile.method(method.name), n, net)
    return (sum(s for resource, s in stages if resource == "network"),
            sum(s for resource, s in stages if resource == "compute"))


def estimate_optimizer(scenario, name: str, run_steps: int, baseline: Choice | None = None,
                       baseline_scenario=None, **options) -> OptimizerEstimate:
    """Mean step time and bytes of optimizer ``name`` on ``scenario`` over ``run_steps`` steps,
    against DDP with ``baseline`` (default uncompressed; its exchange overlapped with backward,
    as the cost model has it), simulated in ``baseline_scenario`` when given (a 16-bit
    baseline's: gradcomp.analysis.breakeven.baseline_scenario)."""
    check_number("", "run_steps", run_steps, 1, integer=True)
    n, world = scenario.model.numel, scenario.network.world_size
    compute = scenario.compute
    base_s = compute.forward_s + compute.backward_s + compute.optimizer_s
    comm_s = compress_s = 0.0
    seconds: dict = {}
    for exchange in exchanges(name, n, world, run_steps, **options):
        if exchange is not None:
            if exchange not in seconds:
                seconds[exchange] = _exchange_seconds(exchange, scenario)
            comm_s += seconds[exchange][0]
            compress_s += seconds[exchange][1]
    wire = run_wire_bytes(name, n, world, run_steps, **options)
    step_s = base_s + (comm_s + compress_s) / run_steps
    baseline_s = simulate(baseline_scenario or scenario, baseline or Choice(UNCOMPRESSED)).step_s
    return OptimizerEstimate(name, dict(options), run_steps, wire, wire / run_steps,
                             FP32_BYTES * n * run_steps / wire if wire else float("inf"),
                             comm_s / run_steps, compress_s / run_steps, step_s, baseline_s / step_s)
