"""int8 / int4 kernels: error-feedback add + block absmax quantization + residual update in one
pass, and a dequantize that sums the payloads of all ranks in one pass.

Each program owns ROWS whole quantization blocks, laid out as a [ROWS, PLANES, QB / PLANES] tile
(common.plane_tile; QB = block size rounded up to a power of two, masked), so the absmax, the
codes and the residual of a block are computed from one read of the gradient and the residual.
int8 has one plane (element j of a block). int4 has two, as gradcomp.methods.quant packs them: a
block of w elements is two halves of h = ceil(w / 2), byte j holding element j (low nibble) and
element h + j (high nibble), so packing sums over the plane axis and every load and store is a
contiguous run; full blocks and a short last block (another h) are two launches.

Matches gradcomp.methods.quant, for v = x * prescale + r (the product rounded to fp32 first:
``Method.compress``'s ``scale``): scale = amax / L (one correctly rounded division, div_rn, as the
torch path's ``divided``), q = clamp(round(v * (L / amax))) (L / amax as fl(fl(1 / amax) * L),
the torch path's ``amax.reciprocal() * L``), residual = v - q * scale (0 where not
finite); a block holding NaN/inf gets scale NaN and codes 0; a block whose L / amax overflows
(or amax = 0) gets scale 0 and codes 0. Round-to-nearest codes are bit-exact with torch on
every device (both divide correctly rounded); stochastic codes use ``tl.rand(seed, element
index)`` instead of torch's generator: unbiased and reproducible, not the same draws.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (EXACT, GRADIENT_DTYPES, WIDE_LOADS, WIDE_STORES, CompileCase, check_addend,
                     check_flat, decode_target, is_finite, jit_function, kernel_view,
                     load_scaled_f32, plane_grid, plane_runs, plane_tile, round_half_even, size_class, store_f32,
                     tuned)

TILE = 2048
"""Elements per program on GPUs (ROWS = TILE // QB blocks); blocks above MAX_BLOCK use torch."""
MAX_BLOCK = 4096
CONFIGS = [triton.Config({"TILE": TILE}, num_warps=4)]
DECODE_CONFIGS = [triton.Config({"TILE": 2 * TILE}, num_warps=4)]
"""The decode's 32 elements per thread per rank (16 bytes of int4 codes: one 128-bit load): the
per-rank pointer steps and the loop branch spread over twice the elements of ``CONFIGS``."""
CPU_CONFIG = triton.Config({"TILE": 32768})


def supports(block: int) -> bool:
    """Whether the kernels handle this quantization block size (one block fits in one tile)."""
    return 2 <= block <= MAX_BLOCK


@tuned(CONFIGS, CPU_CONFIG, key=["n_class", "block"], restore=("res_ptr",))
@triton.jit
def ef_quantize_kernel(x_ptr, res_ptr, q_ptr, scales_ptr, n, n_class, block, first, end, plane,
                       prescale, levels, seed, HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr,
                       STOCHASTIC: tl.constexpr, INT4: tl.constexpr, QB: tl.constexpr,
                       TILE: tl.constexpr):
    """Quantize TILE // QB blocks of x * prescale + res; write codes, one scale per block, the
    new residual.
    ``n_class`` (common.size_class(n)) only keys autotuning."""
    ROWS: tl.constexpr = TILE // QB if TILE >= QB else 1
    PLANES: tl.constexpr = 2 if INT4 else 1
    rows, offs, mask = plane_tile(block, n, first, end, plane, ROWS, PLANES, QB // PLANES)
    c = load_scaled_f32(x_ptr, offs, mask, prescale, X_BF16)
    if HAS_RESIDUAL:
        c += tl.load(res_ptr + offs, mask=mask, other=0.0)
    finite = is_finite(c)
    block_finite = tl.min(tl.min(finite.to(tl.int32), axis=2), axis=1) > 0
    amax = tl.max(tl.max(tl.where(finite, tl.abs(c), 0.0), axis=2), axis=1)
    # levels / amax as the torch path defines it: reciprocal(amax) * levels, two roundings
    inv = tl.math.div_rn(1.0, amax) * levels
    # a zero block, or one so small that levels / amax overflows, is sent as zeros with scale 0
    sent = (amax > 0) & (inv < float("inf"))
    t = c * tl.where(sent, inv, 0.0)[:, None, None]
    if STOCHASTIC:
        q = tl.floor(t + tl.rand(seed, offs))
    else:
        q = round_half_even(t)
    q = tl.where(block_finite[:, None, None], tl.minimum(tl.maximum(q, -levels), levels), 0.0)
    scale = tl.where(block_finite, tl.where(sent, tl.math.div_rn(amax, levels), 0.0), float("nan"))
    tl.store(scales_ptr + rows, scale, mask=rows < end)
    if INT4:
        nibbles = (q.to(tl.int32) + 8) << (4 * tl.arange(0, 2))[None, :, None]
        byte = tl.arange(0, QB // 2)
        tl.store(q_ptr + rows[:, None] * (block // 2) + byte[None, :],
                 tl.sum(nibbles, axis=1).to(tl.uint8),
                 mask=(rows[:, None] < end) & (byte[None, :] < plane))
    else:
        tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
    if HAS_RESIDUAL:
        diff = c - q * scale[:, None, None]
        tl.store(res_ptr + offs, tl.where(is_finite(diff), diff, 0.0), mask=mask)


@triton.jit
def _dequantized(q_ptr, scales_ptr, rows, offs, mask, block_bytes, end, plane, INT4: tl.constexpr,
                 QB: tl.constexpr):
    """One rank's [ROWS, PLANES, QB / PLANES] tile of q * scale (fp32). int4 bytes are loaded as
    [ROWS, 1, QB / 2] and broadcast over the two planes: the thread that loads a byte owns both
    its elements (no layout conversion through shared memory per rank). A code becomes a float
    by a magic exponent, in place (one LOP3 and one FADD, no shift, no conversion): an int4 low
    nibble as fp32(0x4B000000 | (byte & 0x0F)) = 2**23 + nibble, a high one as
    fp32(0x49000000 | (byte & 0xF0)) = 2**19 + nibble (bit 4 weighs 1 under exponent 19), minus
    2**23 + 8 or 2**19 + 8; an int8 code c as fp32((c & 0xFF) ^ 0x4B000080) = 2**23 + c + 128,
    minus 2**23 + 128: q exactly."""
    scale = tl.load(scales_ptr + rows, mask=rows < end, other=0.0)[:, None, None]
    if INT4:
        byte = tl.arange(0, QB // 2)[None, None, :]
        packed = tl.load(q_ptr + rows[:, None, None] * block_bytes + byte,
                         mask=(rows[:, None, None] < end) & (byte < plane), other=0x88)
        high = tl.arange(0, 2)[None, :, None]
        magic = (packed.to(tl.int32) & (0xF << 4 * high)) | (0x4B000000 - (high << 25))
        q = magic.to(tl.float32, bitcast=True) - tl.where(high == 0, 8388616.0, 524296.0)
    else:
        codes = tl.load(q_ptr + offs, mask=mask, other=0)
        q = ((codes.to(tl.int32) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
    return q * scale


@tuned(DECODE_CONFIGS, CPU_CONFIG, key=["n_class", "block", "world"])
@triton.jit
def dequantize_sum_kernel(q_ptr, scales_ptr, addend_ptr, out_ptr, n, n_class, scales_row, block,
                          block_bytes, first, end, plane, world, q_row, addend_scale,
                          INT4: tl.constexpr, HAS_ADDEND: tl.constexpr, ADDEND_BF16: tl.constexpr,
                          OUT_BF16: tl.constexpr, QB: tl.constexpr, TILE: tl.constexpr):
    """out = addend * addend_scale (with HAS_ADDEND) + sum over ranks w (in order) of
    q[w] * scale[w] of its block, in out's dtype. ``block_bytes``: a block's bytes of int4 codes,
    block // 2 (an argument, so that the JIT sees it 16-divisible: one wide load per thread).
    ``n_class`` (common.size_class(n)) only keys autotuning."""
    ROWS: tl.constexpr = TILE // QB if TILE >= QB else 1
    PLANES: tl.constexpr = 2 if INT4 else 1
    rows, offs, mask = plane_tile(block, n, first, end, plane, ROWS, PLANES, QB // PLANES)
    q_rank, scales_rank = q_ptr, scales_ptr  # stepped by *_row: 64-bit pointer steps
    if HAS_ADDEND:  # the product rounded to fp32 first, then every rank's row (stepped
        # pointers: indexed ones spill 4 bytes on sm_90 with an fp32 addend and int4 codes)
        acc = load_scaled_f32(addend_ptr, offs, mask, addend_scale, ADDEND_BF16)
        for _ in range(0, world):
            acc += _dequantized(q_rank, scales_rank, rows, offs, mask, block_bytes, end, plane,
                                INT4, QB)
            q_rank += q_row
            scales_rank += scales_row
    else:  # the first rank's values as they are (0.0 + -0.0 would be +0.0)
        acc = _dequantized(q_rank, scales_rank, rows, offs, mask, block_bytes, end, plane, INT4,
                           QB)
        for _ in range(1, world):
            q_rank += q_row
            scales_rank += scales_row
            acc += _dequantized(q_rank, scales_rank, rows, offs, mask, block_bytes, end, plane,
                                INT4, QB)
    store_f32(out_ptr, offs, acc, mask, OUT_BF16)


def ef_quantize(x: torch.Tensor, residual: torch.Tensor | None, block: int, levels: int,
                seed: int | None = None, prescale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """prescale * x [n] (the product rounded to fp32) (+ residual fp32 [n], updated in place) -> (codes, scales fp32 [ceil(n / block)]).

    levels 127 gives int8 codes [n]; levels 7 gives int4 codes packed two per byte, uint8
    [ceil(n / 2)] (each block's halves paired, stored as q + 8; see the module doc). ``seed`` switches on stochastic rounding.
    Global memory: :func:`.declared.ef_quantize_bytes`.
    """
    check_flat("x", x, GRADIENT_DTYPES)
    if residual is not None:
        check_flat("residual", residual, (torch.float32,), x.device)
    if levels not in (7, 127) or not supports(block) or (levels == 7 and block % 2):
        raise ValueError(f"ef_quantize needs levels 7 or 127 and an (even for int4) block in "
                         f"[2, {MAX_BLOCK}], got levels={levels}, block={block}")
    n = x.numel()
    nblocks = triton.cdiv(n, block)
    int4 = levels == 7
    codes = torch.empty(triton.cdiv(n, 2) if int4 else n, dtype=torch.uint8 if int4 else torch.int8,
                        device=x.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    if n == 0:
        return codes, scales
    x_arg, x_bf16 = kernel_view(x.reshape(-1))
    for first, end, plane in plane_runs(n, block, 2 if int4 else 1):
        ef_quantize_kernel[plane_grid(first, end, block)](
            x_arg, residual if residual is not None else x_arg, codes, scales, n, size_class(n),
            block, first, end,
            plane, float(prescale), float(levels), 0 if seed is None else int(seed),
            HAS_RESIDUAL=residual is not None, X_BF16=x_bf16, STOCHASTIC=seed is not None,
            INT4=int4, QB=triton.next_power_of_2(block), **EXACT)
    return codes, scales


def dequantize_sum(codes: torch.Tensor, scales: torch.Tensor, n: int, block: int,
                   dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                   addend: torch.Tensor | None = None, addend_scale: float = 1.0) -> torch.Tensor:
    """codes [world, n] int8 or [world, ceil(n / 2)] packed int4 (uint8), scales fp32 [world,
    ceil(n / block)] -> [n] of ``dtype`` (or written into ``out``): addend * addend_scale (the
    product rounded to fp32; ``addend`` a contiguous float tensor of n elements, or None) plus
    every rank's decoded tensor, summed in rank order in fp32.
    Global memory: :func:`.declared.dequantize_sum_bytes`.
    """
    check_flat("codes", codes, (torch.int8, torch.uint8), rows=True)
    check_flat("scales", scales, (torch.float32,), codes.device, rows=True)
    nblocks = triton.cdiv(n, block)
    int4 = codes.dtype == torch.uint8
    row = triton.cdiv(n, 2) if int4 else n
    if codes.dim() != 2 or codes.shape[1] != row or scales.shape != (codes.shape[0], nblocks):
        raise ValueError(f"expected codes [world, {row}] and scales [world, {nblocks}] for n={n}, "
                         f"block={block}; got {list(codes.shape)} and {list(scales.shape)}")
    if not supports(block):
        raise ValueError(f"dequantize_sum handles blocks in [2, {MAX_BLOCK}], got {block}")
    out = decode_target(n, dtype, out, codes.device)
    a_arg, addend_bf16 = check_addend(addend, n, codes.device)
    world = codes.shape[0]
    if n == 0 or (world == 0 and addend is None):
        return out.zero_()
    out_arg, out_bf16 = kernel_view(out)
    for first, end, plane in plane_runs(n, block, 2 if int4 else 1):
        dequantize_sum_kernel[plane_grid(first, end, block)](
            codes, scales, out_arg if a_arg is None else a_arg, out_arg, n, size_class(n),
            scales.stride(0), block, block // 2, first, end, plane, world, codes.stride(0),
            float(addend_scale), INT4=int4, HAS_ADDEND=addend is not None,
            ADDEND_BF16=addend_bf16, OUT_BF16=out_bf16, QB=triton.next_power_of_2(block), **EXACT)
    return out


def compile_cases() -> list[CompileCase]:
    """Shipped configs for int8 and int4 at the default block 256 and the largest block, fp32 in."""
    cases = []
    for config in CONFIGS:
        warps = config.num_warps
        for block in (256, MAX_BLOCK):
            for int4, stochastic in ((False, False), (False, True), (True, False)):
                kind = ("int4" if int4 else "int8") + (",stochastic" if stochastic else "")
                tag = f"{kind},block={block},warps={warps}"
                cases.append(CompileCase(
                    f"ef_quantize[{tag}]", jit_function(ef_quantize_kernel),
                    {"x_ptr": "*fp32", "res_ptr": "*fp32", "q_ptr": "*u8" if int4 else "*i8",
                     "scales_ptr": "*fp32", "n": "i32", "n_class": "i32", "block": "i32",
                     "first": "i32",
                     "end": "i32", "plane": "i32", "prescale": "fp32", "levels": "fp32",
                     "seed": "i32",
                     "HAS_RESIDUAL": "constexpr", "X_BF16": "constexpr", "STOCHASTIC": "constexpr",
                     "INT4": "constexpr", "QB": "constexpr", "TILE": "constexpr"},
                    {"HAS_RESIDUAL": True, "X_BF16": False, "STOCHASTIC": stochastic, "INT4": int4,
                     "QB": block, "TILE": TILE},
                    warps, aligned=("x_ptr", "res_ptr", "q_ptr", "scales_ptr", "n", "block",
                                    "plane"),
                    wide=(WIDE_LOADS, WIDE_STORES)))
                if stochastic:
                    continue
                for addend in (None, "*fp32", "*bf16"):
                    a_tag = "" if addend is None else f",addend={addend[1:]}"
                    cases.append(CompileCase(
                        f"dequantize_sum[{kind}{a_tag},block={block},warps={warps}]",
                        jit_function(dequantize_sum_kernel),
                        {"q_ptr": "*u8" if int4 else "*i8", "scales_ptr": "*fp32",
                         "addend_ptr": "*i16" if addend == "*bf16" else addend or "*fp32",
                         "out_ptr": "*fp32",
                         "n": "i32", "n_class": "i32", "scales_row": "i32", "block": "i32",
                         "block_bytes": "i32", "first": "i32", "end": "i32",
                         "plane": "i32", "world": "i32", "q_row": "i32", "addend_scale": "fp32",
                         "INT4": "constexpr", "HAS_ADDEND": "constexpr",
                         "ADDEND_BF16": "constexpr", "OUT_BF16": "constexpr", "QB": "constexpr",
                         "TILE": "constexpr"},
                        {"INT4": int4, "HAS_ADDEND": addend is not None,
                         "ADDEND_BF16": addend == "*bf16", "OUT_BF16": False, "QB": block,
                         "TILE": DECODE_CONFIGS[0].kwargs["TILE"]},
                        DECODE_CONFIGS[0].num_warps,
                        aligned=("q_ptr", "scales_ptr", "addend_ptr", "out_ptr", "n", "block",
                                 "block_bytes", "plane", "q_row"),
                        wide=(WIDE_LOADS, WIDE_STORES)))
    return cases
