"""top-k kernels: one pass that adds the residual, keeps every element at or above a magnitude
threshold as a candidate (value + int32 index, compacted through an atomic counter and a prefix
sum) and leaves the corrected values in the residual; exact selection among the few candidates;
and a scatter-add decompress of all ranks' payloads.

The threshold comes from the caller (gradcomp.methods.topk estimates it from a seeded sample,
aimed low so that at least k elements pass). The candidate pass writes c = x + r into the
residual for every element; afterwards only candidate positions change (selected: c - sent,
others: c; 0 where not finite), so the residual update costs O(candidates), not another pass.
Non-finite elements always pass, so every position whose residual must become 0 is a candidate.
If fewer than k pass, or more than the candidate buffer holds, the residual already holds c
exactly and the exact top-k over it is taken with torch (a rare, slower path).

The result has exactly k elements, sorted by index; it is the torch path's set up to ties among
equal magnitudes (with ties at the k-th magnitude, which of them is sent may vary on GPUs, where
the candidates' order follows the atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import EXACT, CompileCase, check_flat, jit_function, kernel_view, load_f32, tuned

CONFIGS = [triton.Config({"BLOCK": 2048}, num_warps=4), triton.Config({"BLOCK": 4096}, num_warps=8)]
CPU_CONFIG = triton.Config({"BLOCK": 32768})
IN_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MIN_CAPACITY = 4096


@tuned(CONFIGS, CPU_CONFIG, key=["n"], restore=("res_ptr",), reset=("counter_ptr",))
@triton.jit
def topk_candidates_kernel(x_ptr, res_ptr, values_ptr, indices_ptr, counter_ptr, n, threshold,
                           capacity, HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr,
                           BLOCK: tl.constexpr):
    """Append every (c, i) with |c| >= threshold or c NaN (c = x + res) at counter; res <- c."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = load_f32(x_ptr, offs, mask, X_BF16)
    if HAS_RESIDUAL:
        c += tl.load(res_ptr + offs, mask=mask, other=0.0)
        tl.store(res_ptr + offs, c, mask=mask)
    keep = mask & ((tl.abs(c) >= threshold) | (c != c))
    keep_i = keep.to(tl.int32)
    base = tl.atomic_add(counter_ptr, tl.sum(keep_i, axis=0))
    slot = base + tl.cumsum(keep_i, axis=0) - 1
    store = keep & (slot < capacity)
    tl.store(values_ptr + slot, c, mask=store)
    tl.store(indices_ptr + slot, offs.to(tl.int32), mask=store)


@tuned(CONFIGS, CPU_CONFIG, key=["total"])
@triton.jit
def scatter_add_kernel(values_ptr, indices_ptr, out_ptr, total, V_BF16: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out[indices[j]] += values[j] (fp32 atomics) for the j < total entries of all ranks."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    v = load_f32(values_ptr, offs, mask, V_BF16)
    idx = tl.load(indices_ptr + offs, mask=mask, other=0)
    tl.atomic_add(out_ptr + idx, v, mask=mask, sem="relaxed")


def candidate_capacity(n: int, k: int) -> int:
    """Candidate buffer size: twice k plus slack (a sampled threshold overshoots k by ~5-15%)."""
    return min(n, 2 * k + MIN_CAPACITY)


def ef_topk(x: torch.Tensor, residual: torch.Tensor | None, k: int, threshold: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n] (+ residual fp32 [n], updated in place) -> (values [k] in x's dtype, indices int32
    [k] ascending): the k largest |x + residual| (NaN first). Elements below ``threshold`` are
    skipped by the candidate pass (pass ``inf`` to go straight to the exact path).
    Global memory: :func:`topk_candidates_bytes` for the pass, plus at most
    SELECT_BYTES_PER_CANDIDATE per candidate for the selection.
    """
    check_flat("x", x, IN_DTYPES)
    if residual is not None:
        check_flat("residual", residual, (torch.float32,), x.device)
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}")
    capacity = candidate_capacity(n, k)
    cand_values = torch.empty(capacity, dtype=torch.float32, device=x.device)
    cand_indices = torch.empty(capacity, dtype=torch.int32, device=x.device)
    counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    flat_res = residual.reshape(-1) if residual is not None else None
    if n:
        x_arg, x_bf16 = kernel_view(x.reshape(-1))
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)  # noqa: E731
        topk_candidates_kernel[grid](x_arg, flat_res if flat_res is not None else x_arg, cand_values,
                                     cand_indices, counter, n, float(threshold), capacity,
                                     HAS_RESIDUAL=residual is not None, X_BF16=x_bf16, **EXACT)
    count = int(counter.item())
    if k <= count <= capacity:
        positions, c = cand_indices[:count].long(), cand_values[:count]
    else:  # threshold too high or too low: the residual (or x) holds every corrected value
        positions, c = None, (flat_res.clone() if flat_res is not None else x.reshape(-1).float())
    best = torch.topk(c.abs(), k, sorted=False).indices
    chosen = positions[best] if positions is not None else best
    order = torch.argsort(chosen)  # ascending indices: the atomic order on GPUs varies
    best, chosen = best[order], chosen[order]
    values = c[best].to(x.dtype)
    if flat_res is not None:  # residual <- c - sent where finite, else 0 (it holds c already)
        diff = c[best] - values.float()
        flat_res[chosen] = torch.where(torch.isfinite(diff), diff, torch.zeros((), device=x.device))
        if positions is not None:  # every non-finite c passed the threshold: it is a candidate
            flat_res[positions[~torch.isfinite(c)]] = 0.0
        else:
            flat_res.masked_fill_(~torch.isfinite(flat_res), 0.0)
    return values, chosen.to(torch.int32)


def scatter_add_sum(values: torch.Tensor, indices: torch.Tensor, n: int,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """values [world, k], indices int32 [world, k] -> [n] of ``out_dtype``: zeros plus every
    rank's values at their indices (fp32 atomics: on GPUs the order of additions to one index
    varies, so sums of several ranks agree with torch to fp32 rounding). Global memory:
    :func:`scatter_add_sum_bytes`."""
    check_flat("values", values, IN_DTYPES)
    check_flat("indices", indices, (torch.int32,), values.device)
    if values.shape != indices.shape:
        raise ValueError(f"values {list(values.shape)} and indices {list(indices.shape)} differ")
    out = torch.zeros(n, dtype=torch.float32, device=values.device)
    total = values.numel()
    if total:
        v_arg, v_bf16 = kernel_view(values.reshape(-1))
        grid = lambda meta: (triton.cdiv(total, meta["BLOCK"]),)  # noqa: E731
        scatter_add_kernel[grid](v_arg, indices.reshape(-1), out, total, V_BF16=v_bf16, **EXACT)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def topk_candidates_bytes(n: int, candidates: int, x_itemsize: int, has_residual: bool) -> int:
    """Declared global-memory bytes of the candidate pass of :func:`ef_topk`: read x; with error
    feedback read the residual and write c into it; 8 bytes (value, index) per candidate. (The
    one atomic per program adds 8 bytes per BLOCK elements, < 0.01 %, and is not counted.)"""
    return n * (x_itemsize + (8 if has_residual else 0)) + 8 * candidates


SELECT_BYTES_PER_CANDIDATE = 40
"""Upper bound on the bytes per candidate that the torch selection after the candidate pass
moves (|c|, top-k among candidates, non-finite check, and O(k) gathers, sort and residual
fix-up at the k chosen): about 0.4 bytes per gradient element at 1 % density."""


def scatter_add_sum_bytes(n: int, k: int, world: int, value_itemsize: int,
                          out_itemsize: int) -> int:
    """Declared global-memory bytes of :func:`scatter_add_sum`: zero the fp32 output, read each
    rank's values and indices, one fp32 read-modify-write per entry, and a final cast when the
    output is not fp32."""
    cast = n * (4 + out_itemsize) if out_itemsize != 4 else 0
    return 4 * n + world * k * (value_itemsize + 4 + 8) + cast


def compile_cases() -> list[CompileCase]:
    """Shipped configs of both kernels for fp32 gradients."""
    cases = []
    for config in CONFIGS:
        block, warps = config.kwargs["BLOCK"], config.num_warps
        tag = f"BLOCK={block},warps={warps}"
        cases.append(CompileCase(
            f"topk_candidates[{tag}]", jit_function(topk_candidates_kernel),
            {"x_ptr": "*fp32", "res_ptr": "*fp32", "values_ptr": "*fp32", "indices_ptr": "*i32",
             "counter_ptr": "*i32", "n": "i32", "threshold": "fp32", "capacity": "i32",
             "HAS_RESIDUAL": "constexpr", "X_BF16": "constexpr", "BLOCK": "constexpr"},
            {"HAS_RESIDUAL": True, "X_BF16": False, "BLOCK": block},
            warps, aligned=("x_ptr", "res_ptr", "values_ptr", "indices_ptr", "n"), vector=True))
        cases.append(CompileCase(
            f"scatter_add[{tag}]", jit_function(scatter_add_kernel),
            {"values_ptr": "*fp32", "indices_ptr": "*i32", "out_ptr": "*fp32", "total": "i32",
             "V_BF16": "constexpr", "BLOCK": "constexpr"},
            {"V_BF16": False, "BLOCK": block},
            warps, aligned=("values_ptr", "indices_ptr", "out_ptr", "total"), vector=True))
    return cases
