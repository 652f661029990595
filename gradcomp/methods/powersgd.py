"""powersgd: rank-r approximation M ~ P Q^T by one step of power iteration (Vogels et al., 2019).

The tensor is viewed as a matrix M [n, m] (n = shape[0], m = the other dims' product: a conv
weight [out, in, kh, kw] is [out, in * kh * kw]). With Q [m, r] warm-started from the previous
step (seeded N(0, 1) on the first): P = M Q, P <- orthonormalize(P), Q = M^T P; it decodes to
P Q^T. When M's rank <= r this is exact (P spans M's column space).

Fallback: a tensor with fewer than 2 dims, or one where (n + m) r * min_compression_rate >= n m
(biases, small matrices), is sent uncompressed as ``values`` in its own dtype.
Wire bytes: 4 (n + m) r, or n m * itemsize for the fallback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import check_number
from ..kernels import declared
from .base import Method, all_finite, corrected_fp32, kernel_family, use_triton

kernels = kernel_family("powersgd")
"""The family's Triton launchers (gradcomp.kernels.powersgd), imported at their first use; read only
where :func:`~.base.use_triton` is True (never without triton)."""
GPU_TILE = declared.MATMUL_TILES[0][:2]
"""The matmul kernels' first GPU tile (BLOCK_N, BLOCK_M): the analyser's declared bytes use it."""


def matrix_shape(shape) -> tuple[int, int] | None:
    """(n, m) of the matrix view of a tensor of ``shape``, or None below 2 dims."""
    shape = tuple(shape)
    if len(shape) < 2:
        return None
    n = shape[0]
    return n, (torch.Size(shape).numel() // n if n else 0)


def orthonormalize_(p: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of p [..., n, r] (a batch of matrices), in place.

    Column i is made orthogonal to the columns before it twice ("twice is enough": the second
    pass removes what rounding left, so a column that was nearly dependent, as when the matrix's
    rank is below r, still comes out orthogonal), then divided by (its norm + epsilon). A column
    of norm 0 stays 0 (never 0/0 = NaN: an all-zero gradient decodes to zeros).
    """
    for i in range(p.shape[-1]):
        col = p[..., i : i + 1]
        if i:
            done = p[..., :i]
            col -= done @ (done.transpose(-2, -1) @ col)
        norm = torch.linalg.vector_norm(col, dim=-2, keepdim=True)
        col /= torch.where(norm > 0, norm + epsilon, 1.0)
        if i + 1 < p.shape[-1]:
            rest = p[..., i + 1 :]
            rest -= col * (col * rest).sum(dim=-2, keepdim=True)
    return p


def orthonormalize_batch_(p: torch.Tensor, epsilon: float = 0.0, fix_signs: bool = True) -> torch.Tensor:
    """What ``orthonormalize_`` computes, for a batch p [..., n, r] of float32/64 matrices, in place.

    With epsilon == 0 it runs one batched Householder QR and makes R's diagonal positive, which
    gives Gram-Schmidt's columns (equal up to rounding) 2-7x faster on CPU at r >= 2, and an
    orthonormal column where Gram-Schmidt would divide 0 by 0 (an all-zero gradient then decodes
    to zeros, not NaN). ``fix_signs=False`` skips the sign fix (some columns come out negated),
    which saves three operations and changes nothing for a projection P P^T (PowerSGD's decode).
    With epsilon > 0 it is ``orthonormalize_`` itself.
    """
    if epsilon:
        return orthonormalize_(p, epsilon)
    r = torch.empty(*p.shape[:-2], p.shape[-1], p.shape[-1], dtype=p.dtype, device=p.device)
    torch.linalg.qr(p, out=(p, r))
    if fix_signs:
        p.mul_(torch.copysign(torch.ones((), dtype=p.dtype, device=p.device),
                              torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2))
    return p


def unit_columns_(q: torch.Tensor) -> torch.Tensor:
    """Q [k, m, r] with each column scaled to norm 1 (all-zero columns stay zero), in place.

    P = orthonormalize(M Q) depends only on Q's column space, so a full orthogonalization of Q
    is not needed; a warm-start Q = M^T P has near-orthogonal columns of norms ~ the singular
    values, and equalizing them keeps M Q well conditioned, for two cheap operations.
    """
    norms = torch.linalg.vector_norm(q, dim=1, keepdim=True).clamp_min_(torch.finfo(q.dtype).tiny)
    return q.div_(norms)


def unit_columns_runs_(q: torch.Tensor, runs: list[tuple[int, int, int]], cache: dict) -> torch.Tensor:
    """What :func:`unit_columns_` does to each Q of ``q`` fp32 (1-D: runs [(k, m, r), ...] of k
    matrices [m, r] back to back, a bucket's Q buffer), in place, in a fixed number of operations
    whatever the runs when every r is the same (segment sums of squares by ``index_add_``;
    ``cache`` keeps the row-to-matrix index, keyed by device); else one :func:`unit_columns_` per
    run. Norms sum in another order than ``unit_columns_``: equal to fp32 rounding."""
    ranks = {r for _, _, r in runs}
    if len(ranks) > 1:
        at = 0
        for k, m, r in runs:
            unit_columns_(q[at:at + k * m * r].view(k, m, r))
            at += k * m * r
        return q
    r = ranks.pop()
    rows = q.view(-1, r)
    matrix_of = cache.get(q.device)
    if matrix_of is None:
        sizes = torch.tensor([m for k, m, _ in runs for _ in range(k)])
        matrix_of = cache[q.device] = torch.repeat_interleave(torch.arange(len(sizes)), sizes).to(q.device)
    squares = torch.zeros(sum(k for k, _, _ in runs), r, device=q.device).index_add_(
        0, matrix_of, rows * rows)
    norms = squares.sqrt_().clamp_min_(torch.finfo(q.dtype).tiny)
    rows.div_(norms.index_select(0, matrix_of))
    return q


# The power step in four batched parts, shared by the method and powersgd_hook: a batch is k
# matrices [k, n, m] of rank r (a strided view of a DDP bucket, or one tensor as k = 1). On CUDA
# (or GRADCOMP_BACKEND=triton) the error-feedback matmul, the orthonormalization, M^T P and the
# residual update run gradcomp.kernels.powersgd; the decode P Q^T is a cuBLAS matmul.

def on_kernels(t: torch.Tensor, rank: int) -> bool:
    """Whether a power step of this rank on ``t``'s device runs the kernels."""
    return use_triton(t) and kernels.supports(rank)


def project_(x: torch.Tensor, residual: torch.Tensor | None, q: torch.Tensor,
             p: torch.Tensor, p_zeroed: bool = False) -> torch.Tensor:
    """P = M Q into ``p`` fp32 [k, n, r], where M = x [k, n, m] (any float dtype) + residual.

    residual: fp32 [k, n, m] (error feedback): it becomes M, in place; None: M is x.
    q: fp32 [k, m, r]. p_zeroed: p holds zeros already (the kernel adds into it; the caller
    zero-filled all of a bucket's P parts at once). Returns M (fp32 [k, n, m]: the residual, or
    x in fp32).
    """
    if on_kernels(p, q.shape[-1]):  # one launch for the batch
        kernels.ef_matmul(x, residual, q, out=p, out_zeroed=p_zeroed)
        return residual if residual is not None else x.float()
    matrices = x.float() if residual is None else residual.add_(x)
    torch.bmm(matrices, q, out=p)
    return matrices


def transpose_project_(matrices: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                       q_zeroed: bool = False) -> torch.Tensor:
    """Q = M^T P into ``q`` fp32 [k, m, r], where M = ``matrices`` [k, n, m] (what
    :func:`project_` returned) and P fp32 [k, n, r]; q_zeroed: q holds zeros already (the kernel
    adds into it; the caller zero-filled all of a bucket's Q parts at once). Returns q."""
    if on_kernels(q, p.shape[-1]):  # one launch for the batch
        return kernels.transpose_matmul(matrices, p, out=q, out_zeroed=q_zeroed)
    return torch.bmm(matrices.transpose(1, 2), p, out=q)


def orthonormalize_columns_(p: torch.Tensor, epsilon: float = 0.0, fix_signs: bool = True) -> torch.Tensor:
    """The columns of each matrix of p fp32 [k, n, r] (contiguous) made orthonormal, in place:
    the kernel's Gram-Schmidt, or :func:`orthonormalize_batch_` on the torch path (``fix_signs``:
    see there; the kernel's columns have Gram-Schmidt's signs)."""
    k, n, r = p.shape
    if on_kernels(p, r):
        kernels.orthonormalize_batched_(p.view(-1), [(n, r)] * k, epsilon)
        return p
    return orthonormalize_batch_(p, epsilon, fix_signs)


def orthonormalize_runs_(flat: torch.Tensor, runs: list[tuple[int, int, int]], epsilon: float = 0.0,
                         fix_signs: bool = True, cache: dict | None = None) -> torch.Tensor:
    """The columns of every P in ``flat`` fp32 made orthonormal, in place: ``runs`` [(k, n, r),
    ...] are batches of k matrices [n, r] laid out back to back (a DDP bucket's P parts). On the
    kernels one launch for all of them (its offset tables kept in ``cache``, keyed by device, when
    given), on torch one :func:`orthonormalize_batch_` per run. Returns ``flat``."""
    if not runs:
        return flat
    if on_kernels(flat, max(r for _, _, r in runs)):
        shapes = [(n, r) for k, n, r in runs for _ in range(k)]
        tables = None
        if cache is not None:
            tables = cache.get(flat.device)
            if tables is None:
                tables = cache[flat.device] = kernels.orthonormalize_tables(shapes, flat.device)
        kernels.orthonormalize_batched_(flat, shapes, epsilon, tables)
        return flat
    at = 0
    for k, n, r in runs:
        orthonormalize_batch_(flat[at:at + k * n * r].view(k, n, r), epsilon, fix_signs)
        at += k * n * r
    return flat


def decode_into(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [k, n, m] (any float dtype; a strided view is fine) <- P Q^T; returns the fp32 product
    (``out`` itself when it is fp32)."""
    if out.dtype == torch.float32:
        return torch.bmm(p, q.transpose(1, 2), out=out)
    decoded = torch.bmm(p, q.transpose(1, 2))
    out.copy_(decoded)
    return decoded


def update_residual_(residual: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                     decoded: torch.Tensor | None = None, finite: torch.Tensor | None = None) -> None:
    """residual fp32 [k, n, m] holding M <- M - P Q^T, 0 where that is not finite, in place.

    decoded: P Q^T in fp32 when the caller has it (the torch path then subtracts it instead of
    multiplying again); finite: a 0-d bool tensor, true when M and P Q^T are known finite (the
    torch path then skips its cleaning pass; the kernel cleans in the same pass anyway, and never
    reads it: no host sync on CUDA).
    """
    if on_kernels(residual, p.shape[-1]):  # one launch for the batch
        kernels.residual_update(residual, p, q)
        return
    residual.sub_(decoded if decoded is not None else torch.bmm(p, q.transpose(1, 2)))
    if finite is None or not bool(finite):
        residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def initial_q(m: int, rank: int, seed: int, device) -> torch.Tensor:
    """The seeded N(0, 1) Q [m, rank] a tensor starts from before any warm start."""
    gen = torch.Generator(device="cpu").manual_seed(seed)  # host-side: the same Q on every device
    return torch.randn(m, rank, generator=gen, device="cpu").to(device)


@dataclass(frozen=True)
class PowerSGD(Method):
    """Low-rank compression; Q is kept in ``state["q"]`` between calls (warm start)."""

    name = "powersgd"
    rank: int = 4
    seed: int = 0
    epsilon: float = 0.0
    min_compression_rate: float = 2.0
    schemes = ("lowrank",)
    per_tensor = True

    def __post_init__(self):
        check_number("powersgd", "rank", self.rank, 1, integer=True)
        check_number("powersgd", "seed", self.seed, 0, integer=True)
        if not isinstance(self.epsilon, (int, float)) or not self.epsilon >= 0:
            raise ValueError(f"powersgd: epsilon must be >= 0, got {self.epsilon!r}")
        if not isinstance(self.min_compression_rate, (int, float)) or not self.min_compression_rate >= 1:
            raise ValueError(
                f"powersgd: min_compression_rate must be >= 1, got {self.min_compression_rate!r}")

    def low_rank(self, shape) -> tuple[int, int, int] | None:
        """(n, m, r) when a tensor of ``shape`` is low-rank compressed, else None (fallback)."""
        nm = matrix_shape(shape)
        if nm is None:
            return None
        n, m = nm
        r = min(self.rank, n, m)
        if r == 0 or (n + m) * r * self.min_compression_rate >= n * m:
            return None
        return n, m, r

    def parts_layout(self, shape, dtype):
        plan = self.low_rank(shape)
        if plan is None:
            return {"values": (dtype, (math.prod(shape),))}
        n, m, r = plan
        return {"p": (torch.float32, (n, r)), "q": (torch.float32, (m, r))}

    def declared_bytes(self, shape, world=1, error_feedback=True):
        plan = self.low_rank(shape)
        if plan is None:
            return super().declared_bytes(shape, world, error_feedback)
        n, m, r = plan
        # decode: read P and Q of every payload, write P Q^T once (a matmul)
        return (declared.power_step_bytes(n, m, r, 4, error_feedback, *GPU_TILE),
                world * 4 * (n + m) * r + 4 * n * m)

    def _warm_q(self, state: dict, m: int, r: int, device) -> torch.Tensor:
        """Q [m, r] to start from: the previous step's (warm start), else the seeded one."""
        q = state.get("q")
        if q is None or q.shape != (m, r) or q.device != device:
            q = initial_q(m, r, self.seed, device)
        return q

    def _keep_q(self, state: dict, q: torch.Tensor, previous: torch.Tensor) -> None:
        """Keep q for the next warm start, or ``previous`` where q is not finite (it must not
        poison the warm start); a device-side choice, no host sync."""
        state["q"] = torch.where(all_finite(q), q, previous)

    def _compress(self, x, residual, state):
        plan = self.low_rank(x.shape)
        if plan is None:
            c = corrected_fp32(x, residual)
            values = c.to(x.dtype, copy=True)  # never an alias of x
            return self._feed_back(c, self._payload(x, {"values": values}), residual)
        n, m, r = plan
        warm_q = self._warm_q(state, m, r, x.device)
        q = unit_columns_(warm_q.clone()[None])
        p = torch.empty(1, n, r, device=x.device)
        matrices = project_(x.reshape(1, n, m), None if residual is None else residual.view(1, n, m), q, p)
        orthonormalize_columns_(p, self.epsilon)
        new_q = transpose_project_(matrices, p, torch.empty(1, m, r, device=x.device))
        self._keep_q(state, new_q[0], warm_q)
        if residual is not None:
            update_residual_(matrices, p, new_q)
        return self._payload(x, {"p": p[0], "q": new_q[0]})

    def _decompress_into(self, payload, out):
        parts = payload.parts
        if "values" in parts:
            out.copy_(parts["values"].reshape(-1))
        else:
            p, q = parts["p"], parts["q"]
            decode_into(p[None], q[None], out.view(1, p.shape[0], q.shape[0]))
