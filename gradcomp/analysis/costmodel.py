"""The cost model: one training step of DDP with a compression hook, simulated (the break-even
search over it and the verdicts: gradcomp.analysis.breakeven).

DDP splits the gradients into buckets (in reverse registration order: the first holds at most
1 MiB, the others 25 MiB) and runs the hook on each bucket as soon as backward has produced its
gradients, so communication overlaps the rest of backward. Two resources run in parallel:
``compute`` (backward, then the hook's compress/decompress work, which sits on the critical path
as it does on a GPU stream) and ``network`` (one collective at a time). Each bucket is a chain of
stages alternating between them, by communication scheme (each scheme's stages are its own:
``gradcomp.schemes.Scheme.stages``, which the optimizer analysis prices with too):

  none       average | all-reduce of the fp32 bucket
  allreduce  average, compress | all-reduce(payload) | decompress
  allgather  average, compress | all-gather(payload) | decompress-and-sum p payloads
  twophase   average, compress | all-to-all(payload) | decompress p chunks of c, sum, compress c
             | all-gather(chunk payloads) | decompress   (c: n/p rounded up to whole granules)
  lowrank    compress (M Q) | all-reduce(P) | compress (M^T P) | all-reduce(Q) | decompress

Which schemes a method offers, and whether it compresses tensor by tensor, is the method's own
(``Method.schemes``, ``Method.per_tensor``): every registered method is modelled.

Hierarchical choices (``Choice.hierarchical``, gradcomp.hooks.hierarchical; ranks in nodes of g)
reduce exactly inside the node and compress only between nodes, on a bucket of n elements cut in
g shards of s = n / g:

  hierarchical  average | reduce-scatter(intra, 4 n) | compress(s) | the scheme's exchange of the
                shard between the nodes (one rank per node) | decompress | all-gather(intra, 4 n)

(uncompressed ``none`` across nodes is already two-level: reduce-scatter, ring all-reduce of n / g
between nodes, all-gather). A reduce-scatter is priced as the all-gather of its result unless the
network has a link fitted to the backend's own reduce-scatter (``Network.intra_reduce_scatter``,
``Network.reduce_scatter_link``: Gloo's). ``Scenario.sharded`` models FSDP2 instead of DDP (gradcomp.fsdp):
the buckets are FSDP units (``fsdp_units``: every numbered block and the root), whose parameters
are all-gathered uncompressed before the unit's forward and again before its backward (one unit
ahead of the compute, as FSDP prefetches), and whose gradients are reduce-scattered:

  none     reduce-scatter(4 n) (ring)
  sharded  compress p - 1 rows of n / p | all-to-all of p row payloads | decode-and-sum p - 1 rows

Only the rows for other ranks cross the wire; the optimizer updates 1 / p of the parameters.
FSDP2 runs its own reduce-scatter asynchronously (the next unit's backward overlaps it) but calls
a custom one (gradcomp.fsdp's) synchronously: the next unit's backward waits for the decode.

A deferred collective (``Scheme.deferred``: two-phase's all-gather, queued by the callback that
re-compresses the chunk) is launched by the next bucket's hook, which first waits for its inputs
(``Deferred.flush`` on the hook's thread, the thread that runs backward): that hook's first stage
waits for them, the collective for that hook, and the next backward for that first stage; the
last bucket's is launched at the end of its own hook.

Tasks start in the order they become ready (ties: the earlier bucket); the step ends when the
last task ends, plus the optimizer. (A greedy list schedule: a faster link can, rarely, make a
step slower, when a collective's callback work becomes ready just before a piece of backward and
delays it; seen for PowerSGD's large per-tensor costs, by up to 6%.) Exposed communication = step time - busy compute time.
"average" is the in-place 1/world_size scaling DDP applies to a bucket before communicating it.

With ``Scenario.host_contends`` (CPU ranks: Gloo copies, reduces and runs TCP on the cores that
also run backward and the hooks) each collective's host share, its links' ``per_byte_s`` part,
is also a task on ``compute``, ready with the collective; the bucket's next stage waits for both.
Overlapped communication then costs compute time, and a collective whose CPU work has to wait
for busy cores finishes late. On GPUs (NCCL on its own stream) it is off.

With ``Scenario.ranks_per_core`` r > 1 (CPU ranks that outnumber their host's cores, e.g. 4 ranks
on 2 cores) every compute stage the profile prices (forward, backward, optimizer, averaging,
compress, decompress: each measured by a rank on a core of its own,
``gradcomp.analysis.calibrate.in_waves``) takes r times its seconds: the ranks run the same stages
at the same time and share the cores. A collective's host share is not scaled: its sweep already
ran on every rank at once.

With ``Scenario.sync_wait`` (CPU ranks: their compute drifts apart on shared cores, and a
collective starts when the slowest rank issues it) a collective issued right after compute starts
``sync_wait(c)`` later, c the compute seconds since the ranks last waited together (for a
collective the compute had to wait for, or the end of the last step: the optimizer and, for DDP,
forward); measured by ``gradcomp.analysis.calibrate.measure_sync_wait``. Default 0.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..methods import METHODS, REGISTRY, UNCOMPRESSED, get_method
from ..schemes import SCHEMES, shard_size
from .collectives import Network
from .models import ModelSpec
from .profile import Compute, LinearCost, Profile


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


@dataclass(frozen=True)
class Choice:
    """A method with its options and communication scheme (``none``: uncompressed fp32)."""

    method: str
    options: dict = field(default_factory=dict)
    scheme: str = ""
    hierarchical: bool = False  # exact inside a node, compressed between nodes

    def __post_init__(self):
        offered = schemes(self.method)
        if not self.scheme:
            object.__setattr__(self, "scheme", offered[0])
        elif self.scheme not in offered:
            raise ValueError(f"{self.method} has no scheme {self.scheme!r}; it offers {', '.join(offered)}")
        if self.method != UNCOMPRESSED:
            get_method(self.method, **self.options)  # validates the options
        if self.hierarchical and (self.method == UNCOMPRESSED or SCHEMES[self.scheme].per_tensor):
            raise ValueError(f"{self.method} has no hierarchical form (uncompressed all-reduce across "
                             "nodes is already two-level; the low-rank scheme has no hierarchical hook)")

    @property
    def label(self) -> str:
        """``int8:twophase`` when the method offers several schemes, else the method's name;
        ``hier:`` in front of a hierarchical choice."""
        name = self.method if len(schemes(self.method)) == 1 else f"{self.method}:{self.scheme}"
        return f"{HIERARCHICAL_PREFIX}{name}" if self.hierarchical else name

    @classmethod
    def parse(cls, text: str, options: dict | None = None) -> Choice:
        """``"int8"``, ``"int8:twophase"`` or ``"hier:int8:twophase"`` ([hier:]method[:scheme])
        with the method's options."""
        text = text.strip().lower()
        hierarchical = text.startswith(HIERARCHICAL_PREFIX)
        method, _, scheme = text.removeprefix(HIERARCHICAL_PREFIX).partition(":")
        return cls(method, dict(options or {}), scheme, hierarchical)


HIERARCHICAL_PREFIX = "hier:"


def shardable(method: str) -> bool:
    """Whether FSDP can reduce-scatter with ``method``: every method but the low-rank one (an
    FSDP row is a flat concatenation of parameter shards, no matrix)."""
    return method == UNCOMPRESSED or not get_method(method).per_tensor


def default_choices(hierarchical: bool = False, sharded: bool = False) -> list[Choice]:
    """Uncompressed, then every registered method under every scheme it offers; with
    ``hierarchical`` also the hierarchical form of each; ``sharded`` (FSDP: one row exchange,
    whatever the scheme): every method FSDP can use, once."""
    if sharded:
        return [Choice(m) for m in (UNCOMPRESSED, *METHODS) if shardable(m)]
    flat = [Choice(m, {}, s) for m in (UNCOMPRESSED, *METHODS) for s in schemes(m)]
    if not hierarchical:
        return flat
    return flat + [replace(c, hierarchical=True) for c in flat
                   if c.method != UNCOMPRESSED and not SCHEMES[c.scheme].per_tensor]


@dataclass(frozen=True)
class Bucket:
    """A DDP bucket: its parameters' shapes and its share of the backward compute (0..1)."""

    shapes: tuple[tuple[int, ...], ...]
    backward_share: float

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def ddp_buckets(model: ModelSpec, cap_mb: float | None = None) -> list[Bucket]:
    """DDP's bucket assignment (reverse registration order; a bucket closes once it reaches its
    cap), in the order backward makes them ready. ``cap_mb`` None: DDP's default (a first bucket
    of DDP_FIRST_BUCKET_MB, then DDP_BUCKET_CAP_MB); a number: ``DDP(bucket_cap_mb=cap_mb)``, every
    bucket up to it (DDP keeps its small first bucket only for the default cap: torch 2.13, as
    tests/test_analysis.py checks against DDP itself). Backward share by FLOPs, else by elements."""
    if cap_mb is not None and not cap_mb > 0:
        raise ValueError(f"bucket cap must be > 0 MB (None: DDP's default), got {cap_mb!r}")
    first_mb, cap_mb = (DDP_FIRST_BUCKET_MB, DDP_BUCKET_CAP_MB) if cap_mb is None else (cap_mb, cap_mb)
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


def fsdp_units(model: ModelSpec) -> list[Bucket]:
    """The units of ``fully_shard`` applied to every numbered block (``layers.3``, ``h.0``,
    ``layer1.2``: a name up to its first numeric part) and to the root (every other parameter),
    in the order backward reaches them (the reverse of their first parameter's registration).
    Backward share by FLOPs, else by elements."""
    use_flops = model.forward_flops > 0
    total = model.forward_flops if use_flops else model.numel
    units: dict[str, list] = {}
    for p in model.parameters:
        parts = p.name.split(".")
        numbered = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
        units.setdefault(".".join(parts[:numbered + 1]) if numbered is not None else "", []).append(p)
    return [Bucket(tuple(p.shape for p in params), sum(p.flops if use_flops else p.numel for p in params) / total)
            for params in reversed(list(units.values()))]


def step_buckets(scenario: Scenario) -> list[Bucket]:
    """What one step communicates in: FSDP units when sharded, else DDP's buckets."""
    if scenario.sharded:
        return fsdp_units(scenario.model)
    return ddp_buckets(scenario.model, scenario.bucket_cap_mb)


@dataclass(frozen=True)
class Scenario:
    """Everything one prediction needs: model, network, device costs and the step's compute."""

    model: ModelSpec
    network: Network
    profile: Profile
    compute: Compute
    bucket_cap_mb: float | None = None  # DDP's bucket_cap_mb; None: DDP's default (ddp_buckets)
    host_contends: bool = False  # see the module doc
    sharded: bool = False  # FSDP2 (gradcomp.fsdp) instead of DDP: see the module doc
    ranks_per_core: float = 1.0  # CPU ranks per core of their host, when above 1: see the module doc
    sync_wait: LinearCost = LinearCost(0.0, 0.0)  # a collective's wait for the slowest rank: the module doc
    # another implementation's PowerSGD matrix view: shape -> (n, m, r) or None (sent whole), in place of
    # gradcomp's (gradcomp.analysis.implementations, rule 5); None: gradcomp's hook
    low_rank_view: object = None

    def __post_init__(self):
        if not (isinstance(self.ranks_per_core, (int, float)) and math.isfinite(self.ranks_per_core)
                and self.ranks_per_core >= 1):
            raise ValueError(f"ranks_per_core must be a finite number >= 1 (ranks per core when the "
                             f"ranks outnumber the cores; 1 otherwise), got {self.ranks_per_core!r}")
        if not isinstance(self.sync_wait, LinearCost):
            raise TypeError(f"sync_wait must be a LinearCost (seconds as a line in the compute seconds "
                            f"since the ranks last waited together), got {type(self.sync_wait).__name__}")

    def with_bandwidth(self, gbps: float) -> Scenario:
        return replace(self, network=self.network.with_bandwidth(gbps))

    def with_world_size(self, world_size: int) -> Scenario:
        return replace(self, network=self.network.with_world_size(world_size))


def _bucket_stages(choice: Choice, bucket: Bucket, scenario: Scenario) -> tuple[list, int, int, int | None]:
    """The (resource, seconds) chain of one bucket under ``choice``, its compressed (or, for
    ``none``, all-reduced or reduce-scattered) bytes per rank, its bytes per rank in exact
    collectives besides (hierarchical: intra-node; sharded: parameter all-gathers, not here), and
    the index of its deferred collective in the chain (None: none; see :func:`_deferred_at`)."""
    if scenario.sharded:
        return _sharded_stages(choice, bucket, scenario) + (0, None)
    if choice.hierarchical:
        return _hierarchical_stages(choice, bucket, scenario)
    net, n = scenario.network, bucket.numel
    if choice.method == UNCOMPRESSED:
        wire = n * BYTES_PER_ELEMENT
        return [("compute", scenario.profile.average(n)), ("network", net.allreduce_s(wire))], wire, 0, None
    stages, wire = _compressed_stages(choice, bucket.shapes, n, net, scenario.profile,
                                      scenario.profile.average(n), scenario.low_rank_view)
    return stages, wire, 0, _deferred_at(choice, stages)


def _deferred_at(choice: Choice, stages: list, offset: int = 0) -> int | None:
    """Index (plus ``offset``) in ``stages`` of the collective a deferred scheme (``Scheme.deferred``:
    two-phase's all-gather) leaves in the front's queue: its last network stage; None otherwise."""
    if not SCHEMES[choice.scheme].deferred:
        return None
    return offset + max(i for i, (res, _) in enumerate(stages) if res == "network")


def _compressed_stages(choice: Choice, shapes, n: int, net: Network, profile: Profile,
                       average_s: float, view=None) -> tuple[list, int]:
    """Stages and wire bytes per rank of ``choice``'s scheme on n elements (of ``shapes``) over
    ``net``, after ``average_s`` of averaging; a per-tensor method's compress also pays its
    fixed cost per compressed tensor (``MethodCost.per_tensor_s``), and so does any method whose
    cost has one for its decode (``MethodCost.per_tensor_decode_s``: another implementation that
    runs tensor by tensor, gradcomp.analysis.implementations) or its compress. ``view``: another
    implementation's PowerSGD matrix view (``Scenario.low_rank_view``)."""
    method = get_method(choice.method, **choice.options)
    cost = profile.method(choice.method)
    if shapes and ((cost.per_tensor_s and method.per_tensor) or cost.per_tensor_decode_s):
        tensors = compressed_tensors(method, shapes, view)
        cost = replace(cost, compress=LinearCost(cost.compress.fixed_s + tensors * cost.per_tensor_s,
                                                 cost.compress.per_element_s),
                       decompress=LinearCost(cost.decompress.fixed_s + tensors * cost.per_tensor_decode_s,
                                             cost.decompress.per_element_s))
    if choice.scheme == "lowrank" and shapes:
        return _lowrank_stages(method, cost, shapes, n, net, average_s, view)
    return SCHEMES[choice.scheme].stages(method, cost, n, net, shapes, average_s)


def lowrank_parts(method, shapes, view=None) -> tuple[int, int]:
    """Bytes of the two all-reduces gradcomp's PowerSGD hook issues for a bucket of ``shapes``
    (gradcomp.hooks.powersgd): P with the tensors it sends as they are (biases, small matrices:
    fp32), then Q; each compressed n x m matrix (``method.low_rank``) adds 4 n r to the first
    and 4 m r to the second. ``view``: another implementation's matrix view in place of
    ``method.low_rank`` (``Scenario.low_rank_view``)."""
    p_bytes = q_bytes = 0
    for shape in shapes:
        plan = (view or method.low_rank)(tuple(shape))
        if plan is None:
            p_bytes += BYTES_PER_ELEMENT * math.prod(shape)
        else:
            n, m, r = plan
            p_bytes, q_bytes = p_bytes + BYTES_PER_ELEMENT * n * r, q_bytes + BYTES_PER_ELEMENT * m * r
    return p_bytes, q_bytes


def _lowrank_stages(method, cost, shapes, numel: int, net: Network, average_s: float,
                    view=None) -> tuple[list, int]:
    """PowerSGD's bucket as its hook runs it: compress (M Q, per-tensor fixed costs included, half
    of it) | all-reduce of P and the uncompressed tensors | orthogonalize and M^T P (the other half)
    | all-reduce of Q (none when no tensor is compressed) | decompress. Each all-reduce is its own
    collective with its own latency terms, at its own size."""
    p_bytes, q_bytes = lowrank_parts(method, shapes, view)
    half = ("compute", average_s + cost.compress(numel) / 2)
    stages = [half, ("network", net.allreduce_s(p_bytes))]
    if q_bytes:
        stages += [("compute", cost.compress(numel) / 2), ("network", net.allreduce_s(q_bytes))]
    return stages + [("compute", SCHEMES["lowrank"].decode_s(cost, numel, net.world_size))], p_bytes + q_bytes


def compressed_tensors(method, shapes, view=None) -> int:
    """How many of ``shapes`` a per-tensor method compresses (the others it sends as they are:
    PowerSGD's biases and small matrices); ``view``: another implementation's matrix view."""
    low_rank = view or getattr(method, "low_rank", None)
    if low_rank is not None:
        return sum(1 for s in shapes if low_rank(tuple(s)) is not None)
    return sum(1 for s in shapes
               if method.wire_bytes(math.prod(s), tuple(s)) < BYTES_PER_ELEMENT * math.prod(s))


def _hierarchical_stages(choice: Choice, bucket: Bucket, scenario: Scenario) -> tuple[list, int, int]:
    """gradcomp.hooks.hierarchical: exact reduce-scatter in the node, the scheme between nodes on
    this rank's shard, exact all-gather in the node. Bytes as the hook counts them: the shard's
    payloads (inter-node), 4 (g s + s) (intra-node: reduce-scatter and all-gather inputs)."""
    net, n = scenario.network, bucket.numel
    g, nodes = net.node_size, net.nodes
    method = get_method(choice.method, **choice.options)
    shard = shard_size(n, g, nodes, choice.scheme, method.granule)
    exact = BYTES_PER_ELEMENT * (g * shard + shard) if g > 1 else 0
    node_bytes = BYTES_PER_ELEMENT * g * shard  # the padded bucket, reduce-scattered then all-gathered
    stages = [("compute", scenario.profile.average(n)),
              ("network", net.within_node_s(node_bytes, reduce_scatter=True))]
    wire, deferred_at = 0, None
    if nodes > 1:
        between, wire = _compressed_stages(choice, bucket.shapes, shard, net.between_nodes(),
                                           scenario.profile, 0.0)
        deferred_at = _deferred_at(choice, between, len(stages))
        stages += between
    return stages + [("network", net.within_node_s(node_bytes))], wire, exact, deferred_at


def _sharded_stages(choice: Choice, bucket: Bucket, scenario: Scenario) -> tuple[list, int]:
    """gradcomp.fsdp's reduce-scatter of one unit of n elements (rows of n / p), or FSDP's ring
    reduce-scatter for ``none``; bytes per rank sent."""
    net, p = scenario.network, scenario.network.world_size
    row = -(-bucket.numel // p)
    if choice.method == UNCOMPRESSED:
        return [("network", net.reduce_scatter_s(BYTES_PER_ELEMENT * p * row))], (p - 1) * BYTES_PER_ELEMENT * row
    if not shardable(choice.method):
        raise ValueError(f"{choice.method} cannot reduce-scatter under FSDP (gradcomp.fsdp refuses it)")
    row_wire = get_method(choice.method, **choice.options).wire_bytes(row)
    cost = scenario.profile.method(choice.method)
    return [("compute", cost.compress((p - 1) * row)), ("network", net.alltoall_s(p * row_wire)),
            ("compute", cost.decompress_s(row, p - 1))], (p - 1) * row_wire


def _parameter_gather(scenario: Scenario, bucket: Bucket) -> tuple[float, int]:
    """FSDP's uncompressed all-gather of one unit's parameters: (seconds, bytes per rank sent)."""
    p = scenario.network.world_size
    row_bytes = BYTES_PER_ELEMENT * -(-bucket.numel // p)
    return scenario.network.allgather_s(row_bytes), (p - 1) * row_bytes


@dataclass(frozen=True)
class StepTime:
    """One simulated step (seconds): total, busy compute, network busy, compress+decompress;
    bytes per rank: compressed (``wire_bytes``, see _bucket_stages) and in exact collectives
    besides (``exact_bytes``: hierarchical intra-node, FSDP parameter all-gathers)."""

    step_s: float
    compute_busy_s: float
    comm_s: float
    compress_s: float
    wire_bytes: int
    exact_bytes: int = 0

    @property
    def exposed_comm_s(self) -> float:
        return max(self.step_s - self.compute_busy_s, 0.0)


def _check(scenario: Scenario, choice: Choice) -> None:
    if choice.hierarchical and scenario.sharded:
        raise ValueError("a hierarchical choice is a DDP hook; it cannot be combined with sharded (FSDP)")
    if choice.hierarchical and scenario.network.intra is None:
        raise ValueError(f"{choice.label}: hierarchical compression needs nodes of several ranks "
                         "(gpus_per_node > 1)")


def simulate(scenario: Scenario, choice: Choice | Sequence[Choice],
             buckets: list[Bucket] | None = None) -> StepTime:
    """Simulate one step of ``scenario`` under ``choice`` (see the module docstring): one Choice
    for every bucket, or one per bucket (in the order backward makes them ready)."""
    compute = scenario.compute
    buckets = buckets if buckets is not None else step_buckets(scenario)
    per_bucket = [choice] * len(buckets) if isinstance(choice, Choice) else list(choice)
    if len(per_bucket) != len(buckets):
        raise ValueError(f"simulate: {len(per_bucket)} choices for {len(buckets)} buckets")
    for c in per_bucket:
        _check(scenario, c)
    resource, duration, successors, pending = [], [], [], []

    slowdown = scenario.ranks_per_core

    def task(res, seconds, after):
        resource.append(res)
        duration.append(seconds)
        successors.append([])
        pending.append(len(after))
        for t in after:
            successors[t].append(len(resource) - 1)
        return len(resource) - 1

    hostless = (replace(scenario, network=scenario.network.without_host_cost())
                if scenario.host_contends else None)

    collective_tasks = set()  # network tasks and their host shares: issued by every rank

    def collective(seconds, free_seconds, after):
        """A network task, with its host share on compute when the host contends; the tasks a
        successor waits for."""
        done = [task("network", seconds, after)]
        if hostless is not None and seconds - free_seconds > 0:
            done.append(task("compute", seconds - free_seconds, after))  # the collective's CPU work
        collective_tasks.update(done)
        return done

    wire_total, exact_total, compress_s = 0, 0, 0.0
    start_s = slowdown * compute.forward_s  # DDP: forward has run when the simulation starts
    if scenario.sharded:
        # FSDP: each unit's parameters all-gathered before its forward (registration order, the
        # reverse of the buckets) and again before its backward, one unit ahead of the compute
        start_s = 0.0
        gathers = [_parameter_gather(scenario, b) for b in buckets]
        free_gathers = [_parameter_gather(hostless, b) for b in buckets] if hostless else gathers
        exact_total += 2 * sum(nbytes for _, nbytes in gathers)
        forward, gather = [], []
        for i in reversed(range(len(buckets))):
            gather = collective(gathers[i][0], free_gathers[i][0], gather[:1] + forward[-2:-1])
            forward.append(task("compute", slowdown * compute.forward_s * buckets[i].backward_share,
                                gather + forward[-1:]))
        gather = []
    chains = {}  # a chain depends on the choice and the bucket's shapes: repeated blocks share one

    def chain(choice, bucket, priced):
        key = (id(choice), bucket.shapes, priced is hostless)
        if key not in chains:
            chains[key] = _bucket_stages(choice, bucket, priced)
        return chains[key]

    backward = []
    queued, held = None, []  # a deferred collective (its inputs, its tasks); the hook's hold on backward
    for i, bucket in enumerate(buckets):
        waits = backward[-1:] + held
        if scenario.sharded:
            ahead = backward[i - 2:i - 1] if i >= 2 else forward[-1:]
            gather = collective(gathers[i][0], free_gathers[i][0], gather[:1] + ahead)
            waits += gather
        backward.append(task("compute", slowdown * compute.backward_s * bucket.backward_share, waits))
        stages, wire, exact, deferred_at = chain(per_bucket[i], bucket, scenario)
        wire_total += wire
        exact_total += exact
        free_stages = chain(per_bucket[i], bucket, hostless)[0] if hostless else stages
        previous, flushed, held = backward[-1:], queued is not None, []
        if flushed:  # this hook's flush waits for the queued collective's inputs, then launches it
            inputs, launched = queued
            previous = previous + inputs
            for t in launched:
                successors[backward[-1]].append(t)
                pending[t] += 1
        queued = None
        for j, ((res, seconds), (_, free_seconds)) in enumerate(zip(stages, free_stages)):
            inputs = previous
            if res == "network":
                previous = collective(seconds, free_seconds, previous)
            else:
                previous = [task(res, slowdown * seconds, previous)]
                compress_s += slowdown * seconds
            if j == deferred_at:  # left in the queue: launched by the next bucket's hook
                queued = (inputs, previous)
            if j == 0 and flushed:  # backward resumes when the hook returns
                held = previous
        if scenario.sharded and per_bucket[i].method != UNCOMPRESSED:
            held = previous  # gradcomp.fsdp's reduce-scatter returns when its sum is decoded

    optimizer_s = slowdown * compute.optimizer_s / (scenario.network.world_size if scenario.sharded else 1)
    free = {"compute": start_s, "network": start_s}
    ready_heaps = {"compute": [], "network": []}
    ready_at = [0.0] * len(resource)
    after_collective = [False] * len(resource)  # the last of its inputs to finish was a collective
    for t, count in enumerate(pending):
        if count == 0:
            heapq.heappush(ready_heaps[resource[t]], (start_s, t))
    end = start_s
    since_met = optimizer_s + start_s  # compute since the ranks last waited together: the last step's end
    compute_heap, network_heap = ready_heaps["compute"], ready_heaps["network"]
    while compute_heap or network_heap:
        # the task that can start first (ties: the lower task number), on either resource
        if compute_heap:
            start, t = max(free["compute"], compute_heap[0][0]), compute_heap[0][1]
            res = "compute"
        if network_heap:
            network_start, network_t = max(free["network"], network_heap[0][0]), network_heap[0][1]
            if not compute_heap or (network_start, network_t) < (start, t):
                start, t, res = network_start, network_t, "network"
        heapq.heappop(compute_heap if res == "compute" else network_heap)
        finish = start + duration[t]
        wait = 0.0
        if res == "compute" and t not in collective_tasks:
            if after_collective[t] and start > free["compute"]:
                since_met = 0.0  # the ranks waited for the same collective: they go on together
            since_met += duration[t]
            wait = scenario.sync_wait(since_met)
        free[res] = finish
        end = max(end, finish)
        for s in successors[t]:
            arrival = finish + wait if s in collective_tasks else finish  # when the slowest rank issues it
            if arrival >= ready_at[s]:
                ready_at[s], after_collective[s] = arrival, t in collective_tasks
            pending[s] -= 1
            if pending[s] == 0:
                heapq.heappush(ready_heaps[resource[s]], (ready_at[s], s))
    comm_s = sum(d for d, r in zip(duration, resource) if r == "network")
    busy = slowdown * (compute.forward_s + compute.backward_s) + compress_s + optimizer_s
    return StepTime(end + optimizer_s, busy, comm_s, compress_s, wire_total, exact_total)


def sweep_bandwidth(scenario: Scenario, choices: list[Choice], gbps_values) -> dict[str, list[float]]:
    """Step seconds per choice label at each bandwidth of ``gbps_values``."""
    result = {}
    for choice in choices:
        result[choice.label] = [simulate(scenario.with_bandwidth(g), choice).step_s for g in gbps_values]
    return result
