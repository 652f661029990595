"""powersgd_hook: PowerSGD (Vogels et al., 2019) as a DDP comm hook, two collectives per bucket.

    from gradcomp.hooks import PowerSGDState, powersgd_hook
    model.register_comm_hook(PowerSGDState(process_group=None, rank=4), powersgd_hook)

For its first ``start_iter`` steps the hook all-reduces the bucket uncompressed. Then, per bucket:

1. Each gradient is viewed as a matrix M [n, m] (``PowerSGD.low_rank`` decides; 1-D and small
   tensors stay uncompressed). With error feedback, M = gradient + the residual kept for it.
2. P = M Q (Q [m, r] warm-started from the previous step, orthonormalized) is written into one
   flat fp32 buffer behind the uncompressed values: [uncompressed | P_1 | P_2 | ...].
   Collective 1 all-reduces it; the hook body waits for it.
3. The uncompressed values / world size go back into the bucket; every P is orthonormalized (one
   batched call per group of same-shape matrices) and Q = M^T P. Collective 2 all-reduces
   [Q_1 | Q_2 | ...]; the hook returns its future.
4. When Q arrives: Q /= world size, gradient <- P Q^T, residual <- M - P Q^T.

Both collectives are issued from the hook body, that is in DDP's bucket order on every rank.
torch's powerSGD_hook issues its second and third all-reduce from future callbacks running on
Gloo's threads, where they race the next bucket's collective (a crash with several buckets).

Memory: the residual of a bucket covers only its compressed matrices (uncompressed values are
sent exactly, so nothing is owed for them), laid out group by group, and it is also the workspace:
step 1 adds the gradient into it in place and step 4 subtracts the decoded gradient, so there is
no copy of the input (torch keeps a bucket-sized error buffer and clones the bucket every step).
"""

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..methods.powersgd import PowerSGD, initial_q, orthonormalize_batch_
from .base import HookState

HOOK_NAME = "powersgd_hook"

# torch's PowerSGDState keyword -> ours, accepted so that torch code ports by renaming the class
TORCH_ALIASES = {"matrix_approximation_rank": "rank", "start_powerSGD_iter": "start_iter",
                 "random_seed": "seed"}
_ALIASED_DEFAULTS = {"rank": 4, "start_iter": 1, "seed": 0}  # the defaults of __init__ below


@dataclass(frozen=True)
class _Chunk:
    """Compressed gradients of one bucket handled by one batched call: ``count`` matrices [n, m]
    of rank r, stored back to back in the residual (``matrices``), in the P part of the fused
    buffer (``p``, after the uncompressed values) and in the Q buffer (``q``)."""

    n: int
    m: int
    r: int
    tensors: tuple[int, ...]  # positions in bucket.gradients()
    matrices: slice
    p: slice
    q: slice


class _BucketPlan:
    """How one bucket's gradients are split: uncompressed positions and same-shape chunks.

    Matrices are grouped by shape in order of first appearance, then by position (torch's order,
    so a Q buffer here has the layout of torch's ``q_memory_dict`` entry for the bucket).
    """

    def __init__(self, bucket, method: PowerSGD, batch_same_shape: bool):
        buffer, grads = bucket.buffer(), bucket.gradients()
        self.signature = bucket_signature(bucket)
        groups: dict[tuple, list[int]] = {}
        uncompressed = []
        for i, g in enumerate(grads):
            plan = method.low_rank(g.shape)
            if plan is None:
                uncompressed.append(i)
            else:
                groups.setdefault(plan, []).append(i)
        positions = [torch.arange(g.numel()) + (g.storage_offset() - buffer.storage_offset())
                     for g in (grads[i] for i in uncompressed)]
        self.uncompressed_index = (torch.cat(positions) if positions
                                   else torch.empty(0, dtype=torch.long)).to(buffer.device)
        self.uncompressed_numel = self.uncompressed_index.numel()
        batches = [(nmr, members) for nmr, members in groups.items()]
        if not batch_same_shape:
            batches = [(nmr, [i]) for nmr, members in batches for i in members]
        self.chunks: list[_Chunk] = []
        at_m, at_p, at_q = 0, self.uncompressed_numel, 0
        for (n, m, r), members in batches:
            k = len(members)
            self.chunks.append(_Chunk(n, m, r, tuple(members), slice(at_m, at_m + k * n * m),
                                      slice(at_p, at_p + k * n * r), slice(at_q, at_q + k * m * r)))
            at_m, at_p, at_q = at_m + k * n * m, at_p + k * n * r, at_q + k * m * r
        self.matrices_numel, self.fused_numel, self.q_numel = at_m, at_p, at_q


def bucket_signature(bucket) -> tuple:
    """What identifies a bucket's layout: its size, dtype and its gradients' shapes and offsets."""
    buffer = bucket.buffer()
    return (buffer.numel(), str(buffer.dtype),
            tuple((tuple(g.shape), g.storage_offset() - buffer.storage_offset())
                  for g in bucket.gradients()))


class _BucketMemory:
    """What a bucket carries from step to step: its plan, residual and warm-start Q."""

    def __init__(self, plan: _BucketPlan, residual: torch.Tensor | None, q: torch.Tensor | None):
        self.plan, self.residual, self.q = plan, residual, q


class PowerSGDState(HookState):
    """Options and memory of :func:`powersgd_hook`.

    process_group: the group to reduce over (None: the default group).
    rank: the approximation rank r; a matrix [n, m] is compressed when
        (n + m) r * min_compression_rate < n m, else sent uncompressed (1-D tensors always).
    start_iter: uncompressed steps before compression starts; >= 1, because DDP rebuilds its
        buckets after the first step (a residual or Q kept from step 0 would belong to a bucket
        that no longer exists).
    min_compression_rate: see ``rank``.
    use_error_feedback: keep what compression dropped and add it to the next step's gradient.
    warm_start: start each step's power iteration from the previous step's Q; otherwise from a
        fresh seeded Gaussian Q (seed + step).
    orthogonalization_epsilon: 0 uses a sign-fixed Householder QR (Gram-Schmidt's result, an
        all-zero gradient decodes to zeros); > 0 uses Gram-Schmidt dividing by (norm + epsilon).
    seed: seed of the initial Q (``gradcomp.methods.powersgd.initial_q``: the same Q as
        ``gradcomp.compress(x, "powersgd", seed=seed)``).
    batch_tensors_with_same_shape: orthonormalize and multiply same-shape matrices in one
        batched call each (free here: they already lie back to back in the residual).

    torch's keyword names ``matrix_approximation_rank``, ``start_powerSGD_iter`` and
    ``random_seed`` are accepted as aliases of rank, start_iter and seed.
    """

    def __init__(self, process_group=None, rank: int = 4, start_iter: int = 1,
                 min_compression_rate: float = 2.0, use_error_feedback: bool = True,
                 warm_start: bool = True, orthogonalization_epsilon: float = 0.0, seed: int = 0,
                 batch_tensors_with_same_shape: bool = True, **torch_names):
        options = dict(rank=rank, start_iter=start_iter, seed=seed)
        for torch_name, value in torch_names.items():
            ours = TORCH_ALIASES.get(torch_name)
            if ours is None:
                raise TypeError(f"PowerSGDState got an unexpected keyword {torch_name!r}")
            if options[ours] != _ALIASED_DEFAULTS[ours]:
                raise ValueError(f"PowerSGDState: give {ours!r} or its torch alias {torch_name!r}, not both")
            options[ours] = value
        if isinstance(options["start_iter"], bool) or not isinstance(options["start_iter"], int) \
                or options["start_iter"] < 1:
            raise ValueError("PowerSGDState: start_iter must be an integer >= 1 (DDP rebuilds its "
                             f"buckets after the first step), got {options['start_iter']!r}")
        for name, value in (("use_error_feedback", use_error_feedback), ("warm_start", warm_start),
                            ("batch_tensors_with_same_shape", batch_tensors_with_same_shape)):
            if not isinstance(value, bool):
                raise TypeError(f"PowerSGDState: {name} must be a bool, got {value!r}")
        # validates rank, seed, epsilon and min_compression_rate with the method's own messages
        self.method = PowerSGD(rank=options["rank"], seed=options["seed"],
                               epsilon=orthogonalization_epsilon,
                               min_compression_rate=min_compression_rate)
        super().__init__(process_group, rank=options["rank"], start_iter=options["start_iter"],
                         min_compression_rate=float(min_compression_rate),
                         use_error_feedback=use_error_feedback, warm_start=warm_start,
                         orthogonalization_epsilon=float(orthogonalization_epsilon),
                         seed=options["seed"],
                         batch_tensors_with_same_shape=batch_tensors_with_same_shape)
        self.start_iter = options["start_iter"]
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.buckets: dict[int, _BucketMemory] = {}
        self._pending: dict[int, dict] = {}  # loaded by load_state_dict, adopted at first use
        self._stats_lock = threading.Lock()  # Q's callback runs on a communication thread

    def _add_stats(self, **amounts: float) -> None:
        with self._stats_lock:
            self.stats.add(**amounts)

    def _memory(self, bucket) -> _BucketMemory:
        """The bucket's memory; rebuilt from zero (with a pending checkpoint entry if its layout
        matches) when the bucket is new or DDP changed its layout."""
        index = bucket.index()
        memory = self.buckets.get(index)
        if memory is not None and memory.plan.signature == bucket_signature(bucket):
            return memory
        plan = _BucketPlan(bucket, self.method, self.batch_tensors_with_same_shape)
        device = bucket.buffer().device
        saved = self._pending.pop(index, None)
        if saved is not None and tuple(saved["signature"]) != plan.signature:
            saved = None
        residual = q = None
        if self.use_error_feedback:
            residual = (saved["residual"].to(device) if saved is not None and saved["residual"] is not None
                        else torch.zeros(plan.matrices_numel, device=device))
        if saved is not None and saved["q"] is not None:
            q = saved["q"].to(device)
        memory = self.buckets[index] = _BucketMemory(plan, residual, q)
        return memory

    def _initial_q(self, plan: _BucketPlan, device) -> torch.Tensor:
        """The seeded Q buffer of a bucket: ``initial_q`` per matrix (seed + step without warm start)."""
        seed = self.method.seed + (0 if self.warm_start else self.step)
        q = torch.empty(plan.q_numel, device=device)
        for chunk in plan.chunks:
            q[chunk.q].view(len(chunk.tensors), chunk.m, chunk.r).copy_(
                initial_q(chunk.m, chunk.r, seed, device).expand(len(chunk.tensors), -1, -1))
        return q

    # ---- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Base state (options, step, stats) plus, per bucket index: layout signature, residual
        (fp32, the compressed matrices back to back; None without error feedback) and warm-start
        Q (None before the first compressed step)."""
        out = super().state_dict()
        out["buckets"] = dict(self._pending)
        for index, memory in self.buckets.items():
            out["buckets"][index] = {
                "signature": memory.plan.signature,
                "residual": None if memory.residual is None else memory.residual.clone(),
                "q": None if memory.q is None else memory.q.clone()}
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; a bucket's residual and Q are adopted when DDP first hands
        over a bucket with that index and layout (else that bucket restarts from zero)."""
        if "buckets" not in state:
            raise ValueError("PowerSGDState.load_state_dict: missing ['buckets']")
        super().load_state_dict(state)
        self.buckets = {}
        self._pending = {int(i): dict(saved) for i, saved in state["buckets"].items()}


def _allreduce_mean(state: PowerSGDState, bucket) -> torch.futures.Future:
    """Uncompressed all-reduce of the bucket divided by the world size (DDP's default)."""
    buffer = bucket.buffer()
    state._add_stats(wire_bytes=buffer.numel() * buffer.element_size())
    start = time.perf_counter()
    buffer.div_(state.world_size)
    work = dist.all_reduce(buffer, group=state.group, async_op=True)

    def done(fut):
        state._add_stats(comm_s=time.perf_counter() - start)
        return fut.value()[0]

    return work.get_future().then(done)


def _powersgd(state: PowerSGDState, bucket) -> torch.futures.Future:
    """Steps 1-4 of the module docstring for one bucket."""
    started = time.perf_counter()
    memory = state._memory(bucket)
    plan, method, world = memory.plan, state.method, state.world_size
    buffer, grads = bucket.buffer(), bucket.gradients()
    device = buffer.device
    matrices = memory.residual if memory.residual is not None else torch.empty(plan.matrices_numel, device=device)
    q = memory.q if memory.q is not None and state.warm_start else state._initial_q(plan, device)
    fused = torch.empty(plan.fused_numel, device=device)
    fused[: plan.uncompressed_numel].copy_(buffer[plan.uncompressed_index])
    views = []  # per chunk: (M [k, n, m], P [k, n, r], new Q [k, m, r])
    q_new = torch.empty(plan.q_numel, device=device)
    for chunk in plan.chunks:
        k = len(chunk.tensors)
        mats = matrices[chunk.matrices].view(k, chunk.n, chunk.m)
        for j, i in enumerate(chunk.tensors):
            grad = grads[i].view(chunk.n, chunk.m)
            if memory.residual is not None:
                mats[j].add_(grad)
            else:
                mats[j].copy_(grad)
        q_old = orthonormalize_batch_(q[chunk.q].view(k, chunk.m, chunk.r), method.epsilon)
        p = fused[chunk.p].view(k, chunk.n, chunk.r)
        torch.bmm(mats, q_old, out=p)
        views.append((mats, p, q_new[chunk.q].view(k, chunk.m, chunk.r)))
    waited = time.perf_counter()
    dist.all_reduce(fused, group=state.group, async_op=True).wait()
    resumed = time.perf_counter()
    if plan.uncompressed_numel:
        buffer.index_copy_(0, plan.uncompressed_index,
                           fused[: plan.uncompressed_numel].div_(world).to(buffer.dtype))
    for mats, p, q_part in views:
        orthonormalize_batch_(p, method.epsilon)
        torch.bmm(mats.transpose(1, 2), p, out=q_part)
    issued = time.perf_counter()
    state._add_stats(wire_bytes=4 * (plan.fused_numel + plan.q_numel),
                     compress_s=(waited - started) + (issued - resumed), comm_s=resumed - waited)
    if not plan.chunks:
        return _completed(buffer)

    def decompress(fut):
        arrived = time.perf_counter()
        q_sum = fut.value()[0].div_(world)
        for chunk, (mats, p, q_part) in zip(plan.chunks, views):
            for j, i in enumerate(chunk.tensors):
                grad = grads[i].view(chunk.n, chunk.m)
                decoded = torch.mm(p[j], q_part[j].T, out=grad if grad.dtype == torch.float32 else None)
                if decoded is not grad:
                    grad.copy_(decoded)
                if memory.residual is not None:
                    mats[j].sub_(decoded)
        if memory.residual is not None:
            memory.residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if bool(torch.isfinite(q_sum).all()):  # equal on all ranks: q_sum is all-reduced
            memory.q = q_sum
        state._add_stats(comm_s=arrived - issued, decompress_s=time.perf_counter() - arrived)
        return buffer

    return dist.all_reduce(q_new, group=state.group, async_op=True).get_future().then(decompress)


def _completed(value: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradients averaged over the group, PowerSGD-compressed after
    ``state.start_iter`` uncompressed steps. Register with
    ``model.register_comm_hook(PowerSGDState(...), powersgd_hook)``."""
    state.begin_bucket(bucket, HOOK_NAME)
    if state.step < state.start_iter:
        future = _allreduce_mean(state, bucket)
    else:
        future = _powersgd(state, bucket)
    state.end_bucket(bucket)
    return future
