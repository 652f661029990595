"""PowerSGD kernels: the three passes over M of one power-iteration step, fused with error feedback,
and a batched Gram-Schmidt that orthonormalizes many small P matrices in one launch.

Pass 1 (``ef_matmul_kernel``): c = x + r is computed tile by tile, written into the residual
buffer (which from then on holds M) and multiplied by Q in the same pass: P = M Q.
Pass 2: Q = M^T P with torch (cuBLAS): there is nothing to fuse into it (M is only read), and
cuBLAS's split-K GEMM already streams M at full bandwidth.
Pass 3 (``residual_update_kernel``): residual = M - P Q^T, 0 where not finite, in place.
Bytes per element: itemsize(x) + 4 + 4 (pass 1) + 4 (pass 2) + 4 + 4 (pass 3) = 24 for fp32, plus
re-reads of the small P and Q per tile (L2-resident on a GPU).

Tolerance against gradcomp.methods.powersgd: the matmuls and norms sum in other orders (tl.dot
with ``input_precision="ieee"``: exact fp32 products, never TF32), so P, Q and the residual agree
to fp32 rounding (relative ~1e-5 of their norms), not bit for bit.
"""
from __future__ import annotations

from itertools import accumulate

import torch
import triton
import triton.language as tl

from .common import (ASYNC_WIDE_LOADS, EXACT, GRADIENT_DTYPES, WIDE_LOADS, WIDE_STORES, CompileCase,
                     check_flat, interpreting, is_finite, jit_function, kernel_view, load_f32,
                     size_class, to_device, tuned)

R_PAD = 16
"""tl.dot needs every dimension >= 16: ranks 1..16 are padded (masked) to 16. Higher ranks run on
the torch path: their [BLOCK_N, rank] accumulators would spill registers."""
MAX_RANK = R_PAD
MATMUL_CONFIGS = [triton.Config({"BLOCK_N": 64, "BLOCK_M": 64}, num_warps=4),
                  triton.Config({"BLOCK_N": 128, "BLOCK_M": 64}, num_warps=8)]
MATMUL_CPU_CONFIG = triton.Config({"BLOCK_N": 256, "BLOCK_M": 256})
ORTHO_CONFIGS = [triton.Config({"BLOCK_N": 256}, num_warps=4)]
ORTHO_CPU_CONFIG = triton.Config({"BLOCK_N": 4096})


@tuned(MATMUL_CONFIGS, MATMUL_CPU_CONFIG, key=["n_class", "m_class", "rank"], restore=("res_ptr",),
       reset=("p_ptr",))
@triton.jit
def ef_matmul_kernel(x_ptr, res_ptr, q_ptr, p_ptr, n, m, n_class, m_class, rank, cols_per_split,
                     HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr, R_PAD: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """P[rows] += (x + res)[rows, split] @ Q[split] (fp32 atomics across splits); res <- x + res.

    Grid: (row blocks, column splits); P must start at zero. ``n_class``, ``m_class``
    (common.size_class of n, m) only key autotuning.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, R_PAD)
    start = tl.program_id(1).to(tl.int64) * cols_per_split
    stop = tl.minimum(start + cols_per_split, m)
    acc = tl.zeros([BLOCK_N, R_PAD], dtype=tl.float32)
    for col0 in range(start, stop, BLOCK_M):
        cols = col0 + tl.arange(0, BLOCK_M)
        offs = rows[:, None] * m + cols[None, :]
        mask = (rows[:, None] < n) & (cols[None, :] < stop)
        c = load_f32(x_ptr, offs, mask, X_BF16)
        if HAS_RESIDUAL:
            c += tl.load(res_ptr + offs, mask=mask, other=0.0)
            tl.store(res_ptr + offs, c, mask=mask)
        q = tl.load(q_ptr + cols[:, None] * rank + ranks[None, :],
                    mask=(cols[:, None] < stop) & (ranks[None, :] < rank), other=0.0)
        acc = tl.dot(c, q, acc, input_precision="ieee")
    tl.atomic_add(p_ptr + rows[:, None] * rank + ranks[None, :], acc,
                  mask=(rows[:, None] < n) & (ranks[None, :] < rank), sem="relaxed")


@tuned(MATMUL_CONFIGS, MATMUL_CPU_CONFIG, key=["n_class", "m_class", "rank"], restore=("res_ptr",))
@triton.jit
def residual_update_kernel(res_ptr, p_ptr, q_ptr, n, m, n_class, m_class, rank, R_PAD: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """res <- res - P Q^T (res holds M), 0 where not finite; one [BLOCK_N, BLOCK_M] tile each,
    tile i = (row block i // column blocks, column block i % column blocks), all on grid axis 0
    (axis 1 holds at most 65535). ``n_class``, ``m_class`` only key autotuning."""
    tile = tl.program_id(0).to(tl.int64)
    col_blocks = tl.cdiv(m, BLOCK_M)
    rows = (tile // col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (tile % col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, R_PAD)
    p = tl.load(p_ptr + rows[:, None] * rank + ranks[None, :],
                mask=(rows[:, None] < n) & (ranks[None, :] < rank), other=0.0)
    qt = tl.load(q_ptr + cols[None, :] * rank + ranks[:, None],
                 mask=(cols[None, :] < m) & (ranks[:, None] < rank), other=0.0)
    approx = tl.dot(p, qt, input_precision="ieee")
    offs = rows[:, None] * m + cols[None, :]
    mask = (rows[:, None] < n) & (cols[None, :] < m)
    diff = tl.load(res_ptr + offs, mask=mask, other=0.0) - approx
    tl.store(res_ptr + offs, tl.where(is_finite(diff), diff, 0.0), mask=mask)


@triton.jit
def _column(tile, cols, i):
    return tl.sum(tl.where(cols[None, :] == i, tile, 0.0), axis=1)


@tuned(ORTHO_CONFIGS, ORTHO_CPU_CONFIG, key=["count_class"], restore=("p_ptr",))
@triton.jit
def orthonormalize_kernel(p_ptr, offsets_ptr, rows_ptr, cols_ptr, count, count_class, epsilon,
                          R_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Gram-Schmidt as gradcomp.methods.powersgd.orthonormalize_ on the columns of matrix
    b = program_id (row-major [rows, cols] at p + offsets[b]). For column i: remove its components
    along the columns before it once more (re-orthogonalization), divide it by (norm + epsilon)
    (a zero column stays zero), and remove its component from the later columns. The matrix is
    streamed in BLOCK_N-row tiles: four sweeps per column (two for the first). ``count_class``
    (common.size_class(count)) only keys autotuning."""
    b = tl.program_id(0)
    base = p_ptr + tl.load(offsets_ptr + b)
    n = tl.load(rows_ptr + b)
    r = tl.load(cols_ptr + b).to(tl.int64)  # row offsets rows * r in 64 bits
    cols = tl.arange(0, R_PAD)
    for i in range(r):
        coef = tl.zeros([R_PAD], dtype=tl.float32)
        if i > 0:  # coefficients along the finished columns j < i
            for row0 in range(0, n, BLOCK_N):
                rows = row0 + tl.arange(0, BLOCK_N)
                mask = (rows[:, None] < n) & (cols[None, :] <= i)
                tile = tl.load(base + rows[:, None] * r + cols[None, :], mask=mask, other=0.0)
                coef += tl.sum(tile * _column(tile, cols, i)[:, None], axis=0)
            coef = tl.where(cols < i, coef, 0.0)
        sumsq = 0.0
        for row0 in range(0, n, BLOCK_N):  # col -= done @ coef, and its squared norm
            rows = row0 + tl.arange(0, BLOCK_N)
            mask = (rows[:, None] < n) & (cols[None, :] <= i)
            tile = tl.load(base + rows[:, None] * r + cols[None, :], mask=mask, other=0.0)
            col = _column(tile, cols, i) - tl.sum(tile * coef[None, :], axis=1)
            if i > 0:
                tl.store(base + rows * r + i, col, mask=rows < n)
            sumsq += tl.sum(col * col, axis=0)
        norm = tl.sqrt_rn(sumsq)
        denom = tl.where(norm > 0, norm + epsilon, 1.0)
        dots = tl.zeros([R_PAD], dtype=tl.float32)
        for row0 in range(0, n, BLOCK_N):  # normalize; dots with the later columns
            rows = row0 + tl.arange(0, BLOCK_N)
            mask = (rows[:, None] < n) & (cols[None, :] >= i) & (cols[None, :] < r)
            tile = tl.load(base + rows[:, None] * r + cols[None, :], mask=mask, other=0.0)
            col = tl.math.div_rn(_column(tile, cols, i), denom)
            tl.store(base + rows * r + i, col, mask=rows < n)
            dots += tl.sum(col[:, None] * tile, axis=0)
        dots = tl.where(cols > i, dots, 0.0)
        for row0 in range(0, n, BLOCK_N):  # later columns lose their component along col
            rows = row0 + tl.arange(0, BLOCK_N)
            later = (rows[:, None] < n) & (cols[None, :] > i) & (cols[None, :] < r)
            tile = tl.load(base + rows[:, None] * r + cols[None, :], mask=later, other=0.0)
            col = tl.load(base + rows * r + i, mask=rows < n, other=0.0)
            tl.store(base + rows[:, None] * r + cols[None, :], tile - col[:, None] * dots[None, :],
                     mask=later)


def supports(rank: int) -> bool:
    """Whether the kernels handle this PowerSGD rank."""
    return 1 <= rank <= MAX_RANK


def _check_rank(rank: int) -> int:
    if not supports(rank):
        raise ValueError(f"the PowerSGD kernels handle ranks 1..{MAX_RANK}, got {rank}")
    return R_PAD


def _splits(n: int, m: int, block_n: int) -> int:
    """Column splits so that short, wide matrices still give a GPU ~1024 programs."""
    row_blocks = triton.cdiv(n, block_n)
    return max(1, min(triton.cdiv(m, 4096), triton.cdiv(1024, row_blocks)))


def ef_matmul_grid(n: int, splits: int):
    """Grid of :func:`ef_matmul`: (row blocks, column splits); splits <= 1024 (:func:`_splits`)."""
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), splits)


def residual_update_grid(n: int, m: int):
    """Grid of :func:`residual_update`: every [BLOCK_N, BLOCK_M] tile on axis 0."""
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(m, meta["BLOCK_M"]),)


def orthonormalize_grid(count: int):
    """Grid of :func:`orthonormalize_batched_`: one program per matrix."""
    return lambda meta: (count,)


def ef_matmul(x: torch.Tensor, residual: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """x [n, m] (+ residual fp32 [n, m]: becomes M = x + residual) @ q fp32 [m, r] -> P fp32 [n, r].

    Without a residual, M is x itself (read, not written).
    """
    check_flat("x", x, GRADIENT_DTYPES)
    check_flat("q", q, (torch.float32,), x.device)
    if x.dim() != 2 or q.dim() != 2 or q.shape[0] != x.shape[1]:
        raise ValueError(f"expected x [n, m] and q [m, r], got {list(x.shape)} and {list(q.shape)}")
    if residual is not None:
        check_flat("residual", residual, (torch.float32,), x.device)
        if residual.numel() != x.numel():
            raise ValueError(f"residual has {residual.numel()} elements, x has {x.numel()}")
    (n, m), rank = x.shape, q.shape[1]
    r_pad = _check_rank(rank)
    p = torch.zeros(n, rank, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return p
    x_arg, x_bf16 = kernel_view(x)

    # the split of the columns is fixed before launch (the kernel needs cols_per_split); row
    # blocks follow each config's BLOCK_N
    block_n = (MATMUL_CPU_CONFIG if interpreting() else MATMUL_CONFIGS[0]).kwargs["BLOCK_N"]
    splits = _splits(n, m, block_n)
    ef_matmul_kernel[ef_matmul_grid(n, splits)](
        x_arg, residual if residual is not None else x_arg, q, p, n, m, size_class(n),
        size_class(m), rank, triton.cdiv(m, splits),
        HAS_RESIDUAL=residual is not None, X_BF16=x_bf16, R_PAD=r_pad, **EXACT)
    return p


def residual_update(matrix: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """matrix fp32 [n, m] (the residual holding M) <- M - p @ q.T, 0 where not finite, in place."""
    check_flat("matrix", matrix, (torch.float32,))
    check_flat("p", p, (torch.float32,), matrix.device)
    check_flat("q", q, (torch.float32,), matrix.device)
    (n, m), rank = matrix.shape, p.shape[1]
    if p.shape[0] != n or q.shape != (m, rank):
        raise ValueError(f"expected p [{n}, r] and q [{m}, r], got {list(p.shape)} and {list(q.shape)}")
    if matrix.numel() == 0:
        return
    residual_update_kernel[residual_update_grid(n, m)](matrix, p, q, n, m, size_class(n),
                                                       size_class(m), rank,
                                                       R_PAD=_check_rank(rank), **EXACT)


def orthonormalize_batched_(flat: torch.Tensor, shapes: list[tuple[int, int]],
                            epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt, in place, on every matrix of ``shapes`` laid out one after another
    (row-major) in ``flat`` fp32: one launch, one program per matrix. Returns ``flat``."""
    check_flat("flat", flat, (torch.float32,))
    if sum(a * b for a, b in shapes) != flat.numel():
        raise ValueError(f"shapes hold {sum(a * b for a, b in shapes)} elements, flat has {flat.numel()}")
    if not shapes:
        return flat
    r_pad = _check_rank(max(b for _, b in shapes))
    starts = list(accumulate((a * b for a, b in shapes), initial=0))[:-1]
    offsets = to_device(starts, torch.int64, flat.device)
    rows = to_device([a for a, _ in shapes], torch.int32, flat.device)
    cols = to_device([b for _, b in shapes], torch.int32, flat.device)
    orthonormalize_kernel[orthonormalize_grid(len(shapes))](
        flat, offsets, rows, cols, len(shapes), size_class(len(shapes)), float(epsilon),
        R_PAD=r_pad, **EXACT)
    return flat


def ef_matmul_bytes(n: int, m: int, rank: int, x_itemsize: int, has_residual: bool,
                    block_n: int, splits: int) -> int:
    """Declared global-memory bytes of :func:`ef_matmul`: read x (and read + write the residual),
    re-read Q's rows of the split once per row block, one fp32 atomic add to P per split."""
    return (n * m * (x_itemsize + (8 if has_residual else 0))
            + triton.cdiv(n, block_n) * m * rank * 4 + 8 * n * rank * splits)


def orthonormalize_bytes(shapes: list[tuple[int, int]]) -> int:
    """Declared global-memory bytes of :func:`orthonormalize_batched_`: per matrix [n, r], for
    column i, read columns <= i twice (coefficients, then re-orthogonalize; write column i back
    when i > 0), read columns >= i and write column i (normalize), read column i and the later
    columns and write the later ones (update): 4 n (3 r (r + 1) / 2 + r^2 + 2 r - 2) in all, plus
    16 bytes of offset, rows and cols per matrix."""
    return sum(4 * n * (3 * r * (r + 1) // 2 + r * r + 2 * r - 2) + 16 for n, r in shapes)


def residual_update_bytes(n: int, m: int, rank: int, block_n: int, block_m: int) -> int:
    """Declared global-memory bytes of :func:`residual_update`: read and write M, and re-read P
    once per column block and Q once per row block."""
    return (8 * n * m + triton.cdiv(m, block_m) * n * rank * 4
            + triton.cdiv(n, block_n) * m * rank * 4)


def power_step_bytes(n: int, m: int, rank: int, x_itemsize: int, has_residual: bool,
                     block_n: int, block_m: int) -> int:
    """Declared global-memory bytes of one PowerSGD power step on the kernels, as
    gradcomp.methods.powersgd runs it on CUDA, for tiles (block_n, block_m): the three kernels,
    zero-filling P, and Q = M^T P with torch (read M and P, write Q). Excludes the fp32 copy of
    x that the no-residual path makes for a non-fp32 x, and the O(m r) work on the warm-start Q."""
    splits = _splits(n, m, block_n)
    total = ef_matmul_bytes(n, m, rank, x_itemsize, has_residual, block_n, splits)
    total += orthonormalize_bytes([(n, rank)]) + 4 * n * rank
    total += 4 * n * m + 4 * (n + m) * rank
    if has_residual:
        total += residual_update_bytes(n, m, rank, block_n, block_m)
    return total


def compile_cases() -> list[CompileCase]:
    """Shipped configs (one variant serves every rank up to R_PAD), fp32 gradients."""
    cases = []
    for rank in (MAX_RANK,):
        r_pad = _check_rank(rank)
        for config in MATMUL_CONFIGS:
            bn, bm, warps = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_M"], config.num_warps
            tag = f"rank={rank},BLOCK_N={bn},BLOCK_M={bm},warps={warps}"
            cases.append(CompileCase(
                f"ef_matmul[{tag}]", jit_function(ef_matmul_kernel),
                {"x_ptr": "*fp32", "res_ptr": "*fp32", "q_ptr": "*fp32", "p_ptr": "*fp32", "n": "i32",
                 "m": "i32", "n_class": "i32", "m_class": "i32", "rank": "i32", "cols_per_split": "i32", "HAS_RESIDUAL": "constexpr",
                 "X_BF16": "constexpr", "R_PAD": "constexpr", "BLOCK_N": "constexpr",
                 "BLOCK_M": "constexpr"},
                {"HAS_RESIDUAL": True, "X_BF16": False, "R_PAD": r_pad, "BLOCK_N": bn, "BLOCK_M": bm},
                warps, aligned=("x_ptr", "res_ptr", "q_ptr", "p_ptr", "m", "cols_per_split"),
                wide=(ASYNC_WIDE_LOADS, WIDE_STORES)))
            cases.append(CompileCase(
                f"residual_update[{tag}]", jit_function(residual_update_kernel),
                {"res_ptr": "*fp32", "p_ptr": "*fp32", "q_ptr": "*fp32", "n": "i32", "m": "i32",
                 "n_class": "i32", "m_class": "i32", "rank": "i32", "R_PAD": "constexpr", "BLOCK_N": "constexpr", "BLOCK_M": "constexpr"},
                {"R_PAD": r_pad, "BLOCK_N": bn, "BLOCK_M": bm},
                warps, aligned=("res_ptr", "p_ptr", "q_ptr", "m"), wide=(WIDE_LOADS, WIDE_STORES)))
        for config in ORTHO_CONFIGS:
            cases.append(CompileCase(
                f"orthonormalize[rank={rank},BLOCK_N={config.kwargs['BLOCK_N']},warps={config.num_warps}]",
                jit_function(orthonormalize_kernel),
                {"p_ptr": "*fp32", "offsets_ptr": "*i64", "rows_ptr": "*i32", "cols_ptr": "*i32",
                 "count": "i32", "count_class": "i32", "epsilon": "fp32", "R_PAD": "constexpr", "BLOCK_N": "constexpr"},
                {"R_PAD": r_pad, "BLOCK_N": config.kwargs["BLOCK_N"]}, config.num_warps))
    return cases
