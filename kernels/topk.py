"""top-k kernels: one pass that adds the residual, keeps every element at or above a magnitude
threshold as a candidate (|value| + int32 index, compacted through an atomic counter and a prefix
sum) and leaves the corrected values in the residual; the top k of the fixed-size candidate
buffer (torch.topk over it); a gather that writes the payload and settles the residual at the k
chosen positions; and a scatter-add decompress of all ranks' payloads.

The threshold comes from the caller as a 0-d device tensor (gradcomp.methods.topk estimates it
from a seeded sample, aimed low so that at least k elements pass; it never goes to the host), or
None for the exact top-k (the pass then writes every |c| into an n-element buffer, no threshold
and no compaction, and torch.topk over it picks the k: no host read, no separate |c| pass). The
candidate pass writes c = x * prescale + r (``Method.compress``'s scale, the product rounded to
fp32 first) into the residual everywhere; only the k sent positions change afterwards (c - sent, 0 where not finite),
so the residual update costs O(k), not another pass. Non-finite elements always pass the
threshold and are counted; when there are any, one more pass zeroes them in the residual (a
kernel that reads the count on the device: without any, each of its programs reads 4 bytes and
stops; the count is never read back for it).

Nothing is read back to the host on either path. The threshold path's candidate buffer has a
fixed size: :func:`candidate_capacity` (2k + 4096, at most n) slots for finite candidates, then k
for non-finite ones (their own counter, so a NaN or inf always finds a slot, up to k), all filled
with -1 before the pass: slots no candidate wrote sort below every real |c| (>= 0) and every NaN
(torch.topk orders NaN above everything), so torch.topk over the whole buffer takes real
candidates first, and the gather tells the written slots by the counts it reads on the device. Two rare cases (the sampled
threshold is aimed ~3 standard errors low) differ from the torch path, which decides on the host
and then takes the exact top k of all of c:
- fewer than k pass (count < k): the payload holds every candidate plus k - count fillers, value
  0 at index 0 (decoding is a scatter-add: a filler adds 0, however many share index 0); the
  residual keeps c at every unsent position, so error feedback carries the elements the exact
  top k would have sent (residual + decoded payload = x + old residual, except that non-finite
  values are sent and zeroed in the residual).
- more finite candidates than the buffer holds (count > capacity): it keeps the first
  ``capacity`` in atomic order and the k largest of those, after every non-finite value, are
  sent (k distinct indices, every one at or above the threshold, not necessarily the k largest
  of all); the rest stay in the residual.
Otherwise (k <= count <= capacity) the result is the torch path's set up to ties among equal
magnitudes. The result always has exactly k entries, in the order torch.topk returns them among
the buffer (candidates arrive in the order of the atomics: ascending under the interpreter,
varying on GPUs; decoding does not depend on it).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .common import (EXACT, GRADIENT_DTYPES, WIDE_LOADS, WIDE_STORES, CompileCase, check_flat,
                     decode_target, is_finite, jit_function, kernel_view, load_f32, load_scaled_f32,
                     size_class, store_f32, tuned)

CONFIGS = [triton.Config({"BLOCK": 2048}, num_warps=4), triton.Config({"BLOCK": 4096}, num_warps=8)]
CPU_CONFIG = triton.Config({"BLOCK": 32768})
MIN_CAPACITY = 4096


@tuned(CONFIGS, CPU_CONFIG, key=["n_class"], restore=("res_ptr",), reset=("counter_ptr",))
@triton.jit
def topk_candidates_kernel(x_ptr, res_ptr, magnitudes_ptr, indices_ptr, counter_ptr, n, n_class,
                           prescale, threshold_ptr, capacity, reserve, HAS_RESIDUAL: tl.constexpr,
                           X_BF16: tl.constexpr, DENSE: tl.constexpr, BLOCK: tl.constexpr):
    """c = x * prescale + res (the product rounded first); res <- c; count the non-finite c in counter[1]. Threshold pass: append
    (|c|, i) for every finite |c| >= threshold at slot counter[0] of the first ``capacity``
    slots, and every non-finite c at slot counter[1] of the ``reserve`` slots after them (so a
    NaN or inf always finds a slot, up to ``reserve``, however many finite ones overflow); the
    threshold is read from device memory (the sampled one is never read back to the host).
    DENSE (the exact top-k): magnitudes[i] = |c| for every i instead (n slots; no threshold, no
    compaction). ``n_class`` (common.size_class(n)) only keys autotuning."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = load_scaled_f32(x_ptr, offs, mask, prescale, X_BF16)
    if HAS_RESIDUAL:
        c += tl.load(res_ptr + offs, mask=mask, other=0.0)
        tl.store(res_ptr + offs, c, mask=mask)
    magnitude = tl.abs(c)
    finite = is_finite(c)
    bad_i = (mask & ~finite).to(tl.int32)
    nonfinite = tl.sum(bad_i, axis=0)
    bad_base = tl.atomic_add(counter_ptr + 1, nonfinite, mask=nonfinite > 0, sem="relaxed")
    if DENSE:
        tl.store(magnitudes_ptr + offs, magnitude, mask=mask)
    else:
        threshold = tl.load(threshold_ptr)
        keep_i = (mask & finite & (magnitude >= threshold)).to(tl.int32)
        base = tl.atomic_add(counter_ptr, tl.sum(keep_i, axis=0), sem="relaxed")
        slot = base + tl.cumsum(keep_i, axis=0) - 1
        store = (keep_i != 0) & (slot < capacity)
        tl.store(magnitudes_ptr + slot, magnitude, mask=store)
        tl.store(indices_ptr + slot, offs.to(tl.int32), mask=store)
        if nonfinite > 0:
            bad_slot = bad_base + tl.cumsum(bad_i, axis=0) - 1
            bad_store = (bad_i != 0) & (bad_slot < reserve)
            tl.store(magnitudes_ptr + capacity + bad_slot, magnitude, mask=bad_store)
            tl.store(indices_ptr + capacity + bad_slot, offs.to(tl.int32), mask=bad_store)


@tuned(CONFIGS, CPU_CONFIG, key=["k_class"], restore=("res_ptr",))
@triton.jit
def topk_gather_kernel(best_ptr, cand_ptr, counter_ptr, source_ptr, res_ptr, values_ptr, indices_ptr,
                       k, k_class, capacity, prescale, DIRECT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                       X_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """For j < k: i = cand[best[j]] (or best[j] when DIRECT); values[j] = c[i] in x's dtype,
    indices[j] = i; res[i] = c[i] - values[j], 0 where not finite. c is read from the residual
    (which holds it) or, without error feedback, from x (source) times ``prescale``. Not DIRECT, a chosen slot that
    no candidate wrote (slot s < capacity with s >= counter[0], or capacity + s with
    s >= counter[1]: the counts, read on the device) is a filler: values[j] = 0, indices[j] = 0,
    the residual untouched. ``k_class`` (common.size_class(k)) only keys autotuning."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_k = offs < k
    mask = in_k
    chosen = tl.load(best_ptr + offs, mask=mask, other=0)
    if not DIRECT:  # the written slots: the filler lanes drop out of every load and store below
        mask &= tl.where(chosen < capacity, chosen < tl.load(counter_ptr),
                         chosen - capacity < tl.load(counter_ptr + 1))
        chosen = tl.load(cand_ptr + chosen, mask=mask, other=0).to(tl.int64)
    if HAS_RESIDUAL:
        c = load_f32(source_ptr, chosen, mask, False)
    else:
        c = load_scaled_f32(source_ptr, chosen, mask, prescale, X_BF16)
    store_f32(values_ptr, offs, c, in_k, X_BF16)  # filler lanes: c and chosen are 0 (masked loads)
    tl.store(indices_ptr + offs, chosen.to(tl.int32), mask=in_k)
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


def ef_topk(x: torch.Tensor, residual: torch.Tensor | None, k: int, threshold: torch.Tensor | None,
            prescale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n] (+ residual fp32 [n], updated in place) -> (values [k] in x's dtype, indices int32
    [k]): the k largest |c|, c = x * prescale + residual (the product rounded to fp32 first; NaN
    first; the threshold path's rare exceptions below).

    threshold: None for the exact top-k, or a 0-d fp32 tensor on x's device: elements below it
        are skipped by the candidate pass; if fewer than k or more than
        :func:`candidate_capacity` pass, the result is not the exact top k (fillers of value 0 at
        index 0, or the top k of the first ``capacity`` candidates: see the module doc).
    Nothing is read back to the host. Global memory: :func:`ef_topk_bytes` on the threshold path
    (k <= candidates <= capacity), :func:`ef_topk_exact_bytes` on the exact one.
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
    slots = n if exact else capacity + k  # threshold path: k more slots for non-finite values
    # threshold path: unwritten slots keep -1, below every |c| (>= 0) and every NaN (torch.topk
    # orders NaN above everything), so the top k of the whole buffer take every candidate first
    magnitudes = (torch.empty(slots, dtype=torch.float32, device=x.device) if exact
                  else torch.full((slots,), -1.0, dtype=torch.float32, device=x.device))
    counter = torch.zeros(2, dtype=torch.int32, device=x.device)
    # the exact path keeps no candidate indices: the counter stands in for the unused pointer
    cand = counter if exact else torch.empty(slots, dtype=torch.int32, device=x.device)
    x_arg, x_bf16 = kernel_view(x.reshape(-1))
    flat_res = residual.reshape(-1) if residual is not None else None
    has_res = flat_res is not None
    if n:
        topk_candidates_kernel[elementwise_grid(n)](
            x_arg, flat_res if has_res else x_arg, magnitudes, cand, counter, n, size_class(n),
            prescale, magnitudes if exact else threshold, capacity, k, HAS_RESIDUAL=has_res, X_BF16=x_bf16,
            DENSE=exact, **EXACT)
    # nothing is read back: the exact path's buffer holds every |c|, the threshold path's has a
    # fixed size (the gather tells the written slots from the rest by the count on the device)
    best = torch.topk(magnitudes, k, sorted=False).indices
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    indices = torch.empty(k, dtype=torch.int32, device=x.device)
    if k:
        values_arg, _ = kernel_view(values)
        topk_gather_kernel[elementwise_grid(k)](best, cand, counter, flat_res if has_res else x_arg,
                                                flat_res if has_res else x_arg, values_arg, indices,
                                                k, size_class(k), capacity, prescale, DIRECT=exact,
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
    """Declared global-memory bytes of :func:`ef_topk` on its threshold path, for ``candidates``
    passing the threshold, k <= candidates <= :func:`candidate_capacity` (finite input).

    Before the candidate pass, the magnitude buffer (capacity + k slots: the candidates', then
    the non-finite values') filled with -1 (4 per slot) and the 2-int counter zeroed (8).
    Candidate pass: read x; with error feedback read the residual and write c into it; 8 bytes
    (|c|, index) per candidate; per program of ``block`` elements, the threshold (4) and two
    atomics (one without non-finite values: 8 bytes). torch.topk over the whole buffer: read 4
    per slot, write 12 per chosen (fp32 value, int64 index). Gather: per program of ``block``
    the two counts (8); read the chosen slot (8), its candidate index (4) and c (4), write the
    value (itemsize) and index (4), and with error feedback read the value back and write the
    residual there (itemsize + 4). With error feedback, the non-finite zeroing reads the
    non-finite count once per program.
    """
    programs = triton.cdiv(n, block)
    slots = candidate_capacity(n, k) + k
    stream = n * (x_itemsize + (8 if has_residual else 0)) + 8 * candidates + 12 * programs
    select = 4 * slots + 8 + 4 * slots + 12 * k
    gather = (8 * triton.cdiv(k, block) + k * (8 + 4 + 4 + x_itemsize + 4)
              + (k * (x_itemsize + 4) if has_residual else 0))
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
                 "counter_ptr": "*i32", "n": "i32", "n_class": "i32", "prescale": "fp32",
                 "threshold_ptr": "*fp32",
                 "capacity": "i32", "reserve": "i32", "HAS_RESIDUAL": "constexpr",
                 "X_BF16": "constexpr", "DENSE": "constexpr", "BLOCK": "constexpr"},
                {"HAS_RESIDUAL": True, "X_BF16": False, "DENSE": dense, "BLOCK": block},
                warps, aligned=("x_ptr", "res_ptr", "magnitudes_ptr", "indices_ptr", "n"),
                wide=(WIDE_LOADS, WIDE_STORES)))
        cases.append(CompileCase(
            f"topk_gather[{tag}]", jit_function(topk_gather_kernel),
            {"best_ptr": "*i64", "cand_ptr": "*i32", "counter_ptr": "*i32", "source_ptr": "*fp32",
             "res_ptr": "*fp32", "values_ptr": "*fp32", "indices_ptr": "*i32", "k": "i32",
             "k_class": "i32", "capacity": "i32", "prescale": "fp32", "DIRECT": "constexpr",
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
