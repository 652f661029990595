"""sign kernels: error-feedback add + per-chunk scale + sign bit packing + residual update in one
pass, and an unpack that sums the payloads of all ranks in one pass (in groups of SIGN_GROUP
ranks in rank order, the groups' sums added in order: :func:`sign_decode_sum_kernel`).

Each program owns ROWS whole chunks as a [ROWS, 8, G] tile (common.plane_tile: G = chunk / 8
rounded up to a power of two, masked), so a chunk's scale (mean |v|), its bits and its residual
come from one read. The decode's tile is [8, ROWS * G], planes by the chunks' bytes side by
side (:func:`_decode_tile`), so that each thread's 4 bytes of a plane arrive where their 32
elements are summed, whichever Triton (3.6 and 3.9 order equally contiguous axes oppositely). Bits are bit planes, as gradcomp.methods.sign: in a chunk of w elements,
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
(benchmarks/results/gpu_h200_d75eb4b/bench_sign_rank_by_rank.json). The form with the bytes
of a plane in one axis and loads a group ahead is not yet measured (docs/kernels.md: predicted
0.131 / 0.710 ms at p = 8 / 64 on an H200)."""
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
                 BYTES: tl.constexpr):
    """The decode's tile: this program's ROWS chunks as [8, ROWS * BYTES], planes by bytes, the
    chunks' bytes of a plane side by side in one axis: element (p, r * BYTES + j) is bit p of
    byte j of chunk r, element p * plane + j of the chunk. Returns (offsets, mask, the bytes'
    offsets in a rank's row [1, ROWS * BYTES], their mask, the chunks [ROWS], which exist).
    The one axis of consecutive bytes (and elements) holds every thread and warp, so each
    thread owns 4 consecutive bytes of a plane and all 8 planes of them, whatever order Triton
    gives axes of equal contiguity (3.6 and 3.9 give opposite orders): the bytes arrive in the
    layout their elements are added and stored in."""
    at = tl.arange(0, ROWS * BYTES)[None, :]
    byte = at % BYTES
    rows = first + tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row = first + tl.program_id(0).to(tl.int64) * ROWS + at // BYTES
    bytes_live = (row < end) & (byte < plane)
    offs = row * chunk + tl.arange(0, 8).to(tl.int64)[:, None] * plane + byte
    # a byte below ``plane`` is within its chunk (8 plane <= chunk): only n ends the tile (a
    # per-chunk length, as common.plane_tile's, would hide the mask's runs: no 16-byte stores)
    return offs, bytes_live & (offs < n), row * chunk_bytes + byte, bytes_live, rows, rows < end


@triton.jit
def _rank_loads(bits_ptr, scales_ptr, rows, live, bytes_at, bytes_live, r: tl.constexpr, ranks,
                BYTES: tl.constexpr):
    """Rank r's (of those at the pointers, of which ``ranks`` exist; 0 past the last) scales'
    bits [ROWS] and each thread's Q bytes of a plane as one word [ROWS * BYTES / Q] (bit p of
    byte q its bit 8 q + p; disjoint bits, so their sum is the word). The scales are a small
    tensor, which Triton loads in whatever layout its use needs: one load per thread."""
    here = tl.full((1,), r, tl.int32) < ranks
    scale = tl.load(scales_ptr + rows, mask=live & here, other=0.0)
    packed = tl.load(bits_ptr + bytes_at, mask=bytes_live & here, other=0)
    Q: tl.constexpr = 4 if BYTES % 4 == 0 else 1
    quads = tl.reshape(packed.to(tl.uint32), (packed.shape[1] // Q, Q))
    return (tl.sum(quads << (8 * tl.arange(0, Q)).to(tl.uint32)[None, :], axis=1),
            scale.to(tl.uint32, bitcast=True))


@triton.jit
def _group_loads(bits_ptr, scales_ptr, bits_row, scales_row, rows, live, bytes_at, bytes_live,
                 ranks, BYTES: tl.constexpr):
    """The words and scales of the GROUP ranks at the pointers (:func:`_rank_loads`), of which
    ``ranks`` exist: issued together, a loop trip before they are used."""
    tl.static_assert(GROUP == 4, "the decode's loads are written for groups of 4 ranks")
    row = bits_row.to(tl.int64)
    scale_row = scales_row.to(tl.int64)
    w0, s0 = _rank_loads(bits_ptr, scales_ptr, rows, live, bytes_at, bytes_live, 0, ranks, BYTES)
    w1, s1 = _rank_loads(bits_ptr + row, scales_ptr + scale_row, rows, live, bytes_at,
                         bytes_live, 1, ranks, BYTES)
    w2, s2 = _rank_loads(bits_ptr + 2 * row, scales_ptr + 2 * scale_row, rows, live, bytes_at,
                         bytes_live, 2, ranks, BYTES)
    w3, s3 = _rank_loads(bits_ptr + 3 * row, scales_ptr + 3 * scale_row, rows, live, bytes_at,
                         bytes_live, 3, ranks, BYTES)
    return w0, s0, w1, s1, w2, s2, w3, s3


@triton.jit
def _signed_scales(word, scale, BYTES: tl.constexpr):
    """A rank's [8, ROWS * BYTES] tile of +-scale from its words and scales (:func:`_rank_loads`,
    spread over the bytes they cover, in registers): each element's bit shifted from its word to
    bit 31 and XORed into its chunk's scale's sign bit (one shift and one LOP3; the same bits as
    where(bit, -scale, scale), NaN and negative scales too)."""
    Q: tl.constexpr = 4 if BYTES % 4 == 0 else 1
    K: tl.constexpr = word.shape[0] * Q
    word = tl.reshape(tl.broadcast_to(word[:, None], (K // Q, Q)), (1, K))
    scale = tl.reshape(tl.broadcast_to(scale[:, None], (K // BYTES, BYTES)), (1, K))
    shift = 31 - tl.arange(0, 8)[:, None] - 8 * (tl.arange(0, K) % Q)[None, :]
    return (scale ^ ((word << shift.to(tl.uint32)) & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _group_sum(w0, s0, w1, s1, w2, s2, w3, s3, ranks, BYTES: tl.constexpr):
    """The +-scales of a group's ranks (of which ``ranks`` exist) summed in rank order."""
    group = _signed_scales(w0, s0, BYTES)
    group = tl.where(1 < ranks, group + _signed_scales(w1, s1, BYTES), group)
    group = tl.where(2 < ranks, group + _signed_scales(w2, s2, BYTES), group)
    return tl.where(3 < ranks, group + _signed_scales(w3, s3, BYTES), group)


@tuned(CONFIGS, CPU_CONFIG, key=["n_class", "chunk", "world"])
@triton.jit
def sign_decode_sum_kernel(bits_ptr, scales_ptr, addend_ptr, out_ptr, n, n_class, scales_row, chunk,
                           chunk_bytes, first, end, plane, world, bits_row, addend_scale,
                           HAS_ADDEND: tl.constexpr, ADDEND_BF16: tl.constexpr,
                           OUT_BF16: tl.constexpr, CB: tl.constexpr, TILE: tl.constexpr):
    """out = addend * addend_scale (with HAS_ADDEND) + the sums of the groups of SIGN_GROUP
    ranks in order, each group's +-scale[w] of each element's chunk summed in rank order, in
    out's dtype: per element and rank one shift, one LOP3 (the bit into the scale's sign) and
    one add; per rank and thread one load of 4 bytes (1 for chunks below 32) and one of a
    scale, the next group's issued while this group is summed. ``chunk_bytes`` = chunk // 8
    (an argument, so that the JIT sees it 16-divisible). ``n_class`` (common.size_class(n))
    only keys autotuning."""
    ROWS: tl.constexpr = TILE // CB if TILE >= CB else 1
    BYTES: tl.constexpr = CB // 8
    offs, mask, bytes_at, bytes_live, rows, live = _decode_tile(chunk, chunk_bytes, n, first, end,
                                                                plane, ROWS, BYTES)
    step = bits_row.to(tl.int64) * GROUP
    scales_step = scales_row.to(tl.int64) * GROUP
    w0, s0, w1, s1, w2, s2, w3, s3 = _group_loads(bits_ptr, scales_ptr, bits_row, scales_row, rows,
                                                  live, bytes_at, bytes_live, world, BYTES)
    if HAS_ADDEND:  # the product rounded to fp32 first, then every group's sum
        acc = load_scaled_f32(addend_ptr, offs, mask, addend_scale, ADDEND_BF16)
        summed = 0
    else:  # the first group's sum as it is (0.0 + -0.0 would be +0.0)
        bits_ptr += step
        scales_ptr += scales_step
        n0, m0, n1, m1, n2, m2, n3, m3 = _group_loads(bits_ptr, scales_ptr, bits_row, scales_row,
                                                      rows, live, bytes_at, bytes_live,
                                                      world - GROUP, BYTES)
        acc = _group_sum(w0, s0, w1, s1, w2, s2, w3, s3, world, BYTES)
        w0, s0, w1, s1, w2, s2, w3, s3 = n0, m0, n1, m1, n2, m2, n3, m3
        summed = GROUP
    for w in range(summed, world, GROUP):
        bits_ptr += step
        scales_ptr += scales_step
        n0, m0, n1, m1, n2, m2, n3, m3 = _group_loads(bits_ptr, scales_ptr, bits_row, scales_row,
                                                      rows, live, bytes_at, bytes_live,
                                                      world - w - GROUP, BYTES)
        acc += _group_sum(w0, s0, w1, s1, w2, s2, w3, s3, world - w, BYTES)
        w0, s0, w1, s1, w2, s2, w3, s3 = n0, m0, n1, m1, n2, m2, n3, m3
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
