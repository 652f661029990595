"""fp16 / bf16 kernels: error-feedback add + saturating cast + residual update in one pass, and a
decode that sums the payloads of all ranks in one pass.

Matches gradcomp.methods.cast bit for bit: c = x * prescale + r (the product rounded to fp32
first: ``Method.compress``'s ``scale``), v = c * scale, finite values clamped to the
format's range, rounded to nearest even; residual = c - v / scale, 0 where not finite,
where v / scale is one correctly rounded division (div_rn; the torch path's ``divided``) on every
device, scale rounded to fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (EXACT, GRADIENT_DTYPES, WIDE_LOADS, WIDE_STORES, CompileCase, check_flat,
                     check_addend, decode_target, f32_to_bf16_bits, is_finite, jit_function, kernel_view,
                     load_f32, load_scaled_f32, size_class, store_f32, tuned)

CONFIGS = [triton.Config({"BLOCK": 1024}, num_warps=4), triton.Config({"BLOCK": 4096}, num_warps=8)]
CPU_CONFIG = triton.Config({"BLOCK": 32768})
WIRE_DTYPES = (torch.float16, torch.bfloat16)


@tuned(CONFIGS, CPU_CONFIG, key=["n_class"], restore=("res_ptr",))
@triton.jit
def ef_cast_kernel(x_ptr, res_ptr, out_ptr, n, n_class, prescale, scale, limit,
                   HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr, TO_BF16: tl.constexpr,
                   BLOCK: tl.constexpr):
    """out[i] = saturate((x[i] * prescale + res[i]) * scale) as fp16/bf16; res[i] = what that
    did not send.
    ``n_class`` (common.size_class(n)) only keys autotuning."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = load_scaled_f32(x_ptr, offs, mask, prescale, X_BF16)
    if HAS_RESIDUAL:
        c += tl.load(res_ptr + offs, mask=mask, other=0.0)
    v = c * scale
    clipped = (tl.abs(v) > limit) & (tl.abs(v) < float("inf"))
    v = tl.where(clipped, tl.where(v > 0, limit, -limit), v)
    if TO_BF16:
        bits = f32_to_bf16_bits(v)
        tl.store(out_ptr + offs, bits, mask=mask)
        sent = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        half = v.to(tl.float16)
        tl.store(out_ptr + offs, half, mask=mask)
        sent = half.to(tl.float32)
    if HAS_RESIDUAL:
        diff = c - tl.math.div_rn(sent, scale)
        tl.store(res_ptr + offs, tl.where(is_finite(diff), diff, 0.0), mask=mask)


@tuned(CONFIGS, CPU_CONFIG, key=["n_class", "world"])
@triton.jit
def cast_decode_sum_kernel(values_ptr, addend_ptr, out_ptr, n, n_class, world, scale, addend_scale,
                           FROM_BF16: tl.constexpr, HAS_ADDEND: tl.constexpr,
                           ADDEND_BF16: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = addend[i] * addend_scale (with HAS_ADDEND) + sum over ranks w (in order) of
    values[w, i] / scale, in out's dtype. ``n_class`` (common.size_class(n)) only keys autotuning."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_ADDEND:  # the product rounded to fp32 first, then every rank's row (64-bit steps)
        acc = load_scaled_f32(addend_ptr, offs, mask, addend_scale, ADDEND_BF16)
        for w in range(0, world):
            row_ptr = values_ptr + tl.cast(w, tl.int64) * n
            acc += tl.math.div_rn(load_f32(row_ptr, offs, mask, FROM_BF16), scale)
    else:
        acc = tl.math.div_rn(load_f32(values_ptr, offs, mask, FROM_BF16), scale)
        rank_ptr = values_ptr
        for _ in range(1, world):  # each rank's row starts n after the last: 64-bit pointer steps
            rank_ptr += n
            acc += tl.math.div_rn(load_f32(rank_ptr, offs, mask, FROM_BF16), scale)
    store_f32(out_ptr, offs, acc, mask, OUT_BF16)


def elementwise_grid(n: int):
    """Grid of both kernels: one program per BLOCK elements (axis 0 only)."""
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


def ef_cast(x: torch.Tensor, residual: torch.Tensor | None, scale: float,
            wire_dtype: torch.dtype, prescale: float = 1.0) -> torch.Tensor:
    """prescale * x [n] (+ residual fp32 [n], updated in place) -> values [n] of ``wire_dtype``
    (the method's ``scale`` applied before the cast, divided back out of the residual).

    Global memory: see :func:`.declared.ef_cast_bytes`.
    """
    check_flat("x", x, GRADIENT_DTYPES)
    if wire_dtype not in WIRE_DTYPES:
        raise TypeError(f"wire_dtype must be float16 or bfloat16, got {wire_dtype}")
    if residual is not None:
        check_flat("residual", residual, (torch.float32,), x.device)
    n = x.numel()
    values = torch.empty(n, dtype=wire_dtype, device=x.device)
    if n == 0:
        return values
    x_arg, x_bf16 = kernel_view(x.reshape(-1))
    out_arg, to_bf16 = kernel_view(values)
    ef_cast_kernel[elementwise_grid(n)](x_arg, residual if residual is not None else x_arg, out_arg,
                                        n, size_class(n), float(prescale), float(scale),
                                        torch.finfo(wire_dtype).max,
                                        HAS_RESIDUAL=residual is not None, X_BF16=x_bf16,
                                        TO_BF16=to_bf16, **EXACT)
    return values


def cast_decode_sum(values: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32,
                    out: torch.Tensor | None = None, addend: torch.Tensor | None = None,
                    addend_scale: float = 1.0) -> torch.Tensor:
    """values [world, n] fp16/bf16 (one row per rank) -> [n] of ``dtype`` (or written into
    ``out``): addend * addend_scale (the product rounded to fp32; ``addend`` a contiguous float
    tensor of n elements, or None) plus every rank's decoded tensor, summed in rank order in fp32.
    Global memory: :func:`.declared.cast_decode_sum_bytes`.
    """
    check_flat("values", values, WIRE_DTYPES)
    if values.dim() != 2:
        raise ValueError(f"values must be [world, n], got shape {list(values.shape)}")
    world, n = values.shape
    out = decode_target(n, dtype, out, values.device)
    a_arg, addend_bf16 = check_addend(addend, n, values.device)
    if n == 0 or (world == 0 and addend is None):
        return out.zero_()
    v_arg, from_bf16 = kernel_view(values)
    o_arg, out_bf16 = kernel_view(out)
    cast_decode_sum_kernel[elementwise_grid(n)](v_arg, o_arg if a_arg is None else a_arg, o_arg, n,
                                                size_class(n), world, float(scale),
                                                float(addend_scale), FROM_BF16=from_bf16,
                                                HAS_ADDEND=addend is not None,
                                                ADDEND_BF16=addend_bf16, OUT_BF16=out_bf16, **EXACT)
    return out


def compile_cases() -> list[CompileCase]:
    """Every shipped config of both kernels for fp32 gradients, fp16 and bf16 wires."""
    cases = []
    for config in CONFIGS:
        block, warps = config.kwargs["BLOCK"], config.num_warps
        for to_bf16 in (False, True):
            wire = "*i16" if to_bf16 else "*fp16"
            cases.append(CompileCase(
                f"ef_cast[{'bf16' if to_bf16 else 'fp16'},BLOCK={block},warps={warps}]",
                jit_function(ef_cast_kernel),
                {"x_ptr": "*fp32", "res_ptr": "*fp32", "out_ptr": wire, "n": "i32",
                 "n_class": "i32", "prescale": "fp32", "scale": "fp32",
                 "limit": "fp32", "HAS_RESIDUAL": "constexpr", "X_BF16": "constexpr",
                 "TO_BF16": "constexpr", "BLOCK": "constexpr"},
                {"HAS_RESIDUAL": True, "X_BF16": False, "TO_BF16": to_bf16, "BLOCK": block},
                warps, aligned=("x_ptr", "res_ptr", "out_ptr", "n"), wide=(WIDE_LOADS, WIDE_STORES)))
            for addend in (None, "*fp32", "*bf16"):
                a_tag = "" if addend is None else f",addend={addend[1:]}"
                cases.append(CompileCase(
                    f"cast_decode_sum[{'bf16' if to_bf16 else 'fp16'}{a_tag},BLOCK={block},"
                    f"warps={warps}]",
                    jit_function(cast_decode_sum_kernel),
                    {"values_ptr": wire, "addend_ptr": "*i16" if addend == "*bf16" else addend or "*fp32",
                     "out_ptr": "*fp32", "n": "i32", "n_class": "i32", "world": "i32",
                     "scale": "fp32", "addend_scale": "fp32", "FROM_BF16": "constexpr",
                     "HAS_ADDEND": "constexpr", "ADDEND_BF16": "constexpr",
                     "OUT_BF16": "constexpr", "BLOCK": "constexpr"},
                    {"FROM_BF16": to_bf16, "HAS_ADDEND": addend is not None,
                     "ADDEND_BF16": addend == "*bf16", "OUT_BF16": False, "BLOCK": block},
                    warps, aligned=("values_ptr", "addend_ptr", "out_ptr", "n"),
                    wide=(WIDE_LOADS, WIDE_STORES)))
    return cases
