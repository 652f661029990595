"""powersgd_hook: PowerSGD (Vogels et al., 2019) as a DDP comm hook, two collectives per bucket.

    from gradcomp.hooks import PowerSGDState, powersgd_hook
    model.register_comm_hook(PowerSGDState(process_group=None, matrix_rank=4), powersgd_hook)

For its first ``start_iter`` steps the hook all-reduces buckets uncompressed (``allreduce_hook``).
Then, per bucket:

1. Each gradient is viewed as a matrix M [n, m] (``PowerSGD.low_rank`` decides; 1-D and small
   tensors stay uncompressed). Same-shape matrices evenly spaced in the bucket form a run: one
   strided [k, n, m] view of the bucket. With error feedback, M = gradient + residual.
2. P = M Q (Q [m, r]: warm-started from the previous step, columns scaled to norm 1) is written
   into one flat fp32 buffer behind the uncompressed values: [uncompressed | P_1 | P_2 | ...].
   Collective 1 all-reduces it (issued in the hook body).
3. At the next bucket's start (or after DDP's last bucket), from the hook's thread: the
   uncompressed values / world size go back into the bucket, every P is orthonormalized (on
   the kernels one launch for the bucket, on torch one batched QR per run), Q = M^T P, and
   collective 2 all-reduces [Q_1 | Q_2 | ...]
   (``HookState.deferred``).
4. When Q arrives: Q /= world size, gradient <- P Q^T, residual <- M - P Q^T.

Every collective is issued from the hook's thread at points all ranks reach in the same order.
torch's powerSGD_hook issues its second and third all-reduce from future callbacks running on
Gloo's threads, where they race the next bucket's collective (a crash with several buckets).

Memory: a bucket's residual covers only its compressed matrices (the uncompressed values are sent
exactly, nothing is owed for them), group after group, and it is also the workspace: step 1 adds
the gradient into it in place and step 4 subtracts the decoded gradient, so no copy of the input
is made (torch keeps a bucket-sized error buffer and clones the bucket every step). Residuals and
warm-start Qs are kept per parameter (``HookState.residuals``): they follow parameters through
DDP's bucket rebuild after the first step and through a checkpoint into a new process
(``HookState.parameter_key`` names parameters, bound or not).
"""
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..analysis.auto import squared_norm
from ..checks import check_number
from ..methods.base import all_finite
from ..methods.powersgd import (PowerSGD, decode_into, initial_q, kernels, on_kernels, orthonormalize_columns_,
                               orthonormalize_runs_, project_, transpose_project_, unit_columns_,
                               unit_columns_runs_, update_residual_)
from ..feedback import ErrorFeedback
from .base import HookState, resumable
from .compressed import allreduce_hook

HOOK_NAME = "powersgd_hook"

# torch's PowerSGDState keyword -> ours, accepted so that torch code ports by renaming the class
TORCH_ALIASES = {"matrix_approximation_rank": "matrix_rank", "start_powerSGD_iter": "start_iter",
                 "random_seed": "seed", "use_error_feedback": "error_feedback"}
_ALIASED_DEFAULTS = {"matrix_rank": 4, "start_iter": 0, "seed": 0, "error_feedback": True}  # as in __init__


@dataclass(frozen=True)
class _Chunk:
    """Compressed gradients of one bucket handled by one batched call: ``count`` matrices [n, m]
    of rank r, evenly spaced in the bucket (``offset``, ``stride``), back to back in the residual
    (``matrices``), in the P part of the fused buffer (``p``, after the uncompressed values) and
    in the Q buffer (``q``)."""

    n: int
    m: int
    r: int
    tensors: tuple  # positions in bucket.gradients()
    offset: int
    stride: int
    matrices: slice
    p: slice
    q: slice

    @property
    def count(self) -> int:
        return len(self.tensors)

    def in_bucket(self, buffer: torch.Tensor) -> torch.Tensor:
        """The chunk's gradients as a [count, n, m] view of the bucket buffer."""
        return buffer.as_strided((self.count, self.n, self.m), (self.stride, self.m, 1),
                                 buffer.storage_offset() + self.offset)


def _evenly_spaced_runs(members: list, offsets: list, batch: bool) -> list:
    """``members`` (in order) cut into consecutive runs whose offsets are evenly spaced (so each
    run is one strided view of the bucket); runs of one without ``batch``."""
    runs = []
    for i in members:
        run = runs[-1] if runs else None
        if (batch and run and (len(run) == 1 or
                               offsets[i] - offsets[run[-1]] == offsets[run[1]] - offsets[run[0]])):
            run.append(i)
        else:
            runs.append([i])
    return runs


class _BucketPlan:
    """How a bucket's gradients are split: uncompressed positions and same-shape chunks.

    Matrices are grouped by shape in order of first appearance, then by position (torch's order:
    the Q buffer here has the layout of torch's ``q_memory_dict`` entry of the bucket); a group
    is cut where its members stop being evenly spaced in the bucket.
    """

    def __init__(self, bucket, layout: tuple, method: PowerSGD, batch_same_shape: bool):
        buffer, grads = bucket.buffer(), bucket.gradients()
        self.key = (buffer.numel(), layout)
        offsets = [g.storage_offset() - buffer.storage_offset() for g in grads]
        groups: dict = {}
        uncompressed = []
        for i, g in enumerate(grads):
            nmr = method.low_rank(g.shape)
            if nmr is None:
                uncompressed.append(i)
            else:
                groups.setdefault(nmr, []).append(i)
        positions = [torch.arange(grads[i].numel(), device=buffer.device) + offsets[i] for i in uncompressed]
        self.uncompressed_index = (torch.cat(positions) if positions
                                   else torch.empty(0, dtype=torch.long, device=buffer.device))
        self.uncompressed_numel = self.uncompressed_index.numel()
        self.chunks: list = []
        at_m, at_p, at_q = 0, self.uncompressed_numel, 0
        for (n, m, r), members in groups.items():
            for run in _evenly_spaced_runs(members, offsets, batch_same_shape):
                k = len(run)
                stride = offsets[run[1]] - offsets[run[0]] if k > 1 else n * m
                self.chunks.append(_Chunk(n, m, r, tuple(run), offsets[run[0]], stride,
                                          slice(at_m, at_m + k * n * m), slice(at_p, at_p + k * n * r),
                                          slice(at_q, at_q + k * m * r)))
                at_m, at_p, at_q = at_m + k * n * m, at_p + k * n * r, at_q + k * m * r
        self.matrices_numel, self.fused_numel, self.q_numel = at_m, at_p, at_q
        self.runs = [(c.count, c.n, c.r) for c in self.chunks]  # the P parts, back to back
        self.orthonormalize_tables: dict = {}  # device -> the kernel's tables of ``runs``
        self.q_runs = [(c.count, c.m, c.r) for c in self.chunks]  # the Q parts, back to back
        self.q_rows: dict = {}  # device -> unit_columns_runs_'s row-to-matrix index
        # every chunk as the matmul kernels' run: all of a bucket's matrices in one launch a pass
        self.kernel_runs = tuple((c.count, c.n, c.m, c.r, c.offset, c.stride, c.matrices.start,
                                  c.p.start, c.q.start) for c in self.chunks)
        order = [(c, i) for c in self.chunks for i in c.tensors]
        # (parameter key, numel) of the residual's and of the Q buffer's pieces, in their order
        self.residual_layout = tuple((layout[i][0], c.n * c.m) for c, i in order)
        self.q_layout = tuple((layout[i][0], c.m * c.r) for c, i in order)


class LowRankMemory:
    """What PowerSGD keeps for the buckets it reduces, beside their residuals (which live in the
    hook state's ``residuals`` under ``bucket<i>``): each bucket's plan (rebuilt when DDP changes
    the bucket) and the warm-start Qs, kept per parameter in ``warm_start_q``. PowerSGDState
    holds one; the auto hook (gradcomp.hooks.auto) one per PowerSGD choice.

    method: the PowerSGD method (rank, seed, epsilon, min_compression_rate); the same seed on
        every rank (the initial Q must agree). error_feedback, warm_start,
        batch_tensors_with_same_shape: as PowerSGDState's.
    """

    def __init__(self, method: PowerSGD, error_feedback: bool = True, warm_start: bool = True,
                 batch_tensors_with_same_shape: bool = True):
        self.method = method
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        self.warm_start_q = ErrorFeedback()  # Q pieces [m, r] per parameter
        self.plans: dict = {}  # bucket index -> _BucketPlan
        self._q_buffers: dict = {}  # name -> the Q buffer last initialized

    def plan(self, bucket, layout: tuple) -> _BucketPlan:
        """The bucket's plan (``layout``: HookState.bucket_layout's), rebuilt when DDP changed
        the bucket's parameters."""
        plan = self.plans.get(bucket.index())
        if plan is None or plan.key != (bucket.buffer().numel(), layout):
            plan = self.plans[bucket.index()] = _BucketPlan(bucket, layout, self.method,
                                                            self.batch_tensors_with_same_shape)
        return plan

    def q(self, bucket, plan: _BucketPlan, device, step: int) -> torch.Tensor:
        """The bucket's Q buffer (kept per parameter). Pieces no parameter brought along (a new
        buffer's zero pieces) and, without warm start, all pieces get ``initial_q`` (seed + ``step``
        without warm start)."""
        name = f"bucket{bucket.index()}"
        q, _ = self.warm_start_q.get(name, plan.q_numel, plan.q_layout, device)
        if self.warm_start and q is self._q_buffers.get(name):
            return q
        self._q_buffers[name] = q
        seed = self.method.seed + (0 if self.warm_start else step)
        for chunk in plan.chunks:
            qs = q[chunk.q].view(chunk.count, chunk.m, chunk.r)
            initial = initial_q(chunk.m, chunk.r, seed, device)
            if self.warm_start:  # on device, no host read of which pieces are fresh (all zero)
                qs.copy_(torch.where(qs.flatten(1).any(dim=1)[:, None, None], qs, initial))
            else:
                qs.copy_(initial.expand_as(qs))
        return q

    def loaded(self, saved: dict) -> "LowRankMemory":
        """A memory with these options and the warm-start Qs of ``saved`` (``warm_start_q``'s
        state_dict), plans rebuilt at the next step."""
        out = LowRankMemory(self.method, self.error_feedback, self.warm_start, self.batch_tensors_with_same_shape)
        out.warm_start_q.load_state_dict(saved)
        return out

    def local_error_sq(self, bucket, layout: tuple, step: int, weight: torch.Tensor | None = None) -> torch.Tensor:
        """||C(g) - g||^2 (float64 0-d tensor on the bucket's device, no host sync) of one power
        step on this rank's bucket alone, no error feedback, from the Q the hook would start
        from (the warm start, else the seeded one); tensors sent uncompressed add 0. ``weight``
        (fp32, the bucket's size): the error multiplied by it coordinate by coordinate first.
        Nothing kept changes but a Q buffer initialized as the hook would."""
        plan, buffer = self.plan(bucket, layout), bucket.buffer()
        q = self.q(bucket, plan, buffer.device, step)
        total = torch.zeros((), dtype=torch.float64, device=buffer.device)
        for chunk in plan.chunks:
            k, n, m, r = chunk.count, chunk.n, chunk.m, chunk.r
            p = torch.empty(k, n, r, device=buffer.device)
            matrices = project_(chunk.in_bucket(buffer), None, unit_columns_(q[chunk.q].view(k, m, r).clone()), p)
            orthonormalize_columns_(p, self.method.epsilon)
            q_new = transpose_project_(matrices, p, torch.empty(k, m, r, device=buffer.device))
            total += squared_norm(torch.bmm(p, q_new.transpose(1, 2)) - matrices,
                                  None if weight is None else chunk.in_bucket(weight))
        return total


class PowerSGDState(HookState):
    """Options and memory of :func:`powersgd_hook`.

    process_group: the group to reduce over (None: the default group).
    matrix_rank: the approximation rank r; a matrix [n, m] is compressed when
        (n + m) r * min_compression_rate < n m, else sent uncompressed (1-D tensors always).
    start_iter: steps all-reduced uncompressed before compression starts (0: none; memory
        follows parameters through DDP's bucket rebuild after step 1, so 0 is safe here, unlike
        torch's hook which requires start_powerSGD_iter > 1).
    min_compression_rate: see ``matrix_rank``.
    error_feedback: keep what compression dropped and add it to the next step's gradient.
    warm_start: start each step's power iteration from the previous step's Q; otherwise from
        the seeded Gaussian Q of ``initial_q`` with seed + step.
    orthogonalization_epsilon: 0 uses a sign-fixed Householder QR (Gram-Schmidt's columns; an
        all-zero gradient decodes to zeros); > 0 uses Gram-Schmidt dividing by (norm + epsilon).
    seed: seed of the initial Q (``initial_q(m, r, seed)``, as ``gradcomp.compress(x,
        "powersgd", seed=seed)``).
    batch_tensors_with_same_shape: orthonormalize and multiply same-shape matrices with one
        batched call each (no memory cost here: they already lie back to back in the residual).

    torch's keywords ``matrix_approximation_rank``, ``start_powerSGD_iter``, ``random_seed`` and
    ``use_error_feedback`` are accepted for matrix_rank, start_iter, seed and error_feedback.
    ``rank`` (the old name of matrix_rank) still works until the next release, with a
    DeprecationWarning: ``state.rank`` is this process's rank in the group (``HookState``).

    ``lowrank``: the plans and warm-start Qs (:class:`LowRankMemory`).
    """

    # the PowerSGD method's option names that are spelled differently here (as keywords of this
    # state they are deprecated until the next release; ``gradcomp.emulate.hook_options`` maps them)
    METHOD_OPTION_NAMES = {"rank": "matrix_rank"}

    def __init__(self, process_group=None, matrix_rank: int = 4, start_iter: int = 0,
                 min_compression_rate: float = 2.0, error_feedback: bool = True,
                 warm_start: bool = True, orthogonalization_epsilon: float = 0.0, seed: int = 0,
                 batch_tensors_with_same_shape: bool = True, **other_keywords):
        given = dict(matrix_rank=matrix_rank, start_iter=start_iter, seed=seed, error_feedback=error_feedback)
        for other_name, value in other_keywords.items():
            ours = TORCH_ALIASES.get(other_name) or self.METHOD_OPTION_NAMES.get(other_name)
            if ours is None:
                raise TypeError(f"PowerSGDState got an unexpected keyword {other_name!r}")
            if other_name in self.METHOD_OPTION_NAMES:
                warnings.warn(f"PowerSGDState({other_name}=...) is deprecated and will be removed in the "
                              f"next release; use {ours}=...", DeprecationWarning, stacklevel=2)
            if given[ours] != _ALIASED_DEFAULTS[ours]:
                raise ValueError(f"PowerSGDState: give {ours!r} or {other_name!r}, not both")
            given[ours] = value
        start_iter = given["start_iter"]
        check_number("PowerSGDState", "start_iter", start_iter, 0, integer=True)
        for name, value in (("error_feedback", given["error_feedback"]), ("warm_start", warm_start),
                            ("batch_tensors_with_same_shape", batch_tensors_with_same_shape)):
            if not isinstance(value, bool):
                raise TypeError(f"PowerSGDState: {name} must be True or False, got {value!r}")
        # validates rank, seed, epsilon and min_compression_rate with the method's messages
        self.method = PowerSGD(rank=given["matrix_rank"], seed=given["seed"], epsilon=orthogonalization_epsilon,
                               min_compression_rate=min_compression_rate)
        super().__init__(process_group, matrix_rank=given["matrix_rank"], start_iter=start_iter,
                         min_compression_rate=float(min_compression_rate),
                         error_feedback=given["error_feedback"], warm_start=warm_start,
                         orthogonalization_epsilon=float(orthogonalization_epsilon),
                         seed=given["seed"], batch_tensors_with_same_shape=batch_tensors_with_same_shape)
        self.start_iter = start_iter
        self.lowrank = LowRankMemory(self.method, given["error_feedback"], warm_start, batch_tensors_with_same_shape)

    @property
    def error_feedback(self) -> bool:
        return self.lowrank.error_feedback

    @property
    def warm_start(self) -> bool:
        return self.lowrank.warm_start

    @property
    def batch_tensors_with_same_shape(self) -> bool:
        return self.lowrank.batch_tensors_with_same_shape

    def _plan(self, bucket) -> _BucketPlan:
        """The bucket's plan (its layout recorded by begin_bucket)."""
        return self.lowrank.plan(bucket, self.layouts[bucket.index()])

    def parameter_residuals(self) -> dict:
        """{parameter key (see ``bucket_layout``): flat fp32 copy of its residual} for the
        compressed parameters of the buckets seen so far."""
        out = {}
        for index, plan in self.lowrank.plans.items():
            if f"bucket{index}" in self.residuals.names():
                residual = self.residuals.residual(f"bucket{index}")
                offset = 0
                for key, size in plan.residual_layout:
                    out[key] = residual[offset:offset + size].clone()
                    offset += size
        return out

    # ---- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The base state (options, step, statistics, residuals) and the warm-start Qs."""
        return {**super().state_dict(), "warm_start_q": self.lowrank.warm_start_q.state_dict()}

    def _loaded(self, state: dict) -> dict:
        """HookState's, and the warm-start Qs; also from a checkpoint saved when matrix_rank was
        named rank."""
        if "warm_start_q" not in state:
            raise ValueError("PowerSGDState.load_state_dict: missing ['warm_start_q']")
        if "options" in state:
            state = {**state, "options": {self.METHOD_OPTION_NAMES.get(key, key): value
                                          for key, value in state["options"].items()}}
        return {**super()._loaded(state), "lowrank": self.lowrank.loaded(state["warm_start_q"])}


def reduce_lowrank(state: HookState, bucket, memory: LowRankMemory) -> torch.futures.Future:
    """Steps 1-4 of the module docstring for one bucket, on the power-step functions of
    gradcomp.methods.powersgd (the method's own; fused kernels on CUDA): ``state``'s statistics,
    residuals (``bucket<i>``: M - P Q^T of this rank's own gradient, not divided by the world
    size), deferred queue and group; ``memory``'s plans, warm-start Qs and options. Call between
    ``state.begin_bucket`` and ``state.end_bucket``."""
    stats = state.stats
    plan = memory.plan(bucket, state.layouts[bucket.index()])
    method, world, group = memory.method, state.world_size, state.group
    buffer = bucket.buffer()
    device = buffer.device
    started = stats.mark(device)
    matrices = None
    if memory.error_feedback:
        matrices, _ = state.residuals.get(f"bucket{bucket.index()}", plan.matrices_numel,
                                          plan.residual_layout, device)
    q = memory.q(bucket, plan, device, state.step)
    fused = torch.empty(plan.fused_numel, device=device)
    fused[: plan.uncompressed_numel] = buffer[plan.uncompressed_index]
    fused[plan.uncompressed_numel:].zero_()  # every P part at once: the kernels add into them
    views = []  # per chunk: (gradients [k, n, m] in the bucket, M [k, n, m], P [k, n, r], new Q [k, m, r])
    q_new = torch.zeros(plan.q_numel, device=device)  # every Q part at once: the kernels add into them
    # on the kernels every pass is one launch for all of the bucket's matrices, whatever their
    # number and shapes; on torch, batched calls per chunk
    bucket_kernels = bool(plan.chunks) and on_kernels(buffer, max(c.r for c in plan.chunks))
    if bucket_kernels:
        unit_columns_runs_(q, plan.q_runs, plan.q_rows)
        kernels.ef_matmul_runs(buffer, matrices, q, fused, plan.kernel_runs, p_zeroed=True)
    for chunk in () if bucket_kernels else plan.chunks:
        grads = chunk.in_bucket(buffer)
        residual = None if matrices is None else matrices[chunk.matrices].view(chunk.count, chunk.n, chunk.m)
        q_old = unit_columns_(q[chunk.q].view(chunk.count, chunk.m, chunk.r))
        p = fused[chunk.p].view(chunk.count, chunk.n, chunk.r)
        mats = project_(grads, residual, q_old, p, p_zeroed=True)
        views.append((grads, mats, p, q_new[chunk.q].view(chunk.count, chunk.m, chunk.r)))
    # The residual M - P Q^T needs a cleaning pass only if M or the decoded P Q^T is non-finite.
    # P = M Q is non-finite whenever M is (NaN * q and inf * 0 are NaN), so flags on the small
    # local P, summed P and summed Q replace a pass over the residual. They stay 0-d tensors (no
    # host sync): only the torch path reads them (the kernel cleans in its one pass anyway).
    finite = [] if bucket_kernels else [all_finite(fused[plan.uncompressed_numel:])]
    # raw work futures: a Python callback on a Gloo thread would contend for the GIL with the
    # hook's thread (measured: milliseconds per collective on a loaded machine)
    p_issued = stats.mark(device)
    p_future = dist.all_reduce(fused, group=group, async_op=True).get_future()
    stats.add(wire_bytes=4 * (plan.fused_numel + plan.q_numel))
    stats.add_interval("compress_s", started, p_issued)

    def unpack_uncompressed(fused_sum):
        if plan.uncompressed_numel:
            buffer.index_copy_(0, plan.uncompressed_index,
                               fused_sum[: plan.uncompressed_numel].div_(world).to(buffer.dtype))
        return buffer

    if not plan.chunks:
        return p_future.then(lambda fut: unpack_uncompressed(fut.value()[0]))
    times = {}

    def launch_q(p_value):  # in the hook's thread, at the next flush of state.deferred
        times["p_arrived"] = stats.mark(device)
        if not bucket_kernels:
            finite.append(all_finite(p_value[0][plan.uncompressed_numel:]))
        unpack_uncompressed(p_value[0])
        # every P of the bucket (back to back after the uncompressed values) in one launch
        orthonormalize_runs_(fused[plan.uncompressed_numel:], plan.runs, method.epsilon,
                             fix_signs=False, cache=plan.orthonormalize_tables)
        if bucket_kernels:
            kernels.transpose_matmul_runs(buffer, matrices, fused, q_new, plan.kernel_runs, q_zeroed=True)
        for _, mats, p, q_part in views:
            transpose_project_(mats, p, q_part, q_zeroed=True)
        times["q_issued"] = stats.mark(device)
        stats.add_interval("compress_s", times["p_arrived"], times["q_issued"])
        return dist.all_reduce(q_new, group=group, async_op=True).get_future()

    def decompress(fut):
        arrived = stats.mark(device)
        q_sum = fut.value()[0].div_(world)
        q_finite = all_finite(q_sum)  # the same on every rank: q_sum is all-reduced
        if bucket_kernels:  # the decode into the bucket and the residual in one pass
            kernels.residual_update_runs(buffer, matrices, fused, q_new, plan.kernel_runs)
        known_finite = torch.stack([q_finite, *finite]).all() if views else None
        for grads, mats, p, q_part in views:
            decoded = decode_into(p, q_part, grads)  # straight into the bucket
            if matrices is not None:
                update_residual_(mats, p, q_part, decoded, known_finite)
        q.copy_(torch.where(q_finite, q_sum, q))  # a non-finite Q must not poison the warm start
        stats.add_interval("comm_s", p_issued, times["p_arrived"])
        stats.add_interval("comm_s", times["q_issued"], arrived)
        stats.add_interval("decompress_s", arrived)
        return buffer

    return state.deferred.then(p_future, launch_q).then(decompress)


@resumable
def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradients averaged over the group, PowerSGD-compressed after
    ``state.start_iter`` uncompressed steps. Register with
    ``model.register_comm_hook(PowerSGDState(...), powersgd_hook)``."""
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"{HOOK_NAME}: state must be a PowerSGDState, got {type(state).__name__}")
    if state.step < state.start_iter:
        return allreduce_hook(state, bucket)
    state.begin_bucket(bucket, HOOK_NAME)
    future = reduce_lowrank(state, bucket, state.lowrank)
    state.end_bucket(bucket)
    return future
