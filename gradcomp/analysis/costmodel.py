"""The break-even cost model: one training step of DDP with a compression hook, simulated.

DDP splits the gradients into buckets (in reverse registration order: the first holds at most
1 MiB, the others 25 MiB) and runs the hook on each bucket as soon as backward has produced its
gradients, so communication overlaps the rest of backward. Two resources run in parallel:
``compute`` (backward, then the hook's compress/decompress work, which sits on the critical path
as it does on a GPU stream) and ``network`` (one collective at a time). Each bucket is a chain of
stages alternating between them, by communication scheme:

  none       average | all-reduce of the fp32 bucket
  allreduce  average, compress | all-reduce(payload) | decompress
  allgather  average, compress | all-gather(payload) | decompress-and-sum p payloads
  twophase   average, compress | all-to-all(payload) | decompress p chunks of n/p, sum, compress n/p
             | all-gather(chunk payloads) | decompress
  lowrank    compress (M Q) | all-reduce(P) | compress (M^T P) | all-reduce(Q) | decompress

Which schemes a method offers, and whether it compresses tensor by tensor, is the method's own
(``Method.schemes``, ``Method.per_tensor``): every registered method is modelled.

Tasks start in the order they become ready (ties: the earlier bucket); the step ends when the
last task ends, plus the optimizer. Exposed communication = step time - busy compute time.
"average" is the in-place 1/world_size scaling DDP applies to a bucket before communicating it.

With ``Scenario.host_contends`` (CPU ranks: Gloo copies, reduces and runs TCP on the cores that
also run backward and the hooks) each collective's host share, its links' ``per_byte_s`` part,
is also a task on ``compute``, ready with the collective; the bucket's next stage waits for both.
Overlapped communication then costs compute time, and a collective whose CPU work has to wait
for busy cores finishes late. On GPUs (NCCL on its own stream) it is off.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..methods import METHODS, REGISTRY, get_method
from .collectives import Network
from .models import ModelSpec
from .profile import Compute, Profile

UNCOMPRESSED = "none"


def schemes(method: str) -> tuple[str, ...]:
    """The schemes of ``method`` (a registered name, or ``none``: uncompressed all-reduce)."""
    if method == UNCOMPRESSED:
        return ("allreduce",)
    if method not in REGISTRY:
        raise ValueError(f"unknown method {method!r}; choose none or one of {', '.join(METHODS)}")
    return REGISTRY[method].schemes

DDP_BUCKET_CAP_MB = 25.0
DDP_FIRST_BUCKET_MB = 1.0
BYTES_PER_ELEMENT = 4  # fp32 gradients
GBPS_RANGE = (1e-3, 1e5)
MAX_WORLD_SIZE = 1 << 16


@dataclass(frozen=True)
class Choice:
    """A method with its options and communication scheme (``none``: uncompressed fp32)."""

    method: str
    options: dict = field(default_factory=dict)
    scheme: str = ""

    def __post_init__(self):
        offered = schemes(self.method)
        if not self.scheme:
            object.__setattr__(self, "scheme", offered[0])
        elif self.scheme not in offered:
            raise ValueError(f"{self.method} has no scheme {self.scheme!r}; it offers {', '.join(offered)}")
        if self.method != UNCOMPRESSED:
            get_method(self.method, **self.options)  # validates the options

    @property
    def label(self) -> str:
        """``int8:twophase`` when the method offers several schemes, else the method's name."""
        return self.method if len(schemes(self.method)) == 1 else f"{self.method}:{self.scheme}"

    @classmethod
    def parse(cls, text: str, options: dict | None = None) -> Choice:
        """``"int8"`` or ``"int8:twophase"`` (method[:scheme]) with the method's options."""
        method, _, scheme = text.strip().lower().partition(":")
        return cls(method, dict(options or {}), scheme)


def default_choices() -> list[Choice]:
    """Uncompressed, then every registered method under every scheme it offers."""
    return [Choice(m, {}, s) for m in (UNCOMPRESSED, *METHODS) for s in schemes(m)]


@dataclass(frozen=True)
class Bucket:
    """A DDP bucket: its parameters' shapes and its share of the backward compute (0..1)."""

    shapes: tuple[tuple[int, ...], ...]
    backward_share: float

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def ddp_buckets(model: ModelSpec, cap_mb: float = DDP_BUCKET_CAP_MB,
                first_mb: float = DDP_FIRST_BUCKET_MB) -> list[Bucket]:
    """DDP's bucket assignment (reverse registration order; a bucket closes once it reaches its
    cap), in the order backward makes them ready. Backward share by FLOPs, else by elements."""
    if not cap_mb > 0 or not first_mb > 0:
        raise ValueError(f"bucket caps must be > 0 MB, got {cap_mb!r} and {first_mb!r}")
    use_flops = model.forward_flops > 0
    total = model.forward_flops if use_flops else model.numel
    buckets, shapes, size, weight = [], [], 0, 0.0
    for p in reversed(model.parameters):
        shapes.append(p.shape)
        size += p.numel * BYTES_PER_ELEMENT
        weight += p.flops if use_flops else p.numel
        if size >= (first_mb if not buckets else cap_mb) * 2 ** 20:
            buckets.append(Bucket(tuple(shapes), weight / total))
            shapes, size, weight = [], 0, 0.0
    if shapes:
        buckets.append(Bucket(tuple(shapes), weight / total))
    return buckets


@dataclass(frozen=True)
class Scenario:
    """Everything one prediction needs: model, network, device costs and the step's compute."""

    model: ModelSpec
    network: Network
    profile: Profile
    compute: Compute
    bucket_cap_mb: float = DDP_BUCKET_CAP_MB
    host_contends: bool = False  # see the module doc

    def with_bandwidth(self, gbps: float) -> Scenario:
        return replace(self, network=self.network.with_bandwidth(gbps))

    def with_world_size(self, world_size: int) -> Scenario:
        return replace(self, network=self.network.with_world_size(world_size))


def _bucket_stages(choice: Choice, bucket: Bucket, scenario: Scenario) -> tuple[list, int]:
    """The (resource, seconds) chain of one bucket under ``choice``, and its wire bytes per rank."""
    net, n, p = scenario.network, bucket.numel, scenario.network.world_size
    average = ("compute", scenario.profile.average(n))
    if choice.method == UNCOMPRESSED:
        wire = n * BYTES_PER_ELEMENT
        return [average, ("network", net.allreduce_s(wire))], wire
    method = get_method(choice.method, **choice.options)
    cost = scenario.profile.method(choice.method)
    if method.per_tensor:
        wire = sum(method.wire_bytes(math.prod(s), s) for s in bucket.shapes)
    else:
        wire = method.wire_bytes(n)
    compress = ("compute", scenario.profile.average(n) + cost.compress(n))
    if choice.scheme == "allreduce":
        return [compress, ("network", net.allreduce_s(wire)), ("compute", cost.decompress_s(n))], wire
    if choice.scheme == "allgather":
        return [compress, ("network", net.allgather_s(wire)), ("compute", cost.decompress_s(n, p))], wire
    if choice.scheme == "twophase":
        chunk = -(-n // p)
        chunk_wire = method.wire_bytes(chunk)
        reduce_chunk = cost.decompress_s(chunk, p) + cost.compress(chunk)
        return [compress, ("network", net.alltoall_s(p * chunk_wire)), ("compute", reduce_chunk),
                ("network", net.allgather_s(chunk_wire)), ("compute", cost.decompress_s(n))], \
            p * chunk_wire + chunk_wire
    # lowrank: two all-reduces (P with the uncompressed tensors, then Q), the compress split
    # evenly around the first (ring cost is linear in bytes, so an even split of the wire bytes
    # gives the same total as the true P/Q split); it averages the small reduced results only
    half = ("compute", cost.compress(n) / 2)
    all_reduce_half = ("network", net.allreduce_s(wire / 2))
    return [half, all_reduce_half, half, all_reduce_half, ("compute", cost.decompress_s(n))], wire


@dataclass(frozen=True)
class StepTime:
    """One simulated step (seconds): total, busy compute, network busy, compress+decompress."""

    step_s: float
    compute_busy_s: float
    comm_s: float
    compress_s: float
    wire_bytes: int

    @property
    def exposed_comm_s(self) -> float:
        return max(self.step_s - self.compute_busy_s, 0.0)


def simulate(scenario: Scenario, choice: Choice, buckets: list[Bucket] | None = None) -> StepTime:
    """Simulate one step of ``scenario`` under ``choice`` (see the module docstring)."""
    compute = scenario.compute
    buckets = buckets if buckets is not None else ddp_buckets(scenario.model, scenario.bucket_cap_mb)
    resource, duration, successors, pending = [], [], [], []

    def task(res, seconds, after):
        resource.append(res)
        duration.append(seconds)
        successors.append([])
        pending.append(len(after))
        for t in after:
            successors[t].append(len(resource) - 1)
        return len(resource) - 1

    wire_total, backward_task, compress_s = 0, None, 0.0
    hostless = (replace(scenario, network=scenario.network.without_host_cost())
                if scenario.host_contends else None)
    for bucket in buckets:
        backward_task = task("compute", compute.backward_s * bucket.backward_share,
                             [] if backward_task is None else [backward_task])
        stages, wire = _bucket_stages(choice, bucket, scenario)
        wire_total += wire
        # seconds of each stage that are host work (0 for every stage without host contention)
        host = [0.0] * len(stages) if hostless is None else [
            seconds - free
            for (_, seconds), (_, free) in zip(stages, _bucket_stages(choice, bucket, hostless)[0])]
        previous = [backward_task]
        for i, (res, seconds) in enumerate(stages):
            current = [task(res, seconds, previous)]
            if res == "network" and host[i] > 0:
                current.append(task("compute", host[i], previous))  # the collective's CPU work
            previous = current
            compress_s += seconds if res == "compute" else 0.0

    free = {"compute": compute.forward_s, "network": compute.forward_s}
    ready_heaps = {"compute": [], "network": []}
    ready_at = [0.0] * len(resource)
    for t, count in enumerate(pending):
        if count == 0:
            heapq.heappush(ready_heaps[resource[t]], (compute.forward_s, t))
    end = compute.forward_s
    while ready_heaps["compute"] or ready_heaps["network"]:
        starts = [(max(free[r], h[0][0]), h[0][1], r) for r, h in ready_heaps.items() if h]
        start, t, res = min(starts)
        heapq.heappop(ready_heaps[res])
        finish = start + duration[t]
        free[res] = finish
        end = max(end, finish)
        for s in successors[t]:
            ready_at[s] = max(ready_at[s], finish)
            pending[s] -= 1
            if pending[s] == 0:
                heapq.heappush(ready_heaps[resource[s]], (ready_at[s], s))
    comm_s = sum(d for d, r in zip(duration, resource) if r == "network")
    busy = compute.forward_s + compute.backward_s + compress_s + compute.optimizer_s
    return StepTime(end + compute.optimizer_s, busy, comm_s, compress_s, wire_total)


@dataclass(frozen=True)
class Estimate:
    """The verdict for one method (a JSON record through ``to_dict``). Seconds per step."""

    method: str
    scheme: str
    options: dict
    wire_bytes: int
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
    uncompressed step is simulated once per point and reused)."""

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.buckets = ddp_buckets(scenario.model, scenario.bucket_cap_mb)
        self._baseline: dict = {}

    def speedup(self, choice: Choice, gbps: float | None = None, world_size: int | None = None) -> float:
        s = self.scenario
        if gbps is not None:
            s = s.with_bandwidth(gbps)
        if world_size is not None:
            s = s.with_world_size(world_size)
        key = (gbps, world_size)
        if key not in self._baseline:
            self._baseline[key] = simulate(s, Choice("none"), self.buckets).step_s
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
                   comparison: _Comparison | None = None) -> float | None:
    """The link bandwidth (Gbit/s) below which ``choice`` beats uncompressed (the highest
    bandwidth where its verdict turns from pays to does-not-pay); None if it never pays in
    ``gbps_range``; the range's top if it still pays there."""
    if choice.method == UNCOMPRESSED:
        return None
    compare = comparison or _Comparison(scenario)

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
    starts to), None if the verdict never changes up to ``max_world_size``."""
    if choice.method == UNCOMPRESSED:
        return None, False
    compare = comparison or _Comparison(scenario)

    def pays(world_size):
        return compare.speedup(choice, world_size=int(world_size)) > 1.0

    grid = _log_grid(2, max_world_size, points=17, integer=True)
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
    choices = list(choices) if choices else default_choices()
    if not any(c.method == "none" for c in choices):
        choices.insert(0, Choice("none"))
    compare = _Comparison(scenario)
    base = simulate(scenario, Choice("none"), compare.buckets)
    out = []
    for choice in choices:
        step = simulate(scenario, choice, compare.buckets)
        speedup = base.step_s / step.step_s
        gbps = breakeven_gbps(scenario, choice, comparison=compare) if crossovers else None
        world, below = breakeven_world_size(scenario, choice, comparison=compare) if crossovers else (None, None)
        verdict = _verdict(choice, speedup, gbps, scenario.network.link.bandwidth_gbps, crossovers)
        out.append(Estimate(choice.label, choice.scheme, dict(choice.options), step.wire_bytes, step.comm_s,
                            step.exposed_comm_s, step.compress_s, step.step_s, speedup,
                            choice.method != "none" and speedup > 1.0, gbps, world,
                            below if world is not None else None, verdict))
    return out


def sweep_bandwidth(scenario: Scenario, choices: list[Choice], gbps_values) -> dict[str, list[float]]:
    """Step seconds per choice label at each bandwidth of ``gbps_values``."""
    result = {}
    for choice in choices:
        result[choice.label] = [simulate(scenario.with_bandwidth(g), choice).step_s for g in gbps_values]
    return result
