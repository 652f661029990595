"""top-k kernels: one pass that adds the residual, keeps every element at or above a magnitude
threshold as a candidate (|value| + int32 index, compacted through an atomic counter and a prefix
sum) and leaves the corrected values in the residual; the exact top-k among the few candidates
(torch.topk on them); a gather that writes the payload and settles the residual at the k chosen
positions; and a scatter-add decompress of all ranks' payloads.

The threshold comes from the caller as a 0-d device tensor (gradcomp.methods.topk estimates it
from a seeded sample, aimed low so that at least k elements pass; it never goes to the host), or
None for the exact top-k (the pass then writes every |c| into an n-element buffer, no threshold
and no compaction, and torch.topk over it picks the k: no host read, no separate |c| pass). The
candidate pass writes c = x + r into the residual everywhere; only the k sent positions change afterwards (c - sent, 0 where not finite),
so the residual update costs O(k), not another pass. Non-finite elements always pass the
threshold and are counted; when there are any, one more pass zeroes them in the residual (a
kernel that reads the count on the device: without any, each of its programs reads 4 bytes and
stops; the count is never read back for it).
If fewer than k elements pass, or more than the candidate buffer holds, the residual (or x)
already holds every c and torch.topk over all of it picks the k (a rare, slower path).

The result has exactly k elements: the torch path's set up to ties among equal magnitudes, in
the order torch.topk returns them among the candidates (candidates arrive in the order of the
atomics: ascending under the interpreter, varying on GPUs; decoding does not depend on it).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .common import (EXACT, GRADIENT_DTYPES, WIDE_LOADS, WIDE_STORES, CompileCase, check_flat,
                     decode_target, is_finite, jit_function, kernel_view, load_f32, size_class,
                     store_f32, tuned)

CONFIGS = [triton.Config({"BLOCK": 2048}, num_warps=4), triton.Config({"BLOCK": 4096}, num_warps=8)]
CPU_CONFIG = triton.Config({"BLOCK": 32768})
MIN_CAPACITY = 4096


@tuned(CONFIGS, CPU_CONFIG, key=["n_class"], restore=("res_ptr",), reset=("counter_ptr",))
@triton.jit
def topk_candidates_kernel(x_ptr, res_ptr, magnitudes_ptr, indices_ptr, counter_ptr, n, n_class,
                           threshold_ptr, capacity, HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr,
                           DENSE: tl.constexpr, BLOCK: tl.constexpr):
    """Append (|c|, i) for every |c| >= threshold or c NaN (c = x + res) at counter[0]; count the
    non-finite ones in counter[1]; res <- c. The threshold is read from device memory (the
    sampled one is never read back to the host). DENSE (the exact top-k): magnitudes[i] = |c|
    for every i instead (n slots; no threshold, no compaction). ``n_class``
    (common.size_class(n)) only keys autotuning."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = load_f32(x_ptr, offs, mask, X_BF16)
    if HAS_RESIDUAL:
        c += tl.load(res_ptr + offs, mask=mask, other=0.0)
        tl.store(res_ptr + offs, c, mask=mask)
    magnitude = tl.abs(c)
    nonfinite = tl.sum((mask & ~is_finite(c)).to(tl.int32), axis=0)
    tl.atomic_add(counter_ptr + 1, nonfinite, mask=nonfinite > 0, sem="relaxed")
    if DENSE:
        tl.store(magnitudes_ptr + offs, magnitude, mask=mask)
    else:
        threshold = tl.load(threshold_ptr)
        keep = mask & ((magnitude >= threshold) | (c != c))
        keep_i = keep.to(tl.int32)
        base = tl.atomic_add(counter_ptr, tl.sum(keep_i, axis=0), sem="relaxed")
        slot = base + tl.cumsum(keep_i, axis=0) - 1
        store = keep & (slot < capacity)
        tl.store(magnitudes_ptr + slot, magnitude, mask=store)
        tl.store(indices_ptr + slot, offs.to(tl.int32), mask=store)


@tuned(CONFIGS, CPU_CONFIG, key=["k_class"], restore=("res_ptr",))
@triton.jit
def topk_gather_kernel(best_ptr, cand_ptr, source_ptr, res_ptr, values_ptr, indices_ptr, k, k_class,
                       DIRECT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr,
                       BLOCK: tl.constexpr):
    """For j < k: i = cand[best[j]] (or best[j] when DIRECT); values[j] = c[i] in x's dtype,
    indices[j] = i; res[i] = c[i] - values[j], 0 where not finite. c is read from the residual
    (which holds it) or, without error feedback, from x (source). ``k_class``
    (common.size_class(k)) only keys autotuning."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < k
    chosen = tl.load(best_ptr + offs, mask=mask, other=0)
    if not DIRECT:
        chosen = tl.load(cand_ptr + chosen, mask=mask, other=0).to(tl.int64)
    c = load_f32(source_ptr, chosen, mask, X_BF16 and not HAS_RESIDUAL)
    store_f32(values_ptr, offs, c, mask, X_BF16)
    tl.store(indices_ptr + offs, chosen.to(tl.int32), mask=mask)
    if HAS_RESIDUAL:
        sent = load_f32(values_ptr, offs, mask, X_BF16)
        diff = c - sent
        tl.store(res_ptr + chosen, tl.where(is_finite(diff), diff, 0.0), mask=mask)


@tuned(CONFIGS, CPU_CONFIG, key=["n_class"], restore=("res_ptr",))
@triton.jit
def zero_nonfinite_kernel(res_ptr, counter_ptr, n, n_class, BLOCK: tl.constexpr):
    """res[i] <- 0 where res[i] is not finite, only when counter[1] (the candidate pass's count
    of non-finite values) is not 0: otherwise each program reads that count and stops, so a
    finite gradient costs no pass and the count is never read back to the host. ``n_class``
    (common.size_class(n)) only keys autotuning."""
    if tl.load(counter_ptr + 1) != 0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        tl.store(res_ptr + offs, tl.zeros_like(r), mask=mask & ~is_finite(r))


@tuned(CONFIGS, CPU_CONFIG, key=["k_class"], reset=("out_ptr",))
@triton.jit
def scatter_add_kernel(values_ptr, indices_ptr, out_ptr, k, k_class, values_row, indices_row,
                       V_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """out[indices[w, j]] += values[w, j] (fp32 atomics) for the k entries of every rank w; program
    i handles block i % blocks of rank i // blocks (blocks = cdiv(k, BLOCK)), all on grid axis 0;
    each rank's row starts ``*_row`` elements after the previous one. ``out`` must start at zero
    (autotuning zeroes it before each trial); ``k_class`` (common.size_class(k)) only keys
    autotuning."""
    program = tl.program_id(0).to(tl.int64)
    blocks = tl.cdiv(k, BLOCK)
    rank = program // blocks
    offs = (program % blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < k
    v = load_f32(values_ptr + rank * values_row, offs, mask, V_BF16)
    idx = tl.load(indices_ptr + rank * indices_row + offs, mask=mask, other=0)
    tl.atomic_add(out_ptr + idx, v, mask=mask, sem="relaxed")


def elementwise_grid(n: int):
    """Grid of the candidate pass (n elements) and the gather (k): one program per BLOCK."""
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


def scatter_add_grid(k: int, world: int):
    """Grid of the scatter-add: cdiv(k, BLOCK) programs per rank, every rank on axis 0."""
    return lambda meta: (world * triton.cdiv(k, meta["BLOCK"]),)


def candidate_capacity(n: int, k: int) -> int:
    """Candidate buffer size: twice k plus slack (a sampled threshold overshoots k by ~5-15%)."""
    return min(n, 2 * k + MIN_CAPACITY)


def ef_topk(x: torch.Tensor, residual: torch.Tensor | None, k: int, threshold: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n] (+ residual fp32 [n], updated in place) -> (values [k] in x's dtype, indices int32
    [k]): the k largest |x + residual| (NaN first).

    threshold: None for the exact top-k (nothing is read back to the host), or a 0-d fp32 tensor
        on x's device: elements below it are skipped by the candidate pass, and the candidate
        count is read back once (it sizes the top-k among candidates and picks the exact path
        when fewer than k or more than the buffer passed).
    Global memory: :func:`ef_topk_bytes` on the one-pass path, :func:`ef_topk_exact_bytes` on the
    exact one.
    """
    check_flat("x", x, GRADIENT_DTYPES)
    if threshold is not None and not (isinstance(threshold, torch.Tensor) and threshold.dim() == 0
                                      and threshold.dtype == torch.float32
                                      and threshold.device == x.device):
        raise ValueError(f"threshold must be None or a 0-d float32 tensor on {x.device}, got "
                         f"{threshold!r}")
    if residual is not None:
        check_flat("residual", residual, (torch.float32,), x.device)
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}")
    if n >= 2**31:
        raise ValueError(f"top-k indices are int32: x must have fewer than 2^31 elements, got {n}")
    exact = threshold is None
    capacity = n if exact else candidate_capacity(n, k)
    magnitudes = torch.empty(capacity, dtype=torch.float32, device=x.device)
    counter = torch.zeros(2, dtype=torch.int32, device=x.device)
    # the exact path keeps no candidate indices: the counter stands in for the unused pointer
    cand = counter if exact else torch.empty(capacity, dtype=torch.int32, device=x.device)
    x_arg, x_bf16 = kernel_view(x.reshape(-1))
    flat_res = residual.reshape(-1) if residual is not None else None
    has_res = flat_res is not None
    if n:
        topk_candidates_kernel[elementwise_grid(n)](
            x_arg, flat_res if has_res else x_arg, magnitudes, cand, counter, n, size_class(n),
            magnitudes if exact else threshold, capacity, HAS_RESIDUAL=has_res, X_BF16=x_bf16,
            DENSE=exact, **EXACT)
    if exact:  # every |c| is in magnitudes: nothing is read back
        direct = True
        best = torch.topk(magnitudes, k, sorted=False).indices
    else:  # one 8-byte host read: the candidate count sizes the candidates' top-k and picks the path
        count, _ = counter.tolist()
        direct = not k <= count <= capacity
        if direct:  # threshold too high or too low: the residual (or x) holds every corrected value
            every = flat_res if has_res else x.reshape(-1)
            best = torch.topk(every.float().abs(), k, sorted=False).indices
        else:
            best = torch.topk(magnitudes[:count], k, sorted=False).indices
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    indices = torch.empty(k, dtype=torch.int32, device=x.device)
    if k:
        values_arg, _ = kernel_view(values)
        topk_gather_kernel[elementwise_grid(k)](best, cand, flat_res if has_res else x_arg,
                                                flat_res if has_res else x_arg, values_arg, indices,
                                                k, size_class(k), DIRECT=direct,
                                                HAS_RESIDUAL=has_res, X_BF16=x_bf16, **EXACT)
    if has_res and n:  # a NaN/inf gradient is never carried (a pass only when there was one)
        zero_nonfinite_kernel[elementwise_grid(n)](flat_res, counter, n, size_class(n), **EXACT)
    return values, indices


def scatter_add_sum(values: torch.Tensor, indices: torch.Tensor, n: int,
                    dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """values [world, k], indices int32 [world, k] (rows may be strided) -> [n] of ``dtype`` (or
    written into ``out``): zeros plus every rank's values at their indices (fp32 atomics: on GPUs the order of additions to one index
    varies, so sums of several ranks agree with torch to fp32 rounding). Global memory:
    :func:`scatter_add_sum_bytes`."""
    check_flat("values", values, GRADIENT_DTYPES, rows=True)
    check_flat("indices", indices, (torch.int32,), values.device, rows=True)
    if values.shape != indices.shape:
        raise ValueError(f"values {list(values.shape)} and indices {list(indices.shape)} differ")
    target = decode_target(n, dtype, out, values.device)
    acc = target.zero_() if target.dtype == torch.float32 else torch.zeros(n, device=values.device)
    world, k = values.shape
    if world and k:
        v_arg, v_bf16 = kernel_view(values)
        scatter_add_kernel[scatter_add_grid(k, world)](v_arg, indices, acc, k, size_class(k),
                                                      values.stride(0), indices.stride(0),
                                                      V_BF16=v_bf16, **EXACT)
    if acc is not target:
        target.copy_(acc)
    return target


def ef_topk_bytes(n: int, k: int, candidates: int, x_itemsize: int, has_residual: bool,
                  block: int) -> int:
    """Declared global-memory bytes of :func:`ef_topk` on its one-pass path (finite input).

    Candidate pass: read x; with error feedback read the residual and write c into it; 8 bytes
    (|c|, index) per candidate; per program of ``block`` elements, the threshold (4) and two
    atomics (one without non-finite values: 8 bytes). torch.topk among the candidates: read 4 per candidate, write
    12 per chosen (fp32 value, int64 index), plus reading the 2-int counter. Gather: read the
    chosen index (8), its candidate index (4) and c (4), write the value (itemsize) and index (4),
    and with error feedback read the value back and write the residual there (itemsize + 4).
    With error feedback, the non-finite zeroing reads the non-finite count once per program.
    """
    programs = triton.cdiv(n, block)
    stream = n * (x_itemsize + (8 if has_residual else 0)) + 8 * candidates + 12 * programs
    select = 4 * candidates + 12 * k + 8
    gather = k * (8 + 4 + 4 + x_itemsize + 4) + (k * (x_itemsize + 4) if has_residual else 0)
    zeroing = 4 * programs if has_residual else 0
    return stream + select + gather + zeroing


def ef_topk_exact_bytes(n: int, k: int, x_itemsize: int, has_residual: bool, block: int) -> int:
    """Declared global-memory bytes of :func:`ef_topk` on its exact path (threshold None; finite
    input). Dense pass: read x; with error feedback read the residual and write c into it; write
    |c| (4); the 2-int counter zeroed (8). torch.topk over the n magnitudes: read 4 per element,
    write 12 per chosen. Gather
    (direct): read the chosen index (8) and c (4), write the value (itemsize) and index (4), and
    with error feedback read the value back and write the residual there (itemsize + 4). With
    error feedback, the non-finite zeroing reads the non-finite count once per program."""
    programs = triton.cdiv(n, block)
    stream = n * (x_itemsize + (8 if has_residual else 0) + 4)
    select = 8 + 4 * n + 12 * k
    gather = k * (8 + 4 + x_itemsize + 4) + (k * (x_itemsize + 4) if has_residual else 0)
    zeroing = 4 * programs if has_residual else 0
    return stream + select + gather + zeroing


def scatter_add_sum_bytes(n: int, k: int, world: int, value_itemsize: int,
                          out_itemsize: int) -> int:
    """Declared global-memory bytes of :func:`scatter_add_sum`: zero the fp32 output, read each
    rank's values and indices, one fp32 read-modify-write per entry, and a final cast when the
    output is not fp32."""
    cast = n * (4 + out_itemsize) if out_itemsize != 4 else 0
    return 4 * n + world * k * (value_itemsize + 4 + 8) + cast


def compile_cases() -> list[CompileCase]:
    """Shipped configs of the four kernels for fp32 gradients."""
    cases = []
    for config in CONFIGS:
        block, warps = config.kwargs["BLOCK"], config.num_warps
        tag = f"BLOCK={block},warps={warps}"
        for dense in (False, True):
            cases.append(CompileCase(
                f"topk_candidates[{tag}{',dense' if dense else ''}]", jit_function(topk_candidates_kernel),
                {"x_ptr": "*fp32", "res_ptr": "*fp32", "magnitudes_ptr": "*fp32", "indices_ptr": "*i32",
                 "counter_ptr": "*i32", "n": "i32", "n_class": "i32", "threshold_ptr": "*fp32",
                 "capacity": "i32", "HAS_RESIDUAL": "constexpr", "X_BF16": "constexpr",
                 "DENSE": "constexpr", "BLOCK": "constexpr"},
                {"HAS_RESIDUAL": True, "X_BF16": False, "DENSE": dense, "BLOCK": block},
                warps, aligned=("x_ptr", "res_ptr", "magnitudes_ptr", "indices_ptr", "n"),
                wide=(WIDE_LOADS, WIDE_STORES)))
        cases.append(CompileCase(
            f"topk_gather[{tag}]", jit_function(topk_gather_kernel),
            {"best_ptr": "*i64", "cand_ptr": "*i32", "source_ptr": "*fp32", "res_ptr": "*fp32",
             "values_ptr": "*fp32", "indices_ptr": "*i32", "k": "i32", "k_class": "i32",
             "DIRECT": "constexpr",
             "HAS_RESIDUAL": "constexpr", "X_BF16": "constexpr", "BLOCK": "constexpr"},
            {"DIRECT": False, "HAS_RESIDUAL": True, "X_BF16": False, "BLOCK": block},
            warps, aligned=("best_ptr", "cand_ptr", "source_ptr", "res_ptr", "values_ptr",
                            "indices_ptr", "k")))
        cases.append(CompileCase(
            f"zero_nonfinite[{tag}]", jit_function(zero_nonfinite_kernel),
            {"res_ptr": "*fp32", "counter_ptr": "*i32", "n": "i32", "n_class": "i32",
             "BLOCK": "constexpr"},
            {"BLOCK": block}, warps, aligned=("res_ptr", "n"), wide=(WIDE_LOADS,)))
        cases.append(CompileCase(
            f"scatter_add[{tag}]", jit_function(scatter_add_kernel),
            {"values_ptr": "*fp32", "indices_ptr": "*i32", "out_ptr": "*fp32", "k": "i32",
             "k_class": "i32", "values_row": "i32", "indices_row": "i32", "V_BF16": "constexpr",
             "BLOCK": "constexpr"},
            {"V_BF16": False, "BLOCK": block},
            warps, aligned=("values_ptr", "indices_ptr", "out_ptr", "k", "values_row", "indices_row"),
            wide=(WIDE_LOADS,)))
    return cases
