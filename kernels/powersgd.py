"""PowerSGD kernels: the three passes over M of one power-iteration step, fused with error feedback
and the decode, and a batched Gram-Schmidt that orthonormalizes many small P matrices; each one
launch for every matrix of a DDP bucket, whatever their number and shapes.

The matmul kernels run over *runs*: a run is k same-shape matrices [n, m] evenly spaced in x (a
DDP bucket, or one tensor as k = 1), back to back in the residual, P and Q buffers. A run table
(RUN_FIELDS int64 per run: n, m, x offset, x stride, residual, P and Q offsets, rank, splits,
split length, first program) and a program table (the run of each program, int32) let one launch
cover all runs: program i reads its run's fields and works on tile ``i - first`` of that run.
The tables depend only on the runs and the tile, so a caller with fixed runs (a hook's bucket)
gets them from a cache (:func:`run_tables`): no host-to-device copy per call.
Pass 1 (``ef_matmul_kernel``): c = x + r is computed tile by tile, written into the residual
buffer (which from then on holds M) and multiplied by Q in the same pass: P = M Q.
Pass 2 (``transpose_matmul_kernel``): Q = M^T P, row splits summed in fp32 atomics.
Pass 3 (``residual_update_kernel``): residual = M - P Q^T, 0 where not finite, in place; with
``out``, P Q^T is also written there (the decode, e.g. into the bucket).
Bytes per element: itemsize(x) + 4 + 4 (pass 1) + 4 (pass 2) + 4 + 4 (pass 3) = 24 for fp32 (+ the
decode's itemsize), plus re-reads of the small P and Q per tile (L2-resident on a GPU).

FMAs per element of M and pass: ``ef_matmul`` and ``transpose_matmul`` multiply with ``tl.dot``
padded to R_PAD = next_power_of_2(rank) columns (fp32 ``tl.dot`` needs only K >= 8, and K here is
a tile side); ``residual_update`` runs exactly ``rank`` FMAs (a loop over the rank's columns: its
``tl.dot`` would have K = rank, padded to 8 at least).

Tolerance against gradcomp.methods.powersgd: the matmuls and norms sum in other orders (tl.dot
with ``input_precision="ieee"``: exact fp32 products, never TF32), so P, Q and the residual agree
to fp32 rounding (relative ~1e-5 of their norms), not bit for bit.
"""
from __future__ import annotations

import functools
from itertools import accumulate
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (ASYNC_WIDE_LOADS, EXACT, GRADIENT_DTYPES, WIDE_LOADS, WIDE_STORES, CompileCase,
                     check_flat, interpreting, is_finite, jit_function, kernel_view, load_f32,
                     size_class, store_f32, to_device, tuned)
from .declared import MATMUL_TILES, RUN_FIELDS, run_programs

MAX_RANK = 16
"""Ranks 1..16 run on the kernels. Higher ranks run on the torch path: the [BLOCK_N, R_PAD]
accumulators of ``ef_matmul`` would spill registers."""
R_PADS = (1, 2, 4, 8, 16)
"""Every R_PAD the kernels are compiled for: next_power_of_2(rank) for ranks 1..MAX_RANK."""
MATMUL_CONFIGS = [triton.Config({"BLOCK_N": block_n, "BLOCK_M": block_m}, num_warps=warps)
                  for block_n, block_m, warps in MATMUL_TILES]
"""One config: the run tables are made for one tile (a second tile would need its own tables)."""
MATMUL_CPU_CONFIG = triton.Config({"BLOCK_N": 256, "BLOCK_M": 256})
ORTHO_CONFIGS = [triton.Config({"BLOCK": 8192}, num_warps=8)]
ORTHO_CPU_CONFIG = triton.Config({"BLOCK": 8192})
_FIELDS = tl.constexpr(RUN_FIELDS)


@triton.jit
def _run(runs_ptr, run_of_ptr, ALIGN: tl.constexpr):
    """(tile: this program's index within its run, n, m, x offset, x stride, residual offset,
    P offset, Q offset, rank, splits, split length) from the run and program tables (every
    field int64; ALIGN: m and the x and residual offsets are multiples of it, the launcher
    checked; split lengths are multiples of 16, declared.run_programs)."""
    program = tl.program_id(0)
    rec = runs_ptr + tl.load(run_of_ptr + program).to(tl.int64) * _FIELDS
    tile = program - tl.load(rec + 10)
    n = tl.load(rec)
    m = tl.multiple_of(tl.load(rec + 1), ALIGN)
    x_off = tl.multiple_of(tl.load(rec + 2), ALIGN)
    x_stride = tl.multiple_of(tl.load(rec + 3), ALIGN)
    res_off = tl.multiple_of(tl.load(rec + 4), ALIGN)
    return (tile, n, m, x_off, x_stride, res_off, tl.load(rec + 5), tl.load(rec + 6),
            tl.load(rec + 7), tl.load(rec + 8), tl.multiple_of(tl.load(rec + 9), 16))


@tuned(MATMUL_CONFIGS, MATMUL_CPU_CONFIG, key=["programs_class"], restore=("res_ptr",),
       reset=("p_ptr",))
@triton.jit
def ef_matmul_kernel(x_ptr, res_ptr, q_ptr, p_ptr, runs_ptr, run_of_ptr, programs_class,
                     HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr, ALIGN: tl.constexpr,
                     R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """P[b, rows] += (x + res)[b, rows, split] @ Q[b, split] (fp32 atomics across splits);
    res[b] <- x[b] + res[b], for matrix b of each run.

    Tile t of a run (:func:`_run`): split t % splits of row block (t // splits) % row blocks of
    matrix t // (splits * row blocks). P must start at zero. x: matrix b of a run at x + x offset
    + b * x stride, row-major [n, m]; residual, Q and P: [n, m], [m, rank], [n, rank] matrices
    back to back from the run's offsets. ``programs_class`` only keys autotuning.
    """
    tile, n, m, x_off, x_stride, res_off, p_off, q_off, rank, splits, per_split = _run(
        runs_ptr, run_of_ptr, ALIGN)
    row_blocks = tl.cdiv(n, BLOCK_N)
    b = tile // (splits * row_blocks)
    rows = (tile // splits % row_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_ptr += x_off + b * x_stride
    res_ptr += res_off + b * n * m
    q_ptr += q_off + b * m * rank
    p_ptr += p_off + b * n * rank
    ranks = tl.arange(0, R_PAD)
    start = tile % splits * per_split
    stop = tl.minimum(start + per_split, m)
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


@tuned(MATMUL_CONFIGS, MATMUL_CPU_CONFIG, key=["programs_class"], reset=("q_ptr",))
@triton.jit
def transpose_matmul_kernel(x_ptr, p_ptr, q_ptr, runs_ptr, run_of_ptr, programs_class,
                            FROM_X: tl.constexpr, X_BF16: tl.constexpr, ALIGN: tl.constexpr,
                            R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Q[b, cols] += M[b, split, cols]^T @ P[b, split] (fp32 atomics across row splits), for
    matrix b of each run: pass 2, ``ef_matmul`` transposed.

    Tile t of a run: row split t % splits of column block (t // splits) % column blocks of matrix
    t // (splits * column blocks). Q must start at zero. M: with FROM_X the matrices of x (any
    gradient dtype) as ``ef_matmul`` reads them, else fp32 [n, m] matrices back to back from the
    run's residual offset (M in the residual); P and Q as in ``ef_matmul``.
    """
    tile, n, m, x_off, x_stride, res_off, p_off, q_off, rank, splits, per_split = _run(
        runs_ptr, run_of_ptr, ALIGN)
    col_blocks = tl.cdiv(m, BLOCK_M)
    b = tile // (splits * col_blocks)
    cols = (tile // splits % col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    if FROM_X:
        x_ptr += x_off + b * x_stride
    else:
        x_ptr += res_off + b * n * m
    p_ptr += p_off + b * n * rank
    q_ptr += q_off + b * m * rank
    ranks = tl.arange(0, R_PAD)
    start = tile % splits * per_split
    stop = tl.minimum(start + per_split, n)
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


@tuned(MATMUL_CONFIGS, MATMUL_CPU_CONFIG, key=["programs_class"], restore=("res_ptr",))
@triton.jit
def residual_update_kernel(out_ptr, res_ptr, p_ptr, q_ptr, runs_ptr, run_of_ptr, programs_class,
                           DECODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, OUT_BF16: tl.constexpr,
                           ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """For matrix b of each run and its [BLOCK_N, BLOCK_M] tile t % tiles (tiles row-major),
    b = t // tiles: with DECODE out[b] <- P[b] Q[b]^T (out: the matrices of x as ``ef_matmul``
    reads them, any gradient dtype, rounded to nearest); with HAS_RESIDUAL res[b] <- res[b] -
    P[b] Q[b]^T (res holds M), 0 where not finite. P Q^T is ``rank`` fused multiply-adds per
    element (one column of P and of Q each), no padding."""
    tile, n, m, x_off, x_stride, res_off, p_off, q_off, rank, splits, per_split = _run(
        runs_ptr, run_of_ptr, ALIGN)
    col_blocks = tl.cdiv(m, BLOCK_M)
    tiles = tl.cdiv(n, BLOCK_N) * col_blocks
    b = tile // tiles
    tile = tile % tiles
    p_ptr += p_off + b * n * rank
    q_ptr += q_off + b * m * rank
    rows = (tile // col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (tile % col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    approx = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for j in range(rank):
        p = tl.load(p_ptr + rows * rank + j, mask=rows < n, other=0.0)
        q = tl.load(q_ptr + cols * rank + j, mask=cols < m, other=0.0)
        approx = tl.fma(p[:, None], q[None, :], approx)
    offs = rows[:, None] * m + cols[None, :]
    mask = (rows[:, None] < n) & (cols[None, :] < m)
    if DECODE:
        store_f32(out_ptr + x_off + b * x_stride, offs, approx, mask, OUT_BF16)
    if HAS_RESIDUAL:
        res_ptr += res_off + b * n * m
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


class Run(NamedTuple):
    """k same-shape matrices [n, m] of rank r: in x at x_offset + i * x_stride (elements), and
    back to back in the residual from res_offset, in P ([n, rank] each) from p_offset and in Q
    ([m, rank] each) from q_offset."""

    k: int
    n: int
    m: int
    rank: int
    x_offset: int = 0
    x_stride: int = 0
    res_offset: int = 0
    p_offset: int = 0
    q_offset: int = 0


def orthonormalize_grid(count: int):
    """Grid of :func:`orthonormalize_batched_`: one program per matrix."""
    return lambda meta: (count,)


def run_programs_grid(programs: int):
    """Grid of every matmul kernel: one program per tile of every run (:func:`run_tables`)."""
    return lambda meta: (programs,)


def _tile() -> tuple[int, int]:
    config = MATMUL_CPU_CONFIG if interpreting() else MATMUL_CONFIGS[0]
    return config.kwargs["BLOCK_N"], config.kwargs["BLOCK_M"]


@functools.lru_cache(maxsize=1024)
def run_tables(kind: str, runs: tuple[Run, ...], device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(run table int64 [runs, RUN_FIELDS], program table int32 [programs], programs, align) of
    the ``kind`` kernel ("ef_matmul", "transpose_matmul" or "residual_update") over ``runs`` at
    the shipped tile, on ``device``; made once per (kind, runs, device) and kept (a hook's bucket
    has fixed runs). align: the largest of 8, 4, 1 dividing every m and offset."""
    block_n, block_m = _tile()
    table, run_of, first = [], [], 0
    for i, run in enumerate(runs):
        programs, splits, per_split = run_programs(kind, run.k, run.n, run.m, block_n, block_m)
        table.append([run.n, run.m, run.x_offset, run.x_stride, run.res_offset, run.p_offset,
                      run.q_offset, run.rank, splits, per_split, first])
        run_of += [i] * programs
        first += programs
    values = [v for run in runs for v in (run.m, run.x_offset, run.x_stride, run.res_offset)]
    align = next(a for a in (8, 4, 1) if all(v % a == 0 for v in values))
    return (to_device(table, torch.int64, device), to_device(run_of, torch.int32, device), first, align)


def _check_runs(runs, x, residual, p, q) -> tuple[tuple[Run, ...], int]:
    """(runs as Runs, the largest R_PAD); ValueError naming the first run that does not fit its
    buffers."""
    if not runs:
        raise ValueError("runs must name at least one run of matrices")
    checked = []
    for i, run in enumerate(runs):
        if (not isinstance(run, tuple) or len(run) != len(Run._fields)
                or not all(isinstance(v, int) for v in run)):
            raise ValueError(f"runs[{i}] must be a Run ({', '.join(Run._fields)}), got {run!r}")
        run = Run(*run)
        checked.append(run)
        if min(run.k, run.n, run.m) < 1 or min(run[4:]) < 0:
            raise ValueError(f"runs[{i}] must have positive k, n, m and offsets >= 0, got {run!r}")
        r_pad(run.rank)
        k, n, m, r = run.k, run.n, run.m, run.rank
        ends = [("x", x, run.x_offset + (k - 1) * run.x_stride + n * m),
                ("residual", residual, run.res_offset + k * n * m),
                ("p", p, run.p_offset + k * n * r), ("q", q, run.q_offset + k * m * r)]
        if run.x_stride < n * m and k > 1:
            raise ValueError(f"runs[{i}]: x_stride {run.x_stride} is below n * m = {n * m}")
        for name, buffer, end in ends:
            if buffer is not None and end > buffer.numel():
                raise ValueError(f"runs[{i}] reaches element {end} of {name}, which has {buffer.numel()}")
    return tuple(checked), max(r_pad(run.rank) for run in checked)


def _flat(name: str, t: torch.Tensor | None, dtypes, device=None) -> torch.Tensor | None:
    if t is not None:
        check_flat(name, t, dtypes, device)
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D (a flat buffer), got shape {list(t.shape)}")
    return t


def ef_matmul_runs(x: torch.Tensor, residual: torch.Tensor | None, q: torch.Tensor, p: torch.Tensor,
                   runs: tuple[Run, ...], p_zeroed: bool = False) -> torch.Tensor:
    """P = (x + residual) Q for every matrix of ``runs`` in one launch: x 1-D (any dtype of
    GRADIENT_DTYPES, e.g. a bucket), residual, q, p 1-D fp32 (``p_zeroed``: p holds zeros where
    the runs' P lie, else they are zero-filled here); the residual becomes M = x + residual (None:
    M is x). Returns p."""
    x = _flat("x", x, GRADIENT_DTYPES)
    residual = _flat("residual", residual, (torch.float32,), x.device)
    q, p = _flat("q", q, (torch.float32,), x.device), _flat("p", p, (torch.float32,), x.device)
    runs, padded = _check_runs(runs, x, residual, p, q)
    if not p_zeroed:
        for run in runs:
            p[run.p_offset:run.p_offset + run.k * run.n * run.rank].zero_()
    table, run_of, programs, align = run_tables("ef_matmul", runs, x.device)
    x_arg, x_bf16 = kernel_view(x)
    ef_matmul_kernel[run_programs_grid(programs)](
        x_arg, residual if residual is not None else x_arg, q, p, table, run_of, size_class(programs),
        HAS_RESIDUAL=residual is not None, X_BF16=x_bf16, ALIGN=align, R_PAD=padded, **EXACT)
    return p


def transpose_matmul_runs(x: torch.Tensor, residual: torch.Tensor | None, p: torch.Tensor,
                          q: torch.Tensor, runs: tuple[Run, ...], q_zeroed: bool = False) -> torch.Tensor:
    """Q = M^T P for every matrix of ``runs`` in one launch: M in ``residual`` (fp32, after
    :func:`ef_matmul_runs`), or the matrices of x when residual is None; p, q 1-D fp32
    (``q_zeroed``: q holds zeros where the runs' Q lie). Returns q."""
    x = _flat("x", x, GRADIENT_DTYPES)
    residual = _flat("residual", residual, (torch.float32,), x.device)
    p, q = _flat("p", p, (torch.float32,), x.device), _flat("q", q, (torch.float32,), x.device)
    runs, padded = _check_runs(runs, x, residual, p, q)
    if not q_zeroed:
        for run in runs:
            q[run.q_offset:run.q_offset + run.k * run.m * run.rank].zero_()
    table, run_of, programs, align = run_tables("transpose_matmul", runs, x.device)
    source, x_bf16 = kernel_view(x) if residual is None else (residual, False)
    transpose_matmul_kernel[run_programs_grid(programs)](
        source, p, q, table, run_of, size_class(programs), FROM_X=residual is None, X_BF16=x_bf16,
        ALIGN=align, R_PAD=padded, **EXACT)
    return q


def residual_update_runs(out: torch.Tensor | None, residual: torch.Tensor | None, p: torch.Tensor,
                         q: torch.Tensor, runs: tuple[Run, ...]) -> None:
    """For every matrix of ``runs`` in one launch: out's matrices (1-D, any dtype of
    GRADIENT_DTYPES, laid out as x; None: no decode) <- P Q^T, and residual (1-D fp32 holding M;
    None: none) <- M - P Q^T, 0 where not finite."""
    if out is None and residual is None:
        raise ValueError("residual_update_runs needs out, residual or both")
    device = (out if out is not None else residual).device
    out = _flat("out", out, GRADIENT_DTYPES)
    residual = _flat("residual", residual, (torch.float32,), device)
    p, q = _flat("p", p, (torch.float32,), device), _flat("q", q, (torch.float32,), device)
    runs, _ = _check_runs(runs, out, residual, p, q)
    table, run_of, programs, align = run_tables("residual_update", runs, device)
    out_arg, out_bf16 = kernel_view(out) if out is not None else (residual, False)
    residual_update_kernel[run_programs_grid(programs)](
        out_arg, residual if residual is not None else out_arg, p, q, table, run_of,
        size_class(programs), DECODE=out is not None, HAS_RESIDUAL=residual is not None,
        OUT_BF16=out_bf16, ALIGN=align, **EXACT)


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
    if one_by_one and len(t) > 1 and t.stride(0) < t[0].numel():
        raise ValueError(f"{name}'s matrices must not overlap (batch stride {t.stride(0)})")
    return t


def _span(t: torch.Tensor) -> torch.Tensor:
    """The 1-D view from a batch's first element to its last (matrices at any batch stride)."""
    k, n, m = t.shape
    stride = t.stride(0) if k > 1 else n * m
    return t.as_strided(((k - 1) * stride + n * m,), (1,))


def _batch_run(x: torch.Tensor, rank: int) -> Run:
    k, n, m = x.shape
    return Run(k, n, m, rank, 0, x.stride(0) if k > 1 else n * m)


def ef_matmul(x: torch.Tensor, residual: torch.Tensor | None, q: torch.Tensor,
              out: torch.Tensor | None = None, out_zeroed: bool = False) -> torch.Tensor:
    """x [k, n, m] (+ residual fp32 [k, n, m]: becomes M = x + residual) @ q fp32 [k, m, r] ->
    P fp32 [k, n, r], into ``out`` when given (contiguous; it is zero-filled, then added into;
    ``out_zeroed``: the caller has zero-filled it), in one launch for the batch
    (:func:`ef_matmul_runs` over one run). 2-D arguments ([n, m], [m, r]) are a batch of one and
    give P [n, r].

    x: any dtype of GRADIENT_DTYPES, each matrix x[b] contiguous, at any batch stride (evenly
    spaced in a bucket). Without a residual, M is x itself (read, not written).
    """
    flat = isinstance(x, torch.Tensor) and x.dim() == 2
    x = _batched("x", x, GRADIENT_DTYPES, matrices=True)
    k, n, m = x.shape
    q = _batched("q", q, (torch.float32,), x.device, (k, m, None))
    rank = q.shape[2]
    r_pad(rank)
    if residual is not None:
        residual = _batched("residual", residual, (torch.float32,), x.device, (k, n, m))
    if out is None:
        p = torch.zeros(k, n, rank, dtype=torch.float32, device=x.device)
    else:
        p = _batched("out", out, (torch.float32,), x.device, (k, n, rank))
        if not out_zeroed:
            p.zero_()
    if x.numel():
        ef_matmul_runs(_span(x), None if residual is None else residual.view(-1), q.view(-1),
                       p.view(-1), (_batch_run(x, rank),), p_zeroed=True)
    if out is not None:
        return out
    return p[0] if flat else p


def transpose_matmul(matrices: torch.Tensor, p: torch.Tensor, out: torch.Tensor | None = None,
                     out_zeroed: bool = False) -> torch.Tensor:
    """matrices [k, n, m]^T @ p fp32 [k, n, r] -> Q fp32 [k, m, r] (pass 2: Q = M^T P), into
    ``out`` when given (contiguous; zero-filled, then added into; ``out_zeroed``: the caller has
    zero-filled it), in one launch for the batch (:func:`transpose_matmul_runs` over one run).
    2-D arguments ([n, m], [n, r]) are a batch of one and give Q [m, r].

    matrices: any dtype of GRADIENT_DTYPES, each matrix contiguous, at any batch stride (M in the
    residual, or a gradient in its bucket).
    """
    flat = isinstance(matrices, torch.Tensor) and matrices.dim() == 2
    x = _batched("matrices", matrices, GRADIENT_DTYPES, matrices=True)
    k, n, m = x.shape
    p = _batched("p", p, (torch.float32,), x.device, (k, n, None))
    rank = p.shape[2]
    r_pad(rank)
    if out is None:
        q = torch.zeros(k, m, rank, dtype=torch.float32, device=x.device)
    else:
        q = _batched("out", out, (torch.float32,), x.device, (k, m, rank))
        if not out_zeroed:
            q.zero_()
    if x.numel():
        transpose_matmul_runs(_span(x), None, p.view(-1), q.view(-1), (_batch_run(x, rank),),
                              q_zeroed=True)
    if out is not None:
        return out
    return q[0] if flat else q


def residual_update(matrix: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                    out: torch.Tensor | None = None) -> None:
    """matrix fp32 [k, n, m] (the residuals holding M) <- M - p @ q^T (p [k, n, r], q [k, m, r]),
    0 where not finite, in place, in one launch for the batch (2-D arguments: a batch of one);
    with ``out`` ([k, n, m], any dtype of GRADIENT_DTYPES, each matrix contiguous at any batch
    stride, e.g. the gradients in their bucket) also out <- p @ q^T (the decode) in that launch."""
    matrix = _batched("matrix", matrix, (torch.float32,))
    k, n, m = matrix.shape
    p = _batched("p", p, (torch.float32,), matrix.device, (k, n, None))
    rank = p.shape[2]
    q = _batched("q", q, (torch.float32,), matrix.device, (k, m, rank))
    r_pad(rank)
    if out is not None:
        out = _batched("out", out, GRADIENT_DTYPES, matrix.device, (k, n, m), matrices=True)
    if matrix.numel() == 0:
        return
    run = _batch_run(out, rank) if out is not None else Run(k, n, m, rank, 0, n * m)
    residual_update_runs(None if out is None else _span(out), matrix.view(-1), p.view(-1),
                         q.view(-1), (run,))


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
    """Shipped configs, fp32 gradients with aligned runs (ALIGN 8): ``ef_matmul``,
    ``transpose_matmul`` and the Gram-Schmidt at every R_PAD (ranks 1..16), ``residual_update``
    (it loops over the rank) with and without the decode."""
    cases = []
    tables = {"runs_ptr": "*i64", "run_of_ptr": "*i32", "programs_class": "i32"}
    for config in MATMUL_CONFIGS:
        bn, bm, warps = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_M"], config.num_warps
        tiles = f"BLOCK_N={bn},BLOCK_M={bm},warps={warps}"
        for padded in R_PADS:
            cases.append(CompileCase(
                f"ef_matmul[R_PAD={padded},{tiles}]", jit_function(ef_matmul_kernel),
                {"x_ptr": "*fp32", "res_ptr": "*fp32", "q_ptr": "*fp32", "p_ptr": "*fp32", **tables,
                 "HAS_RESIDUAL": "constexpr", "X_BF16": "constexpr", "ALIGN": "constexpr",
                 "R_PAD": "constexpr", "BLOCK_N": "constexpr", "BLOCK_M": "constexpr"},
                {"HAS_RESIDUAL": True, "X_BF16": False, "ALIGN": 8, "R_PAD": padded, "BLOCK_N": bn,
                 "BLOCK_M": bm},
                warps, aligned=("x_ptr", "res_ptr", "q_ptr", "p_ptr"),
                wide=(ASYNC_WIDE_LOADS, WIDE_STORES)))
            cases.append(CompileCase(
                f"transpose_matmul[R_PAD={padded},{tiles}]", jit_function(transpose_matmul_kernel),
                {"x_ptr": "*fp32", "p_ptr": "*fp32", "q_ptr": "*fp32", **tables,
                 "FROM_X": "constexpr", "X_BF16": "constexpr", "ALIGN": "constexpr",
                 "R_PAD": "constexpr", "BLOCK_N": "constexpr", "BLOCK_M": "constexpr"},
                {"FROM_X": False, "X_BF16": False, "ALIGN": 8, "R_PAD": padded, "BLOCK_N": bn,
                 "BLOCK_M": bm},
                warps, aligned=("x_ptr", "p_ptr", "q_ptr"), wide=(ASYNC_WIDE_LOADS,)))
        for decode in (False, True):
            cases.append(CompileCase(
                f"residual_update[DECODE={decode},{tiles}]", jit_function(residual_update_kernel),
                {"out_ptr": "*fp32", "res_ptr": "*fp32", "p_ptr": "*fp32", "q_ptr": "*fp32", **tables,
                 "DECODE": "constexpr", "HAS_RESIDUAL": "constexpr", "OUT_BF16": "constexpr",
                 "ALIGN": "constexpr", "BLOCK_N": "constexpr", "BLOCK_M": "constexpr"},
                {"DECODE": decode, "HAS_RESIDUAL": True, "OUT_BF16": False, "ALIGN": 8,
                 "BLOCK_N": bn, "BLOCK_M": bm},
                warps, aligned=("out_ptr", "res_ptr", "p_ptr", "q_ptr"), wide=(WIDE_LOADS, WIDE_STORES)))
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
