"""sign kernels: error-feedback add + per-chunk scale + sign bit packing + residual update in one
pass, and an unpack that sums the payloads of all ranks in one pass (in groups of SIGN_GROUP
ranks in rank order, the groups' sums added in order: :func:`sign_decode_sum_kernel`).

Each program owns ROWS whole chunks as a [ROWS, 8, G] tile (common.plane_tile: G = chunk / 8
rounded up to a power of two, masked), so a chunk's scale (mean |v|), its bits and its residual
come from one read; the decode's tile has the planes first ([8, ROWS, G / 4, 4]:
:func:`_decode_tile`), so that each thread's 4 bytes of a plane arrive where their 32 elements
are summed. Bits are bit planes, as gradcomp.methods.sign: in a chunk of w elements,
g = ceil(w / 8), bit i of byte j is element i * g + j, set when its sign bit is set (negative
numbers, -0.0 and NaNs with the sign bit); plane i of the tile is bit i, so packing sums over the
plane axis and every load and store is a contiguous run. Full chunks and a short last chunk
(another g) are two launches (common.plane_runs). The kernels need every chunk to fill whole
bytes (chunk % 8 == 0, as the method requires) and to fit a tile (chunk <= MAX_CHUNK); larger
chunks run on the torch path (see :func:`supports`).

Tolerance: the scale sums |v| over a chunk in a tree order, torch sums in its own order, so
scales (and the residual) agree to a few fp32 ulps (relative 1e-6 for chunk 1024), not bit for bit;
the division of the sum by the chunk's length is correctly rounded on both (div_rn, ``divided``).
Bits are exact; the multi-rank decode-sum is exact given the scales (bit for bit the torch
path's grouped sum, ``Method.decode_group``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (EXACT, GRADIENT_DTYPES, WIDE_LOADS, WIDE_STORES, CompileCase, check_addend,
                     check_flat, decode_target, is_finite, jit_function, kernel_view, load_scaled_f32,
                     plane_grid, plane_runs, plane_tile, size_class, store_f32, tuned)
from .declared import SIGN_GROUP

TILE = 4096
MAX_CHUNK = 8192
CONFIGS = [triton.Config({"TILE": TILE}, num_warps=4)]
"""Both kernels' config. The decode's rank-by-rank form (a byte per element row, shifted per
plane) measured on an H200 at 100M elements: 0.14 / 0.24 / 1.37 ms at p = 2 / 8 / 64, where a
per-chunk table of each group's 16 sums looked up by tl.gather took 1.56 / 1.61 / 1.76 ms
(benchmarks/results/bench_gpu_h200_*.json); its grouped form with the rows-first tile (bytes
exchanged through shared memory, each rank's loads waited for) 0.161 / 0.293 / 1.62 ms
(benchmarks/results/gpu_h200_d75eb4b/bench_sign_rank_by_rank.json). The planes-first form with
loads a group ahead is not yet measured (docs/kernels.md: predicted 0.131 / 0.702 ms at p = 8 /
64 on an H200)."""
CPU_CONFIG = triton.Config({"TILE": 32768})
GROUP = tl.constexpr(SIGN_GROUP)
"""declared.SIGN_GROUP, as the decode kernel reads it."""


def supports(chunk: int) -> bool:
    """Whether the kernels handle this chunk size: byte-aligned chunks that fit one tile."""
    return chunk % 8 == 0 and 8 <= chunk <= MAX_CHUNK


@tuned(CONFIGS, CPU_CONFIG, key=["n_class", "chunk"], restore=("res_ptr",))
@triton.jit
def ef_sign_kernel(x_ptr, res_ptr, bits_ptr, scales_ptr, n, n_class, chunk, first, end, plane,
                   prescale, HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr, CB: tl.constexpr,
                   TILE: tl.constexpr):
    """Pack the signs of TILE // CB chunks of x * prescale + res, one mean-|v| scale each; update res.
    ``n_class`` (common.size_class(n)) only keys autotuning."""
    ROWS: tl.constexpr = TILE // CB if TILE >= CB else 1
    rows, offs, mask = plane_tile(chunk, n, first, end, plane, ROWS, 8, CB // 8)
    c = load_scaled_f32(x_ptr, offs, mask, prescale, X_BF16)
    if HAS_RESIDUAL:
        c += tl.load(res_ptr + offs, mask=mask, other=0.0)
    count = tl.minimum(n - rows * chunk, chunk).to(tl.float32)
    scale = tl.math.div_rn(tl.sum(tl.sum(tl.abs(c), axis=2), axis=1), count)
    tl.store(scales_ptr + rows, scale, mask=rows < end)
    negative = (c.to(tl.int32, bitcast=True) < 0).to(tl.int32)  # the sign bit: -0.0, -NaN too
    packed = tl.sum(negative << tl.arange(0, 8)[None, :, None], axis=1)
    byte = tl.arange(0, CB // 8)
    tl.store(bits_ptr + rows[:, None] * (chunk // 8) + byte[None, :], packed.to(tl.uint8),
             mask=(rows[:, None] < end) & (byte[None, :] < plane))
    if HAS_RESIDUAL:
        diff = c - tl.where(negative != 0, -scale[:, None, None], scale[:, None, None])
        tl.store(res_ptr + offs, tl.where(is_finite(diff), diff, 0.0), mask=mask)


@triton.jit
def _decode_tile(chunk, chunk_bytes, n, first, end, plane, ROWS: tl.constexpr,
                 WORDS: tl.constexpr, Q: tl.constexpr):
    """The decode's tile: this program's ROWS chunks as [8, ROWS, WORDS, Q], planes first;
    element (p, r, w, q) is bit p of byte w * Q + q of chunk r's bits, element p * plane + w * Q
    + q of the chunk. Returns (chunk indices [ROWS], which of them exist, offsets, mask, the
    bytes' offsets in a rank's row [ROWS, WORDS, Q], their mask). With the planes first and Q
    bytes innermost, each thread owns Q whole bytes (one 32-bit load for Q = 4) and all 8 planes
    of them: the bytes arrive in the layout their 8 Q elements are added and stored in (with
    the rows first, Triton exchanged every byte through shared memory)."""
    rows = first + tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    byte = (tl.arange(0, WORDS)[:, None] * Q + tl.arange(0, Q)[None, :])[None, :, :]
    live = rows < end
    bytes_live = live[:, None, None] & (byte < plane)
    within = tl.arange(0, 8).to(tl.int64)[:, None, None, None] * plane + byte[None]
    length = tl.minimum(n - rows * chunk, chunk)[None, :, None, None]
    mask = bytes_live[None] & (within < length)
    offs = (rows * chunk)[None, :, None, None] + within
    return rows, live, offs, mask, rows[:, None, None] * chunk_bytes + byte, bytes_live


@triton.jit
def _group_loads(bits_ptr, scales_ptr, bits_row, scales_row, rows, live, bytes_at, bytes_live,
                 ranks, Q: tl.constexpr):
    """The GROUP ranks at the pointers, of which ``ranks`` exist: each thread's Q bytes of a
    plane as one word [GROUP, ROWS, WORDS] (bit p of byte q its bit 8 q + p; the bytes are
    disjoint bits, so their sum is the word) and the scales' bits [GROUP, ROWS]; 0 past the last
    rank and where masked. Issued together, a loop trip before they are used."""
    rank = tl.arange(0, GROUP)
    here = rank < ranks
    scales = tl.load(scales_ptr + rank.to(tl.int64)[:, None] * scales_row + rows[None, :],
                     mask=here[:, None] & live[None, :], other=0.0)
    packed = tl.load(bits_ptr + rank.to(tl.int64)[:, None, None, None] * bits_row
                     + bytes_at[None], mask=here[:, None, None, None] & bytes_live[None], other=0)
    byte_bit = (8 * tl.arange(0, Q)).to(tl.uint32)[None, None, None, :]
    return tl.sum(packed.to(tl.uint32) << byte_bit, axis=3), scales.to(tl.int32, bitcast=True)


@triton.jit
def _signed_scales(words, scales, r: tl.constexpr, Q: tl.constexpr):
    """Rank r's (of the group) [8, ROWS, WORDS, Q] tile of +-scale: the element's bit shifted
    from its word to bit 31 and XORed into the scale's sign bit (one shift and one LOP3; the
    same bits as where(bit, -scale, scale), NaN and negative scales too). The rank's word and
    scale are picked by a sum over the rank axis of one nonzero term: each thread holds every
    rank of its words, so the compiler picks registers, no instruction."""
    rank = tl.arange(0, GROUP)
    word = tl.sum(tl.where(rank[:, None, None] == r, words, 0), axis=0)
    scale = tl.sum(tl.where(rank[:, None] == r, scales, 0), axis=0)
    shift = (31 - tl.arange(0, 8)[:, None, None, None]
             - 8 * tl.arange(0, Q)[None, None, None, :]).to(tl.uint32)
    sign = (word[None, :, :, None] << shift) & 0x80000000
    return (scale.to(tl.uint32, bitcast=True)[None, :, None, None] ^ sign).to(tl.float32,
                                                                           bitcast=True)


@triton.jit
def _group_sum(words, scales, ranks, Q: tl.constexpr):
    """The +-scales of a group's ranks (of which ``ranks`` exist) summed in rank order."""
    group = _signed_scales(words, scales, 0, Q)
    for r in tl.static_range(1, GROUP):
        group = tl.where(r < ranks, group + _signed_scales(words, scales, r, Q), group)
    return group


@tuned(CONFIGS, CPU_CONFIG, key=["n_class", "chunk", "world"])
@triton.jit
def sign_decode_sum_kernel(bits_ptr, scales_ptr, addend_ptr, out_ptr, n, n_class, scales_row, chunk,
                           chunk_bytes, first, end, plane, world, bits_row, addend_scale,
                           HAS_ADDEND: tl.constexpr, ADDEND_BF16: tl.constexpr,
                           OUT_BF16: tl.constexpr, CB: tl.constexpr, TILE: tl.constexpr):
    """out = addend * addend_scale (with HAS_ADDEND) + the sums of the groups of SIGN_GROUP
    ranks in order, each group's +-scale[w] of each element's chunk summed in rank order, in
    out's dtype: per element and rank one shift, one LOP3 (the bit into the scale's sign) and
    one add; per rank and thread one load of Q bytes and one of a scale, the next group's
    loaded while this group is summed. ``chunk_bytes`` = chunk // 8 (an argument, so that the
    JIT sees it 16-divisible). ``n_class`` (common.size_class(n)) only keys autotuning."""
    ROWS: tl.constexpr = TILE // CB if TILE >= CB else 1
    Q: tl.constexpr = 4 if CB >= 32 else CB // 8
    rows, live, offs, mask, bytes_at, bytes_live = _decode_tile(chunk, chunk_bytes, n, first, end,
                                                                plane, ROWS, CB // 8 // Q, Q)
    bits_step = bits_row.to(tl.int64) * GROUP
    scales_step = scales_row.to(tl.int64) * GROUP
    words, scales = _group_loads(bits_ptr, scales_ptr, bits_row, scales_row, rows, live,
                                 bytes_at, bytes_live, world, Q)
    if HAS_ADDEND:  # the product rounded to fp32 first, then every group's sum
        acc = load_scaled_f32(addend_ptr, offs, mask, addend_scale, ADDEND_BF16)
        summed = 0
    else:  # the first group's sum as it is (0.0 + -0.0 would be +0.0)
        bits_ptr += bits_step
        scales_ptr += scales_step
        ahead, ahead_scales = _group_loads(bits_ptr, scales_ptr, bits_row, scales_row, rows,
                                           live, bytes_at, bytes_live, world - GROUP, Q)
        acc = _group_sum(words, scales, world, Q)
        words, scales = ahead, ahead_scales
        summed = GROUP
    for w in range(summed, world, GROUP):
        bits_ptr += bits_step
        scales_ptr += scales_step
        ahead, ahead_scales = _group_loads(bits_ptr, scales_ptr, bits_row, scales_row, rows,
                                           live, bytes_at, bytes_live, world - w - GROUP, Q)
        acc += _group_sum(words, scales, world - w, Q)
        words, scales = ahead, ahead_scales
    store_f32(out_ptr, offs, acc, mask, OUT_BF16)


def _check_chunk(chunk: int) -> None:
    if not supports(chunk):
        raise ValueError(f"the sign kernels need chunk % 8 == 0 and 8 <= chunk <= {MAX_CHUNK}, "
                         f"got {chunk}")


def ef_sign(x: torch.Tensor, residual: torch.Tensor | None, chunk: int, prescale: float = 1.0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """prescale * x [n] (the product rounded to fp32) (+ residual fp32 [n], updated in place) -> (bits uint8 [ceil(n / 8)], scales fp32
    [ceil(n / chunk)]). Global memory: :func:`.declared.ef_sign_bytes`."""
    check_flat("x", x, GRADIENT_DTYPES)
    if residual is not None:
        check_flat("residual", residual, (torch.float32,), x.device)
    _check_chunk(chunk)
    n = x.numel()
    nchunks = triton.cdiv(n, chunk)
    bits = torch.empty(triton.cdiv(n, 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(nchunks, dtype=torch.float32, device=x.device)
    if n == 0:
        return bits, scales
    x_arg, x_bf16 = kernel_view(x.reshape(-1))
    for first, end, plane in plane_runs(n, chunk, 8):
        ef_sign_kernel[plane_grid(first, end, chunk)](
            x_arg, residual if residual is not None else x_arg, bits, scales, n, size_class(n),
            chunk, first, end,
            plane, float(prescale), HAS_RESIDUAL=residual is not None, X_BF16=x_bf16,
            CB=triton.next_power_of_2(chunk), **EXACT)
    return bits, scales


def sign_decode_sum(bits: torch.Tensor, scales: torch.Tensor, n: int, chunk: int,
                    dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                    addend: torch.Tensor | None = None, addend_scale: float = 1.0) -> torch.Tensor:
    """bits uint8 [world, ceil(n / 8)], scales fp32 [world, ceil(n / chunk)] -> [n] of ``dtype``
    (or written into ``out``): addend * addend_scale (the product rounded to fp32; ``addend`` a
    contiguous float tensor of n elements, or None) plus every rank's decoded tensor, summed in
    rank order in fp32. Global memory: :func:`.declared.sign_decode_sum_bytes`."""
    check_flat("bits", bits, (torch.uint8,), rows=True)
    check_flat("scales", scales, (torch.float32,), bits.device, rows=True)
    _check_chunk(chunk)
    nchunks, row = triton.cdiv(n, chunk), triton.cdiv(n, 8)
    if bits.dim() != 2 or bits.shape[1] != row or scales.shape != (bits.shape[0], nchunks):
        raise ValueError(f"expected bits [world, {row}] and scales [world, {nchunks}] for n={n}, "
                         f"chunk={chunk}; got {list(bits.shape)} and {list(scales.shape)}")
    out = decode_target(n, dtype, out, bits.device)
    a_arg, addend_bf16 = check_addend(addend, n, bits.device)
    world = bits.shape[0]
    if n == 0 or (world == 0 and addend is None):
        return out.zero_()
    out_arg, out_bf16 = kernel_view(out)
    for first, end, plane in plane_runs(n, chunk, 8):
        sign_decode_sum_kernel[plane_grid(first, end, chunk)](
            bits, scales, out_arg if a_arg is None else a_arg, out_arg, n, size_class(n),
            scales.stride(0), chunk, chunk // 8, first, end, plane, world, bits.stride(0),
            float(addend_scale), HAS_ADDEND=addend is not None, ADDEND_BF16=addend_bf16,
            OUT_BF16=out_bf16, CB=triton.next_power_of_2(chunk), **EXACT)
    return out


def compile_cases() -> list[CompileCase]:
    """Shipped configs at the default chunk 1024 and the largest chunk, fp32 gradients."""
    cases = []
    for chunk in (1024, MAX_CHUNK):
        for config in CONFIGS:
            warps = config.num_warps
            cases.append(CompileCase(
                f"ef_sign[chunk={chunk},warps={warps}]", jit_function(ef_sign_kernel),
                {"x_ptr": "*fp32", "res_ptr": "*fp32", "bits_ptr": "*u8", "scales_ptr": "*fp32",
                 "n": "i32", "n_class": "i32", "chunk": "i32", "first": "i32", "end": "i32",
                 "plane": "i32", "prescale": "fp32", "HAS_RESIDUAL": "constexpr",
                 "X_BF16": "constexpr", "CB": "constexpr",
                 "TILE": "constexpr"},
                {"HAS_RESIDUAL": True, "X_BF16": False, "CB": chunk, "TILE": config.kwargs["TILE"]},
                warps, aligned=("x_ptr", "res_ptr", "bits_ptr", "scales_ptr", "n", "chunk",
                                "plane"),
                wide=(WIDE_LOADS, WIDE_STORES)))
        for config in CONFIGS:
            warps = config.num_warps
            for addend in (None, "*fp32", "*bf16"):
                a_tag = "" if addend is None else f"addend={addend[1:]},"
                cases.append(CompileCase(
                    f"sign_decode_sum[{a_tag}chunk={chunk},warps={warps}]",
                    jit_function(sign_decode_sum_kernel),
                    {"bits_ptr": "*u8", "scales_ptr": "*fp32",
                     "addend_ptr": "*i16" if addend == "*bf16" else addend or "*fp32",
                     "out_ptr": "*fp32", "n": "i32",
                     "n_class": "i32", "scales_row": "i32", "chunk": "i32", "chunk_bytes": "i32",
                     "first": "i32", "end": "i32", "plane": "i32", "world": "i32",
                     "bits_row": "i32", "addend_scale": "fp32", "HAS_ADDEND": "constexpr",
                     "ADDEND_BF16": "constexpr", "OUT_BF16": "constexpr", "CB": "constexpr",
                     "TILE": "constexpr"},
                    {"HAS_ADDEND": addend is not None, "ADDEND_BF16": addend == "*bf16",
                     "OUT_BF16": False, "CB": chunk, "TILE": config.kwargs["TILE"]},
                    warps, aligned=("bits_ptr", "scales_ptr", "addend_ptr", "out_ptr", "n",
                                    "chunk", "chunk_bytes", "plane", "bits_row"),
                    wide=(WIDE_STORES,)))
    return cases
