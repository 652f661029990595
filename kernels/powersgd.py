"""PowerSGD kernels: the three passes over M of one power-iteration step, fused with error feedback,
and a batched Gram-Schmidt that orthonormalizes many small P matrices in one launch.

Every matmul kernel takes a batch: k same-shape matrices [k, n, m] (a strided view of a DDP
bucket, or one tensor as k = 1) in one launch, the batch folded into grid axis 0.
Pass 1 (``ef_matmul_kernel``): c = x + r is computed tile by tile, written into the residual
buffer (which from then on holds M) and multiplied by Q in the same pass: P = M Q.
Pass 2: Q = M^T P with torch (cuBLAS): there is nothing to fuse into it (M is only read), and
cuBLAS's split-K GEMM already streams M at full bandwidth.
Pass 3 (``residual_update_kernel``): residual = M - P Q^T, 0 where not finite, in place.
Bytes per element: itemsize(x) + 4 + 4 (pass 1) + 4 (pass 2) + 4 + 4 (pass 3) = 24 for fp32, plus
re-reads of the small P and Q per tile (L2-resident on a GPU).

FMAs per element of M and pass: ``ef_matmul`` multiplies by Q with ``tl.dot`` padded to
R_PAD = next_power_of_2(rank) columns (fp32 ``tl.dot`` needs only K >= 8, and K here is
BLOCK_M); ``residual_update`` runs exactly ``rank`` FMAs (a loop over the rank's columns: its
``tl.dot`` would have K = rank, padded to 8 at least).

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
from .declared import (MATMUL_TILES, MIN_SPLIT_COLUMNS, TARGET_PROGRAMS,  # noqa: F401  (re-exported)
                       ef_matmul_bytes, matmul_splits, orthonormalize_bytes, power_step_bytes,
                       residual_update_bytes, transpose_matmul_bytes)

MAX_RANK = 16
"""Ranks 1..16 run on the kernels. Higher ranks run on the torch path: the [BLOCK_N, R_PAD]
accumulators of ``ef_matmul`` would spill registers."""
R_PADS = (1, 2, 4, 8, 16)
"""Every R_PAD the kernels are compiled for: next_power_of_2(rank) for ranks 1..MAX_RANK."""
MATMUL_CONFIGS = [triton.Config({"BLOCK_N": block_n, "BLOCK_M": block_m}, num_warps=warps)
                  for block_n, block_m, warps in MATMUL_TILES]
MATMUL_CPU_CONFIG = triton.Config({"BLOCK_N": 256, "BLOCK_M": 256})
TRANSPOSE_CONFIGS = MATMUL_CONFIGS[:1]
"""``transpose_matmul``'s: the 128x64 / 8-warp tile spills 4 bytes at rank 4 on sm_90."""
ORTHO_CONFIGS = [triton.Config({"BLOCK": 8192}, num_warps=8)]
ORTHO_CPU_CONFIG = triton.Config({"BLOCK": 8192})


@tuned(MATMUL_CONFIGS, MATMUL_CPU_CONFIG, key=["n_class", "m_class", "rank"], restore=("res_ptr",),
       reset=("p_ptr",))
@triton.jit
def ef_matmul_kernel(x_ptr, res_ptr, q_ptr, p_ptr, n, m, x_batch_stride, n_class, m_class, rank,
                     cols_per_split, HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr,
                     R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """P[b, rows] += (x + res)[b, rows, split] @ Q[b, split] (fp32 atomics across splits);
    res[b] <- x[b] + res[b], for matrix b of the batch.

    Grid: (batch * row blocks, column splits), program (b * row blocks + row block, split);
    P must start at zero. x: matrix b at x + b * x_batch_stride, row-major [n, m]; res, Q and P
    contiguous [k, n, m], [k, m, rank], [k, n, rank]. ``n_class``, ``m_class``
    (common.size_class of n, m) only key autotuning.
    """
    row_blocks = tl.cdiv(n, BLOCK_N)
    program = tl.program_id(0).to(tl.int64)
    b = program // row_blocks
    rows = (program % row_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_ptr += b * x_batch_stride
    res_ptr += b * n * m
    q_ptr += b * m * rank
    p_ptr += b * n * rank
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


@tuned(TRANSPOSE_CONFIGS, MATMUL_CPU_CONFIG, key=["n_class", "m_class", "rank"], reset=("q_ptr",))
@triton.jit
def transpose_matmul_kernel(x_ptr, p_ptr, q_ptr, n, m, x_batch_stride, n_class, m_class, rank,
                            rows_per_split, X_BF16: tl.constexpr, R_PAD: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Q[b, cols] += M[b, split, cols]^T @ P[b, split] (fp32 atomics across row splits), for
    matrix b of the batch: pass 2, ``ef_matmul`` transposed.

    Grid: (batch * column blocks, row splits), program (b * column blocks + column block, split);
    Q must start at zero. M: matrix b at x + b * x_batch_stride, row-major [n, m] (any gradient
    dtype: M itself, or x when there is no residual); P and Q contiguous [k, n, rank], [k, m,
    rank]. ``n_class``, ``m_class`` only key autotuning.
    """
    col_blocks = tl.cdiv(m, BLOCK_M)
    program = tl.program_id(0).to(tl.int64)
    b = program // col_blocks
    cols = (program % col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    x_ptr += b * x_batch_stride
    p_ptr += b * n * rank
    q_ptr += b * m * rank
    ranks = tl.arange(0, R_PAD)
    start = tl.program_id(1).to(tl.int64) * rows_per_split
    stop = tl.minimum(start + rows_per_split, n)
    acc = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    for row0 in range(start, stop, BLOCK_N):
        rows = row0 + tl.arange(0, BLOCK_N)
        c = load_f32(x_ptr, rows[:, None] * m + cols[None, :],
                     (rows[:, None] < stop) & (cols[None, :] < m), X_BF16)
        p = tl.load(p_ptr + rows[:, None] * rank + ranks[None, :],
                    mask=(rows[:, None] < stop) & (ranks[None, :] < rank), other=0.0)
        acc = tl.dot(tl.trans(c), p, acc, input_precision="ieee")
    tl.atomic_add(q_ptr + cols[:, None] * rank + ranks[None, :], acc,
                  mask=(cols[:, None] < m) & (ranks[None, :] < rank), sem="relaxed")


@tuned(MATMUL_CONFIGS, MATMUL_CPU_CONFIG, key=["n_class", "m_class", "rank"], restore=("res_ptr",))
@triton.jit
def residual_update_kernel(res_ptr, p_ptr, q_ptr, n, m, n_class, m_class, rank,
                           BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """res[b] <- res[b] - P[b] Q[b]^T (res holds M), 0 where not finite; one [BLOCK_N, BLOCK_M]
    tile each: program i is tile i % tiles of matrix b = i // tiles, tile t = (row block
    t // column blocks, column block t % column blocks), all on grid axis 0 (axes 1 and 2 hold at
    most 65535). res, P, Q contiguous [k, n, m], [k, n, rank], [k, m, rank]. P Q^T is ``rank``
    fused multiply-adds per element (one column of P and of Q each), no padding.
    ``n_class``, ``m_class`` only key autotuning."""
    col_blocks = tl.cdiv(m, BLOCK_M)
    tiles = tl.cdiv(n, BLOCK_N).to(tl.int64) * col_blocks
    program = tl.program_id(0).to(tl.int64)
    b = program // tiles
    tile = program % tiles
    res_ptr += b * n * m
    p_ptr += b * n * rank
    q_ptr += b * m * rank
    rows = (tile // col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (tile % col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    approx = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for j in range(rank):
        p = tl.load(p_ptr + rows * rank + j, mask=rows < n, other=0.0)
        q = tl.load(q_ptr + cols * rank + j, mask=cols < m, other=0.0)
        approx = tl.fma(p[:, None], q[None, :], approx)
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
                          R_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Gram-Schmidt as gradcomp.methods.powersgd.orthonormalize_ on the columns of matrix
    b = program_id (row-major [rows, cols] at p + offsets[b]). For column i: remove its components
    along the columns before it once more (re-orthogonalization), divide it by (norm + epsilon)
    (a zero column stays zero), and remove its component from the later columns. The matrix is
    streamed in tiles of BLOCK elements (BLOCK / R_PAD rows: 4096 rows of rank 4), four sweeps
    per column (two for the first): each sweep is one dependent global round trip per tile, so a
    P of up to BLOCK / R_PAD rows costs 4 r - 1 round trips, not (4 r - 1) x its row tiles.
    ``count_class`` (common.size_class(count)) only keys autotuning."""
    BLOCK_N: tl.constexpr = BLOCK // R_PAD
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


def r_pad(rank: int) -> int:
    """The columns ``ef_matmul`` and the Gram-Schmidt compute for ``rank``: its next power of two
    (one of R_PADS). ValueError for ranks the kernels do not handle."""
    if not supports(rank):
        raise ValueError(f"the PowerSGD kernels handle ranks 1..{MAX_RANK}, got {rank}")
    return triton.next_power_of_2(rank)


def ef_matmul_grid(batch: int, n: int, splits: int):
    """Grid of :func:`ef_matmul`: (batch x row blocks, column splits); splits <= TARGET_PROGRAMS
    (:func:`matmul_splits`)."""
    return lambda meta: (batch * triton.cdiv(n, meta["BLOCK_N"]), splits)


def transpose_matmul_grid(batch: int, m: int, splits: int):
    """Grid of :func:`transpose_matmul`: (batch x column blocks, row splits); splits <=
    TARGET_PROGRAMS (:func:`matmul_splits` of the transposed matrix)."""
    return lambda meta: (batch * triton.cdiv(m, meta["BLOCK_M"]), splits)


def residual_update_grid(batch: int, n: int, m: int):
    """Grid of :func:`residual_update`: every [BLOCK_N, BLOCK_M] tile of every matrix on axis 0."""
    return lambda meta: (batch * triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(m, meta["BLOCK_M"]),)


def orthonormalize_grid(count: int):
    """Grid of :func:`orthonormalize_batched_`: one program per matrix."""
    return lambda meta: (count,)


def _batched(name: str, t: torch.Tensor, dtypes, device=None, shape=None,
             matrices: bool = False) -> torch.Tensor:
    """``t`` [k, ...] (a 2-D ``t`` as a batch of one), checked: one of ``dtypes``, on ``device``,
    of ``shape`` (None entries: any), contiguous; with ``matrices`` each matrix t[b] need only be
    contiguous itself (any batch stride, e.g. evenly spaced matrices in a DDP bucket)."""
    if isinstance(t, torch.Tensor) and t.dim() == 2:
        t = t[None]
    one_by_one = matrices and isinstance(t, torch.Tensor) and t.dim() == 3 and len(t) > 0
    check_flat(name, t[0] if one_by_one else t, dtypes, device)
    if t.dim() != 3 or (shape is not None and any(want is not None and got != want
                                                  for got, want in zip(t.shape, shape))):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape or (None,) * 3) + "]"
        raise ValueError(f"{name} must be a [k, n, m] batch (or one [n, m] matrix) of shape {want}, "
                         f"got {list(t.shape)}")
    return t


def ef_matmul(x: torch.Tensor, residual: torch.Tensor | None, q: torch.Tensor,
              out: torch.Tensor | None = None, out_zeroed: bool = False) -> torch.Tensor:
    """x [k, n, m] (+ residual fp32 [k, n, m]: becomes M = x + residual) @ q fp32 [k, m, r] ->
    P fp32 [k, n, r], into ``out`` when given (contiguous; it is zero-filled, then added into;
    ``out_zeroed``: the caller has zero-filled it, e.g. all of a bucket's P parts at once), in
    one launch for the batch. 2-D arguments ([n, m], [m, r]) are a batch of one and give P [n, r].

    x: any dtype of GRADIENT_DTYPES, each matrix x[b] contiguous, at any batch stride (evenly
    spaced in a bucket). Without a residual, M is x itself (read, not written).
    """
    flat = isinstance(x, torch.Tensor) and x.dim() == 2
    x = _batched("x", x, GRADIENT_DTYPES, matrices=True)
    k, n, m = x.shape
    q = _batched("q", q, (torch.float32,), x.device, (k, m, None))
    rank = q.shape[2]
    padded = r_pad(rank)
    if residual is not None:
        residual = _batched("residual", residual, (torch.float32,), x.device, (k, n, m))
    if out is None:
        p = torch.zeros(k, n, rank, dtype=torch.float32, device=x.device)
    else:
        p = _batched("out", out, (torch.float32,), x.device, (k, n, rank))
        if not out_zeroed:
            p.zero_()
    if x.numel():
        x_arg, x_bf16 = kernel_view(x)
        # the split of the columns is fixed before launch (the kernel needs cols_per_split); row
        # blocks follow each config's BLOCK_N
        block_n = (MATMUL_CPU_CONFIG if interpreting() else MATMUL_CONFIGS[0]).kwargs["BLOCK_N"]
        splits = matmul_splits(n, m, block_n)
        ef_matmul_kernel[ef_matmul_grid(k, n, splits)](
            x_arg, residual if residual is not None else x_arg, q, p, n, m,
            x.stride(0) if k > 1 else n * m, size_class(n), size_class(m), rank,
            triton.cdiv(m, splits), HAS_RESIDUAL=residual is not None, X_BF16=x_bf16,
            R_PAD=padded, **EXACT)
    if out is not None:
        return out
    return p[0] if flat else p


def transpose_matmul(matrices: torch.Tensor, p: torch.Tensor, out: torch.Tensor | None = None,
                     out_zeroed: bool = False) -> torch.Tensor:
    """matrices [k, n, m]^T @ p fp32 [k, n, r] -> Q fp32 [k, m, r] (pass 2: Q = M^T P), into
    ``out`` when given (contiguous; zero-filled, then added into; ``out_zeroed``: the caller has
    zero-filled it, e.g. all of a bucket's Q parts at once), in one launch for the batch. 2-D
    arguments ([n, m], [n, r]) are a batch of one and give Q [m, r].

    matrices: any dtype of GRADIENT_DTYPES, each matrix contiguous, at any batch stride (M in the
    residual, or a gradient in its bucket).
    """
    flat = isinstance(matrices, torch.Tensor) and matrices.dim() == 2
    x = _batched("matrices", matrices, GRADIENT_DTYPES, matrices=True)
    k, n, m = x.shape
    p = _batched("p", p, (torch.float32,), x.device, (k, n, None))
    rank = p.shape[2]
    padded = r_pad(rank)
    if out is None:
        q = torch.zeros(k, m, rank, dtype=torch.float32, device=x.device)
    else:
        q = _batched("out", out, (torch.float32,), x.device, (k, m, rank))
        if not out_zeroed:
            q.zero_()
    if x.numel():
        x_arg, x_bf16 = kernel_view(x)
        block_m = (MATMUL_CPU_CONFIG if interpreting() else TRANSPOSE_CONFIGS[0]).kwargs["BLOCK_M"]
        splits = matmul_splits(m, n, block_m)  # the rows are split as ef_matmul splits columns
        transpose_matmul_kernel[transpose_matmul_grid(k, m, splits)](
            x_arg, p, q, n, m, x.stride(0) if k > 1 else n * m, size_class(n), size_class(m), rank,
            triton.cdiv(n, splits), X_BF16=x_bf16, R_PAD=padded, **EXACT)
    if out is not None:
        return out
    return q[0] if flat else q


def residual_update(matrix: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """matrix fp32 [k, n, m] (the residuals holding M) <- M - p @ q^T (p [k, n, r], q [k, m, r]),
    0 where not finite, in place, in one launch for the batch (2-D arguments: a batch of one)."""
    matrix = _batched("matrix", matrix, (torch.float32,))
    k, n, m = matrix.shape
    p = _batched("p", p, (torch.float32,), matrix.device, (k, n, None))
    rank = p.shape[2]
    q = _batched("q", q, (torch.float32,), matrix.device, (k, m, rank))
    r_pad(rank)
    if matrix.numel() == 0:
        return
    residual_update_kernel[residual_update_grid(k, n, m)](matrix, p, q, n, m, size_class(n),
                                                          size_class(m), rank, **EXACT)


def orthonormalize_tables(shapes: list[tuple[int, int]], device) -> tuple[torch.Tensor, ...]:
    """(offsets int64, rows int32, cols int32) of the matrices of ``shapes`` laid out back to back:
    what :func:`orthonormalize_batched_` reads on ``device`` (a caller with fixed shapes, e.g. a
    hook's bucket plan, keeps them: no host-to-device copy per call)."""
    starts = list(accumulate((a * b for a, b in shapes), initial=0))[:-1]
    return (to_device(starts, torch.int64, device), to_device([a for a, _ in shapes], torch.int32, device),
            to_device([b for _, b in shapes], torch.int32, device))


def orthonormalize_batched_(flat: torch.Tensor, shapes: list[tuple[int, int]],
                            epsilon: float = 0.0, tables: tuple | None = None) -> torch.Tensor:
    """Gram-Schmidt, in place, on every matrix of ``shapes`` laid out one after another
    (row-major) in ``flat`` fp32: one launch, one program per matrix. ``tables``: the
    :func:`orthonormalize_tables` of ``shapes`` on flat's device (made here when None).
    Returns ``flat``."""
    check_flat("flat", flat, (torch.float32,))
    if sum(a * b for a, b in shapes) != flat.numel():
        raise ValueError(f"shapes hold {sum(a * b for a, b in shapes)} elements, flat has {flat.numel()}")
    if not shapes:
        return flat
    padded = r_pad(max(b for _, b in shapes))
    offsets, rows, cols = tables if tables is not None else orthonormalize_tables(shapes, flat.device)
    if not len(offsets) == len(rows) == len(cols) == len(shapes):
        raise ValueError(f"tables hold {[len(offsets), len(rows), len(cols)]} entries for "
                         f"{len(shapes)} matrices")
    orthonormalize_kernel[orthonormalize_grid(len(shapes))](
        flat, offsets, rows, cols, len(shapes), size_class(len(shapes)), float(epsilon),
        R_PAD=padded, **EXACT)
    return flat


def compile_cases() -> list[CompileCase]:
    """Shipped configs, fp32 gradients: ``ef_matmul`` and the Gram-Schmidt at every R_PAD (ranks
    1..16), ``residual_update`` once (it loops over the rank)."""
    cases = []
    for config in MATMUL_CONFIGS:
        bn, bm, warps = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_M"], config.num_warps
        tiles = f"BLOCK_N={bn},BLOCK_M={bm},warps={warps}"
        for padded in R_PADS:
            cases.append(CompileCase(
                f"ef_matmul[R_PAD={padded},{tiles}]", jit_function(ef_matmul_kernel),
                {"x_ptr": "*fp32", "res_ptr": "*fp32", "q_ptr": "*fp32", "p_ptr": "*fp32",
                 "n": "i32", "m": "i32", "x_batch_stride": "i32", "n_class": "i32",
                 "m_class": "i32", "rank": "i32", "cols_per_split": "i32",
                 "HAS_RESIDUAL": "constexpr", "X_BF16": "constexpr", "R_PAD": "constexpr",
                 "BLOCK_N": "constexpr", "BLOCK_M": "constexpr"},
                {"HAS_RESIDUAL": True, "X_BF16": False, "R_PAD": padded, "BLOCK_N": bn,
                 "BLOCK_M": bm},
                warps, aligned=("x_ptr", "res_ptr", "q_ptr", "p_ptr", "m", "x_batch_stride",
                                "cols_per_split"),
                wide=(ASYNC_WIDE_LOADS, WIDE_STORES)))
        for padded in R_PADS if config in TRANSPOSE_CONFIGS else ():
            cases.append(CompileCase(
                f"transpose_matmul[R_PAD={padded},{tiles}]", jit_function(transpose_matmul_kernel),
                {"x_ptr": "*fp32", "p_ptr": "*fp32", "q_ptr": "*fp32", "n": "i32", "m": "i32",
                 "x_batch_stride": "i32", "n_class": "i32", "m_class": "i32", "rank": "i32",
                 "rows_per_split": "i32", "X_BF16": "constexpr", "R_PAD": "constexpr",
                 "BLOCK_N": "constexpr", "BLOCK_M": "constexpr"},
                {"X_BF16": False, "R_PAD": padded, "BLOCK_N": bn, "BLOCK_M": bm},
                warps, aligned=("x_ptr", "p_ptr", "q_ptr", "m", "x_batch_stride"), wide=(ASYNC_WIDE_LOADS,)))
        cases.append(CompileCase(
            f"residual_update[{tiles}]", jit_function(residual_update_kernel),
            {"res_ptr": "*fp32", "p_ptr": "*fp32", "q_ptr": "*fp32", "n": "i32", "m": "i32",
             "n_class": "i32", "m_class": "i32", "rank": "i32", "BLOCK_N": "constexpr",
             "BLOCK_M": "constexpr"},
            {"BLOCK_N": bn, "BLOCK_M": bm},
            warps, aligned=("res_ptr", "p_ptr", "q_ptr", "m"), wide=(WIDE_LOADS, WIDE_STORES)))
    for config in ORTHO_CONFIGS:
        for padded in R_PADS:
            cases.append(CompileCase(
                f"orthonormalize[R_PAD={padded},BLOCK={config.kwargs['BLOCK']},"
                f"warps={config.num_warps}]",
                jit_function(orthonormalize_kernel),
                {"p_ptr": "*fp32", "offsets_ptr": "*i64", "rows_ptr": "*i32", "cols_ptr": "*i32",
                 "count": "i32", "count_class": "i32", "epsilon": "fp32", "R_PAD": "constexpr",
                 "BLOCK": "constexpr"},
                {"R_PAD": padded, "BLOCK": config.kwargs["BLOCK"]}, config.num_warps))
    return cases
