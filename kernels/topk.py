"""top-k kernels: one pass that adds the residual, keeps every element at or above a magnitude
threshold as a candidate (|value| + int32 index, compacted through an atomic counter and a prefix
sum) and leaves the corrected values in the residual; the top k of the fixed-size candidate
buffer (torch.topk over it), sorted by index; a gather that writes the payload and settles the
residual at the k chosen positions; and a decode-sum of all ranks' payloads.

Decode-sum (:func:`scatter_add_sum`): a check of every rank's indices (strictly increasing within
[0, n): a flag per rank) that also records where each rank's entries cross every DECODE_TILE
boundary of the output, then one program per output tile that writes the start (zeros or the scaled addend)
and adds every checked rank's entries of its tile, rank by rank in row order, with plain loads and
stores (no atomics: the sum is deterministic, bit for bit the torch path's row-order
scatter-add). A rank whose check failed (corrupt or hostile bytes, or a payload with fillers) is
added afterwards by fp32 atomics, entries outside [0, n) dropped and counted.

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
magnitudes. The result always has exactly k entries, in ascending index order (the chosen
indices are sorted before the gather writes the payload; fillers, index 0, first): the decode
below relies on it.

``exact`` (the exact selector's path: a sampled threshold, then these kernels) removes both
exceptions without a host read or a data-dependent launch. The candidates hold the exact top k
exactly when count <= capacity, non-finite <= k and finite + non-finite >= k (every element
left out is below every finite candidate); every kernel below reads the two counts (8 bytes
per program) and stops when they do. Otherwise (the fallback) a radix select over c (the
residual holds it; without one, x * prescale recomputed, the same rounding) finds the exact
k-th largest magnitude: the int32 key of |c| (its fp32 bits without the sign, which order like
the value for non-negative floats; inf above every finite value, NaN above inf, as torch.topk
ranks them) is counted by its top 15 bits (bits 30..16) into 2^15 buckets (atomics), a
one-program scan finds the boundary bucket B (the highest whose bucket and those above hold at
least k keys) and the count above it, a second histogram counts the low 16 bits of the keys in
B, a second scan gives the exact k-th largest key T and the count G of keys above it (G < k,
and at least k - G keys equal T). A compaction then writes every index with key > T (G of
them) and the first k - G with key == T (atomic order) into a k-slot buffer that the gather
reads instead of the candidates: exactly k, the exact top k up to ties among equal magnitudes,
every non-finite value among them when there are at most k (the largest keys). The residual
semantics are the threshold path's (c - sent at the k sent, c elsewhere, non-finite zeroed).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .common import (EXACT, GRADIENT_DTYPES, WIDE_LOADS, WIDE_STORES, CompileCase, check_addend,
                     check_flat, decode_target, is_finite, jit_function, kernel_view, load_f32, load_scaled_f32,
                     size_class, store_f32, tuned)
from .declared import DECODE_TILE, HIGH_BUCKETS, LOW_BUCKETS, TOPK_TILES, candidate_capacity, decode_chunk

CONFIGS = [triton.Config({"BLOCK": block}, num_warps=warps) for block, warps in TOPK_TILES]
CPU_CONFIG = triton.Config({"BLOCK": 32768})
ROWS_CONFIG = triton.Config({"BLOCK": TOPK_TILES[0][0]}, num_warps=TOPK_TILES[0][1])
"""The one config of the decode's index check and atomic fallback (their declared
bytes depend on the block: :func:`.declared.scatter_add_sum_bytes`)."""
DECODE_CONFIGS = [triton.Config({"BLOCK": DECODE_TILE}, num_warps=warps) for warps in (4, 8)]
DECODE_CPU_CONFIG = triton.Config({"BLOCK": DECODE_TILE})
"""The tile decode's configs: every one owns DECODE_TILE outputs per program (the bounds search
splits the indices at that tile)."""
DECODE_PART = 2048
"""Outputs per step of the tile decode's start."""


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


@triton.jit
def fast_path_missed(finite, nonfinite, k, capacity):
    """Whether the threshold pass's candidates do not hold the exact top k, from its two counts
    (read on the device): more finite candidates than the buffer's ``capacity``, more
    non-finite values than their k slots, or fewer than k candidates in all."""
    return (finite > capacity) | (nonfinite > k) | (finite + nonfinite < k)


@triton.jit
def load_corrected(source_ptr, offs, mask, prescale, FROM_X: tl.constexpr, X_BF16: tl.constexpr):
    """c at ``offs``: from the residual the candidate pass wrote it into, or (FROM_X: no
    residual) recomputed as x * prescale, the same rounding as that pass."""
    if FROM_X:
        return load_scaled_f32(source_ptr, offs, mask, prescale, X_BF16)
    return tl.load(source_ptr + offs, mask=mask, other=0.0)


@triton.jit
def magnitude_key(c):
    """The int32 ordering key of |c|: its fp32 bits without the sign (for non-negative floats the
    bit pattern orders like the value; inf above every finite value, every NaN above inf)."""
    return c.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@tuned(CONFIGS, CPU_CONFIG, key=["k_class"])
@triton.jit
def topk_chosen_kernel(best_ptr, cand_ptr, counter_ptr, fallback_ptr, chosen_ptr, k, k_class,
                       capacity, EXACT_FALLBACK: tl.constexpr, BLOCK: tl.constexpr):
    """For j < k: chosen[j] = cand[best[j]] (the threshold path's int32 element index of the
    candidate in the slot torch.topk chose). A chosen slot that no candidate wrote (slot s <
    capacity with s >= counter[0], or capacity + s with s >= counter[1]: the counts, read on the
    device) is a filler: chosen[j] = -1. EXACT_FALLBACK: when the counts say the candidates missed the exact top k
    (:func:`fast_path_missed`), chosen[j] = fallback[j] instead (the radix select's k, no
    fillers). ``k_class`` (common.size_class(k)) only keys autotuning."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < k
    finite, nonfinite = tl.load(counter_ptr), tl.load(counter_ptr + 1)
    missed = False
    if EXACT_FALLBACK:
        missed = fast_path_missed(finite, nonfinite, k, capacity)
    if missed:
        chosen = tl.load(fallback_ptr + offs, mask=mask, other=0)
    else:  # the written slots; the filler lanes read nothing
        slot = tl.load(best_ptr + offs, mask=mask, other=0)
        written = mask & tl.where(slot < capacity, slot < finite, slot - capacity < nonfinite)
        chosen = tl.load(cand_ptr + slot, mask=written, other=-1)
    tl.store(chosen_ptr + offs, chosen, mask=mask)


@tuned(CONFIGS, CPU_CONFIG, key=["k_class"], restore=("res_ptr",))
@triton.jit
def topk_gather_kernel(sorted_ptr, source_ptr, res_ptr, values_ptr, indices_ptr, k, k_class,
                       prescale, HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr,
                       BLOCK: tl.constexpr):
    """For j < k, i = sorted[j] (the chosen element indices in ascending order, int32 or int64,
    fillers -1 first): values[j] = c[i] in x's dtype, indices[j] = i; res[i] = c[i] - values[j], 0 where
    not finite. c is read from the residual (which holds it) or, without error feedback, from x
    (source) times ``prescale``. A filler (i = -1) sends value 0 at index 0 and touches no
    residual. ``k_class`` (common.size_class(k)) only keys autotuning."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_k = offs < k
    chosen = tl.load(sorted_ptr + offs, mask=in_k, other=0)
    mask = in_k & (chosen >= 0)
    chosen = tl.maximum(chosen, 0).to(tl.int64)
    if HAS_RESIDUAL:
        c = load_f32(source_ptr, chosen, mask, False)
    else:
        c = load_scaled_f32(source_ptr, chosen, mask, prescale, X_BF16)
    store_f32(values_ptr, offs, c, in_k, X_BF16)  # filler lanes: c is 0 (masked loads)
    tl.store(indices_ptr + offs, chosen.to(tl.int32), mask=in_k)
    if HAS_RESIDUAL:
        sent = load_f32(values_ptr, offs, mask, X_BF16)
        diff = c - sent
        tl.store(res_ptr + chosen, tl.where(is_finite(diff), diff, 0.0), mask=mask)


HIGH_SPAN: tl.constexpr = tl.constexpr(HIGH_BUCKETS)
LOW_SPAN: tl.constexpr = tl.constexpr(LOW_BUCKETS)
"""The radix select's two histogram sizes (declared.HIGH_BUCKETS, LOW_BUCKETS) as the kernels read
them (globals a kernel reads must be constexpr)."""
SCAN_CHUNK = 4096
"""Buckets per step of the one-program scans."""


@tuned(CONFIGS, CPU_CONFIG, key=["k_class"])
@triton.jit
def topk_fallback_zero_kernel(hist_ptr, counter_ptr, k, k_class, capacity, size,
                              BLOCK: tl.constexpr):
    """hist[:size] <- 0, only when the candidates missed the exact top k (each program reads the
    two counts, 8 bytes, and otherwise stops). ``k_class`` only keys autotuning."""
    if fast_path_missed(tl.load(counter_ptr), tl.load(counter_ptr + 1), k, capacity):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(hist_ptr + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=offs < size)


@tuned(CONFIGS, CPU_CONFIG, key=["n_class"], reset=("hist_ptr",))
@triton.jit
def topk_radix_hist_kernel(source_ptr, hist_ptr, counter_ptr, n, n_class, k, capacity, prescale,
                           LOW: tl.constexpr, FROM_X: tl.constexpr, X_BF16: tl.constexpr,
                           BLOCK: tl.constexpr):
    """Only when the candidates missed the exact top k (otherwise each program reads the two
    counts and stops): count the magnitude keys of c (:func:`magnitude_key`) by their bits
    30..16 into hist[0 : 2^15] (not LOW), or (LOW) by their bits 15..0 into
    hist[2^15 : 2^15 + 2^16], only the keys whose top bits are the boundary bucket
    counter[4] (the high scan's). ``n_class`` only keys autotuning."""
    if fast_path_missed(tl.load(counter_ptr), tl.load(counter_ptr + 1), k, capacity):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        key = magnitude_key(load_corrected(source_ptr, offs, mask, prescale, FROM_X, X_BF16))
        if LOW:
            mask &= (key >> 16) == tl.load(counter_ptr + 4)
            tl.atomic_add(hist_ptr + HIGH_SPAN + (key & 0xFFFF), 1, mask=mask, sem="relaxed")
        else:
            tl.atomic_add(hist_ptr + (key >> 16), 1, mask=mask, sem="relaxed")


@triton.jit
def boundary_bucket(hist_ptr, need, BUCKETS: tl.constexpr, CHUNK: tl.constexpr):
    """(b, above): the largest bucket b with sum(hist[b:]) >= need (need >= 1, reached by the
    whole histogram), and sum(hist[b + 1:]), scanning chunks from the top."""
    acc = 0
    found = -1
    above = 0
    for i in tl.static_range(BUCKETS // CHUNK):  # unrolled: every offset a constant
        b = BUCKETS - (i + 1) * CHUNK + tl.arange(0, CHUNK)
        h = tl.load(hist_ptr + b)
        reach = acc + tl.cumsum(h, 0, reverse=True)  # elements in buckets >= b
        here = tl.max(tl.where(reach >= need, b, -1), axis=0)
        first = (found < 0) & (here >= 0)
        above = tl.where(first, tl.sum(tl.where(b == here, reach - h, 0), axis=0), above)
        found = tl.where(first, here, found)
        acc += tl.sum(h, axis=0)
    return found, above


SCAN_CONFIG = triton.Config({}, num_warps=4)
"""The one config of the one-program scans (their loads: CHUNK buckets at a time)."""


@tuned([SCAN_CONFIG], triton.Config({}), key=["k_class"])
@triton.jit
def topk_radix_scan_kernel(hist_ptr, counter_ptr, k, k_class, capacity, LOW: tl.constexpr,
                           CHUNK: tl.constexpr):
    """One program, only when the candidates missed the exact top k (otherwise it reads the two
    counts and stops). Not LOW: the boundary bucket B of the top-bits histogram (the largest
    whose bucket and those above hold >= k keys) -> counter[4], the keys above it -> counter[5],
    and the low histogram zeroed. LOW: within B, the boundary b of the low histogram for the
    k - counter[5] keys still needed: the exact k-th largest key T = (B << 16) | b ->
    counter[3], the keys above T -> counter[2] (fewer than k; at least k - counter[2] equal T).
    Each run writes the same from the same histograms (autotuning's trials repeat it)."""
    if fast_path_missed(tl.load(counter_ptr), tl.load(counter_ptr + 1), k, capacity):
        if LOW:
            high, above_high = tl.load(counter_ptr + 4), tl.load(counter_ptr + 5)
            low, above = boundary_bucket(hist_ptr + HIGH_SPAN, k - above_high, LOW_SPAN,
                                         CHUNK)
            tl.store(counter_ptr + 3, (high << 16) | low)
            tl.store(counter_ptr + 2, above_high + above)
        else:
            high, above = boundary_bucket(hist_ptr, k, HIGH_SPAN, CHUNK)
            tl.store(counter_ptr + 4, high)
            tl.store(counter_ptr + 5, above)
            for i in tl.static_range(LOW_SPAN // CHUNK):
                tl.store(hist_ptr + HIGH_SPAN + i * CHUNK + tl.arange(0, CHUNK),
                         tl.zeros([CHUNK], dtype=tl.int32))


@tuned(CONFIGS, CPU_CONFIG, key=["n_class"], reset=("fill_ptr",))
@triton.jit
def topk_fallback_compact_kernel(source_ptr, chosen_ptr, counter_ptr, fill_ptr, n, n_class, k, capacity,
                                 prescale, FROM_X: tl.constexpr, X_BF16: tl.constexpr,
                                 BLOCK: tl.constexpr):
    """Only when the candidates missed the exact top k (otherwise each program reads the two
    counts and stops): chosen[0 : G] <- every i with key(c_i) > T, through the atomic fill[0],
    and chosen[G : k] <- the first k - G (in atomic order) with key(c_i) == T, through
    fill[1] (T = counter[3], G = counter[2], from the low scan; fill starts at zero): exactly k
    indices, the exact top k up to ties among equal magnitudes. ``n_class`` only keys autotuning."""
    if fast_path_missed(tl.load(counter_ptr), tl.load(counter_ptr + 1), k, capacity):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        key = magnitude_key(load_corrected(source_ptr, offs, mask, prescale, FROM_X, X_BF16))
        boundary, above = tl.load(counter_ptr + 3), tl.load(counter_ptr + 2)
        over = (mask & (key > boundary)).to(tl.int32)
        over_count = tl.sum(over, axis=0)
        base = tl.atomic_add(fill_ptr, over_count, mask=over_count > 0, sem="relaxed")
        tl.store(chosen_ptr + base + tl.cumsum(over, axis=0) - 1, offs.to(tl.int32), mask=over != 0)
        tie = (mask & (key == boundary)).to(tl.int32)
        tie_count = tl.sum(tie, axis=0)
        tie_base = tl.atomic_add(fill_ptr + 1, tie_count, mask=tie_count > 0, sem="relaxed")
        slot = above + tie_base + tl.cumsum(tie, axis=0) - 1
        tl.store(chosen_ptr + slot, offs.to(tl.int32), mask=(tie != 0) & (slot < k))


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


@tuned([ROWS_CONFIG], ROWS_CONFIG, key=["k_class"], reset=("bad_ptr",))
@triton.jit
def topk_check_kernel(indices_ptr, bad_ptr, bounds_ptr, n, k, k_class, tiles, indices_row,
                      TILE: tl.constexpr, BLOCK: tl.constexpr):
    """Per rank w (row w of ``indices``, rows ``indices_row`` apart): bad[w] += the entries j
    that lie outside [0, n) or are not above entry j - 1, so bad[w] == 0 exactly when the rank's
    indices strictly increase within [0, n); and, from every block without such an entry,
    bounds[w, t] = j for each tile boundary t * TILE in (indices[w, j - 1], indices[w, j]]
    (entry -1 taken as -1; entry k covers every boundary above entry k - 1, up to t = tiles): for a rank with bad[w] == 0, bounds[w, t]
    (t in [0, tiles]) is the first j with indices[w, j] >= t * TILE, written once. Program i
    handles entries block i % blocks of rank i // blocks (blocks = cdiv(k + 1, BLOCK)); the
    entry before its block comes from one more load. ``k_class`` only keys autotuning."""
    program = tl.program_id(0)
    blocks = tl.cdiv(k + 1, BLOCK)
    rank = (program // blocks).to(tl.int64)
    first = (program % blocks).to(tl.int64) * BLOCK  # <= k
    lanes = tl.arange(0, BLOCK)
    j = first.to(tl.int32) + lanes  # int32: k + BLOCK < 2^31 (scatter_add_sum checks)
    entry = j < k
    row = indices_ptr + rank * indices_row
    cur = tl.load(row + j, mask=entry, other=n)  # entry k: n, above every valid index
    before = tl.load(row + first - 1, mask=first > 0, other=-1)
    prev = tl.where(lanes == 0, before, tl.gather(cur, tl.maximum(lanes - 1, 0), axis=0))
    bad = (entry & ((cur < 0) | (cur >= n) | (cur <= prev))).to(tl.int32)
    count = tl.sum(bad, axis=0)
    tl.atomic_add(bad_ptr + rank, count, mask=count > 0, sem="relaxed")
    if count == 0:  # -1 <= prev < cur <= n on every lane: boundaries (prev, cur]
        live = j <= k
        low = tl.where(prev < 0, 0, prev // TILE + 1)
        high = tl.where(entry, cur // TILE, tiles)  # entry k: every boundary left, up to tiles
        bounds_row = bounds_ptr + rank * (tiles + 1)
        for step in range(tl.max(tl.where(live, high - low + 1, 0), axis=0)):
            t = low + step
            tl.store(bounds_row + t, j, mask=live & (t <= high))


@tuned(DECODE_CONFIGS, DECODE_CPU_CONFIG, key=["n_class", "world"])
@triton.jit
def topk_decode_tile_kernel(values_ptr, indices_ptr, bounds_ptr, bad_ptr, addend_ptr, out_ptr, n,
                            n_class, world, tiles, values_row, indices_row, addend_scale,
                            HAS_ADDEND: tl.constexpr, ADDEND_BF16: tl.constexpr,
                            V_BF16: tl.constexpr, PART: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK: tl.constexpr):
    """Program t owns out[t * BLOCK : (t + 1) * BLOCK] (fp32): writes its start, fp32(addend) *
    fp32(addend_scale) (:func:`load_scaled_f32`; bf16 as int16 bits) or 0, PART elements at a
    time, then adds rank by rank, in row order, the values of every rank with bad[w] == 0 whose
    entries j in [bounds[w, t], bounds[w, t + 1]) fall in the tile (:func:`topk_check_kernel`), CHUNK at a time: plain loads
    and stores (the checked indices of one rank are distinct, and only this program touches the
    tile), a barrier between ranks. No atomics; the sum's order is fixed, so it is deterministic.
    ``n_class`` (common.size_class(n)) and ``world`` only key autotuning."""
    tile = tl.program_id(0).to(tl.int64)
    for part in tl.static_range(BLOCK // PART):
        offs = tile * BLOCK + part * PART + tl.arange(0, PART)
        mask = offs < n
        if HAS_ADDEND:
            start = load_scaled_f32(addend_ptr, offs, mask, addend_scale, ADDEND_BF16)
        else:
            start = tl.zeros([PART], dtype=tl.float32)
        tl.store(out_ptr + offs, start, mask=mask)
    tl.debug_barrier()
    # rank w's flag and bounds, loaded while the rank before it is added (rows by pointer steps:
    # 64-bit, whatever world * row)
    bounds_row, indices_at, values_at = bounds_ptr + tile, indices_ptr, values_ptr
    some = world > 0
    flag = tl.load(bad_ptr, mask=some, other=1)
    lo, hi = tl.load(bounds_row, mask=some, other=0), tl.load(bounds_row + 1, mask=some, other=0)
    for w in range(world):
        more = w + 1 < world
        next_flag = tl.load(bad_ptr + w + 1, mask=more, other=0)
        next_lo = tl.load(bounds_row + tiles + 1, mask=more, other=0)
        next_hi = tl.load(bounds_row + tiles + 2, mask=more, other=0)
        if flag == 0:
            for first in range(lo, hi, CHUNK):
                j = first + tl.arange(0, CHUNK)
                live = j < hi
                idx = tl.load(indices_at + j, mask=live, other=0)
                v = load_f32(values_at, j, live, V_BF16)
                total = tl.load(out_ptr + idx, mask=live, other=0.0) + v
                tl.store(out_ptr + idx, total, mask=live)
            tl.debug_barrier()
        flag, lo, hi = next_flag, next_lo, next_hi
        bounds_row += tiles + 1
        indices_at += indices_row
        values_at += values_row


@tuned([ROWS_CONFIG], ROWS_CONFIG, key=["k_class"], restore=("out_ptr", "dropped_ptr"))
@triton.jit
def scatter_add_kernel(values_ptr, indices_ptr, bad_ptr, out_ptr, dropped_ptr, n, k, k_class,
                       values_row, indices_row, V_BF16: tl.constexpr, COUNT: tl.constexpr,
                       BLOCK: tl.constexpr):
    """The ranks the tile decode skipped (bad[w] != 0: indices unsorted, repeated or outside the
    tensor; every other program reads bad[w], 4 bytes, and stops): out[indices[w, j]] +=
    values[w, j] (fp32 atomics, after the tile decode's sum) for the entries whose index lies in
    [0, n); the others (bytes from another process: corrupt or hostile) are never written
    through and, with COUNT, counted per rank into int64 ``dropped[w]`` (one atomic per program
    that saw any). Program i handles block i % blocks of rank i // blocks (blocks = cdiv(k,
    BLOCK)), all on grid axis 0; each rank's row starts ``*_row`` elements after the previous
    one. Autotuning restores ``out`` and ``dropped`` after each trial; ``k_class``
    (common.size_class(k)) only keys autotuning."""
    program = tl.program_id(0).to(tl.int64)
    blocks = tl.cdiv(k, BLOCK)
    rank = program // blocks
    if tl.load(bad_ptr + rank) != 0:
        offs = (program % blocks) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < k
        v = load_f32(values_ptr + rank * values_row, offs, mask, V_BF16)
        idx = tl.load(indices_ptr + rank * indices_row + offs, mask=mask, other=0)
        inside = mask & (idx >= 0) & (idx < n)
        tl.atomic_add(out_ptr + idx, v, mask=inside, sem="relaxed")
        if COUNT:
            outside = tl.sum((mask & ~inside).to(tl.int64), axis=0)
            tl.atomic_add(dropped_ptr + rank, outside, mask=outside > 0, sem="relaxed")


def elementwise_grid(n: int):
    """Grid of the candidate pass (n elements), the chosen indices and the gather (k), and the tile
    decode (n outputs): one program per BLOCK."""
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


def scatter_add_grid(k: int, world: int):
    """Grid of the decode's index check (k + 1 lanes per rank) and atomic fallback (k):
    cdiv(k, BLOCK) programs per rank, every rank on axis 0."""
    return lambda meta: (world * triton.cdiv(k, meta["BLOCK"]),)


def one_program_grid():
    """Grid of the radix select's scans: one program."""
    return lambda meta: (1,)


def ef_topk(x: torch.Tensor, residual: torch.Tensor | None, k: int, threshold: torch.Tensor | None,
            prescale: float = 1.0, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n] (+ residual fp32 [n], updated in place) -> (values [k] in x's dtype, indices int32
    [k]): the k largest |c|, c = x * prescale + residual (the product rounded to fp32 first; NaN
    first; the threshold path's rare exceptions below, unless ``exact``), indices ascending
    (fillers first).

    threshold: None for the exact top-k over a dense |c| buffer, or a 0-d fp32 tensor on x's
        device: elements below it are skipped by the candidate pass; if fewer than k or more
        than :func:`candidate_capacity` pass, the result is not the exact top k (fillers of
        value 0 at index 0, or the top k of the first ``capacity`` candidates: see the module
        doc) unless ``exact``.
    exact: with a threshold, the exact top k whatever the threshold: kernels that read the
        candidate counts on the device run a radix select over c when the candidates missed it
        (and otherwise stop at once); see the module doc.
    Nothing is read back to the host, and the launches do not depend on the data. Global
    memory: :func:`.declared.ef_topk_bytes` on the threshold path (k <= candidates <=
    capacity; plus :func:`.declared.ef_topk_fallback_bytes` where ``exact`` falls back),
    :func:`.declared.ef_topk_dense_bytes` without a threshold.
    """
    check_flat("x", x, GRADIENT_DTYPES)
    if threshold is not None and not (isinstance(threshold, torch.Tensor) and threshold.dim() == 0
                                      and threshold.dtype == torch.float32
                                      and threshold.device == x.device):
        raise ValueError(f"threshold must be None or a 0-d float32 tensor on {x.device}, got "
                         f"{threshold!r}")
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool, got {exact!r}")
    if residual is not None:
        check_flat("residual", residual, (torch.float32,), x.device)
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}")
    if n >= 2**31:
        raise ValueError(f"top-k indices are int32: x must have fewer than 2^31 elements, got {n}")
    dense = threshold is None
    fallback = exact and not dense and k > 0
    capacity = n if dense else candidate_capacity(n, k)
    slots = n if dense else capacity + k  # threshold path: k more slots for non-finite values
    # threshold path: unwritten slots keep -1, below every |c| (>= 0) and every NaN (torch.topk
    # orders NaN above everything), so the top k of the whole buffer take every candidate first
    magnitudes = (torch.empty(slots, dtype=torch.float32, device=x.device) if dense
                  else torch.full((slots,), -1.0, dtype=torch.float32, device=x.device))
    # [0] finite candidates, [1] non-finite; the radix select's (fallback): [2] keys above T,
    # [3] T, [4] boundary top bucket, [5] keys above it, [6:8] the compaction's two fills
    counter = torch.zeros(8 if fallback else 2, dtype=torch.int32, device=x.device)
    # the dense path keeps no candidate indices: the counter stands in for the unused pointer
    cand = counter if dense else torch.empty(slots, dtype=torch.int32, device=x.device)
    x_arg, x_bf16 = kernel_view(x.reshape(-1))
    flat_res = residual.reshape(-1) if residual is not None else None
    has_res = flat_res is not None
    if n:
        topk_candidates_kernel[elementwise_grid(n)](
            x_arg, flat_res if has_res else x_arg, magnitudes, cand, counter, n, size_class(n),
            prescale, magnitudes if dense else threshold, capacity, k, HAS_RESIDUAL=has_res, X_BF16=x_bf16,
            DENSE=dense, **EXACT)
    # nothing is read back: the dense path's buffer holds every |c|, the threshold path's has a
    # fixed size (the gather tells the written slots from the rest by the count on the device)
    best = torch.topk(magnitudes, k, sorted=False).indices
    chosen = counter  # stands in for the unused pointer without a fallback
    if fallback:  # launched every call; each program reads the counts and stops unless needed
        chosen = torch.empty(k, dtype=torch.int32, device=x.device)
        hist = torch.empty(HIGH_BUCKETS + LOW_BUCKETS, dtype=torch.int32, device=x.device)
        source = flat_res if has_res else x_arg
        k_class, n_class = size_class(k), size_class(n)
        topk_fallback_zero_kernel[elementwise_grid(HIGH_BUCKETS)](hist, counter, k, k_class, capacity,
                                                                  HIGH_BUCKETS, **EXACT)
        for low in (False, True):
            topk_radix_hist_kernel[elementwise_grid(n)](source, hist, counter, n, n_class, k,
                                                        capacity, prescale, LOW=low, FROM_X=not has_res,
                                                        X_BF16=x_bf16, **EXACT)
            topk_radix_scan_kernel[one_program_grid()](hist, counter, k, k_class, capacity, LOW=low,
                                                       CHUNK=SCAN_CHUNK, **EXACT)
        topk_fallback_compact_kernel[elementwise_grid(n)](source, chosen, counter, counter[6:], n,
                                                          n_class, k, capacity, prescale,
                                                          FROM_X=not has_res, X_BF16=x_bf16, **EXACT)
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    indices = torch.empty(k, dtype=torch.int32, device=x.device)
    if k:
        picked = best  # the dense path: torch.topk's int64 element indices
        if not dense:
            picked = torch.empty(k, dtype=torch.int32, device=x.device)
            topk_chosen_kernel[elementwise_grid(k)](best, cand, counter, chosen, picked, k,
                                                    size_class(k), capacity,
                                                    EXACT_FALLBACK=fallback, **EXACT)
        # the payload's indices ascend (fillers, -1 here, first): the tile decode relies on it
        ascending = torch.sort(picked).values
        values_arg, _ = kernel_view(values)
        topk_gather_kernel[elementwise_grid(k)](ascending, flat_res if has_res else x_arg,
                                                flat_res if has_res else x_arg, values_arg, indices,
                                                k, size_class(k), prescale, HAS_RESIDUAL=has_res,
                                                X_BF16=x_bf16, **EXACT)
    if has_res and n:  # a NaN/inf gradient is never carried (a pass only when there was one)
        zero_nonfinite_kernel[elementwise_grid(n)](flat_res, counter, n, size_class(n), **EXACT)
    return values, indices


def scatter_add_sum(values: torch.Tensor, indices: torch.Tensor, n: int,
                    dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
                    addend: torch.Tensor | None = None, addend_scale: float = 1.0,
                    dropped: torch.Tensor | None = None) -> torch.Tensor:
    """values [world, k], indices int32 [world, k] (rows may be strided) -> [n] of ``dtype`` (or
    written into ``out``): addend * addend_scale (the product rounded to fp32; ``addend`` a
    contiguous float tensor of n elements, any float dtype) or zeros, plus every rank's values at
    their indices. Ranks whose indices strictly ascend within [0, n) (what ``ef_topk`` and the
    torch path send) are added by the tile decode, rank by rank in row order without atomics:
    deterministic, bit for bit the torch path's row-order sum. Any other rank (corrupt or hostile
    bytes, fillers) is added after them by fp32 atomics (on GPUs the order of additions to one
    index varies: such sums agree with torch to fp32 rounding); its entries whose index is
    outside [0, n) are skipped and counted into ``dropped`` (int64 [world], on the device;
    None: not counted). The per-rank flags zeroed, then three kernels whatever the data (the
    check, the tile decode, the fallback, whose programs stop at once for checked ranks);
    nothing is read back.
    Global memory: :func:`.declared.scatter_add_sum_bytes`."""
    check_flat("values", values, GRADIENT_DTYPES, rows=True)
    check_flat("indices", indices, (torch.int32,), values.device, rows=True)
    if values.shape != indices.shape:
        raise ValueError(f"values {list(values.shape)} and indices {list(indices.shape)} differ")
    if dropped is not None:
        check_flat("dropped", dropped, (torch.int64,), values.device)
        if dropped.shape != (values.shape[0],):
            raise ValueError(f"dropped must be int64[{values.shape[0]}], got {list(dropped.shape)}")
    target = decode_target(n, dtype, out, values.device)
    a_arg, addend_bf16 = check_addend(addend, n, values.device)
    acc = target if target.dtype == torch.float32 else torch.empty(n, device=values.device)
    world, k = values.shape
    if k >= 2**31 - ROWS_CONFIG.kwargs["BLOCK"]:
        raise ValueError(f"top-k payloads must have fewer than 2^31 - {ROWS_CONFIG.kwargs['BLOCK']} "
                         f"entries per rank, got {k}")
    device = values.device
    tiles = triton.cdiv(n, DECODE_TILE)
    # bad[w]: rank w's entries outside [0, n) or not above the one before (0: sorted, distinct)
    bad = torch.zeros(world, dtype=torch.int32, device=device)
    bounds = torch.empty(world, tiles + 1, dtype=torch.int32, device=device)
    v_arg, v_bf16 = kernel_view(values)
    k_class = size_class(k)
    if world:
        topk_check_kernel[scatter_add_grid(k + 1, world)](indices, bad, bounds, n, k, k_class, tiles,
                                                          indices.stride(0), TILE=DECODE_TILE,
                                                          **EXACT)
    if n:
        topk_decode_tile_kernel[elementwise_grid(n)](
            v_arg, indices, bounds, bad, acc if a_arg is None else a_arg, acc, n, size_class(n),
            world, tiles, values.stride(0), indices.stride(0), float(addend_scale),
            HAS_ADDEND=a_arg is not None, ADDEND_BF16=addend_bf16, V_BF16=v_bf16, PART=DECODE_PART,
            CHUNK=decode_chunk(n, k), **EXACT)
    if world and k:
        scatter_add_kernel[scatter_add_grid(k, world)](v_arg, indices, bad, acc,
                                                      acc if dropped is None else dropped, n, k,
                                                      k_class, values.stride(0), indices.stride(0),
                                                      V_BF16=v_bf16, COUNT=dropped is not None, **EXACT)
    if acc is not target:
        target.copy_(acc)
    return target


def compile_cases() -> list[CompileCase]:
    """Shipped configs of the kernels for fp32 gradients (the exact fallback's included)."""
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
        for fallback in (False, True):
            cases.append(CompileCase(
                f"topk_chosen[{tag}{',exact' if fallback else ''}]", jit_function(topk_chosen_kernel),
                {"best_ptr": "*i64", "cand_ptr": "*i32", "counter_ptr": "*i32",
                 "fallback_ptr": "*i32", "chosen_ptr": "*i32", "k": "i32", "k_class": "i32",
                 "capacity": "i32", "EXACT_FALLBACK": "constexpr", "BLOCK": "constexpr"},
                {"EXACT_FALLBACK": fallback, "BLOCK": block},
                warps, aligned=("best_ptr", "cand_ptr", "fallback_ptr", "chosen_ptr", "k")))
        for index in ("*i32", "*i64"):
            cases.append(CompileCase(
                f"topk_gather[{tag},{index[1:]}]", jit_function(topk_gather_kernel),
                {"sorted_ptr": index, "source_ptr": "*fp32", "res_ptr": "*fp32", "values_ptr": "*fp32",
                 "indices_ptr": "*i32", "k": "i32", "k_class": "i32", "prescale": "fp32",
                 "HAS_RESIDUAL": "constexpr", "X_BF16": "constexpr", "BLOCK": "constexpr"},
                {"HAS_RESIDUAL": True, "X_BF16": False, "BLOCK": block},
                warps, aligned=("sorted_ptr", "source_ptr", "res_ptr", "values_ptr", "indices_ptr",
                                "k")))
        cases.append(CompileCase(
            f"topk_fallback_zero[{tag}]", jit_function(topk_fallback_zero_kernel),
            {"hist_ptr": "*i32", "counter_ptr": "*i32", "k": "i32", "k_class": "i32",
             "capacity": "i32", "size": "i32", "BLOCK": "constexpr"},
            {"BLOCK": block}, warps, aligned=("hist_ptr", "size"), wide=(WIDE_STORES,)))
        for low in (False, True):
            cases.append(CompileCase(
                f"topk_radix_hist[{tag},{'low' if low else 'high'}]", jit_function(topk_radix_hist_kernel),
                {"source_ptr": "*fp32", "hist_ptr": "*i32", "counter_ptr": "*i32", "n": "i32",
                 "n_class": "i32", "k": "i32", "capacity": "i32", "prescale": "fp32",
                 "LOW": "constexpr", "FROM_X": "constexpr", "X_BF16": "constexpr", "BLOCK": "constexpr"},
                {"LOW": low, "FROM_X": False, "X_BF16": False, "BLOCK": block},
                warps, aligned=("source_ptr", "hist_ptr", "n"), wide=(WIDE_LOADS,)))
        cases.append(CompileCase(
            f"topk_fallback_compact[{tag}]", jit_function(topk_fallback_compact_kernel),
            {"source_ptr": "*fp32", "chosen_ptr": "*i32", "counter_ptr": "*i32", "fill_ptr": "*i32",
             "n": "i32", "n_class": "i32", "k": "i32", "capacity": "i32", "prescale": "fp32",
             "FROM_X": "constexpr", "X_BF16": "constexpr", "BLOCK": "constexpr"},
            {"FROM_X": False, "X_BF16": False, "BLOCK": block},
            warps, aligned=("source_ptr", "chosen_ptr", "n"), wide=(WIDE_LOADS,)))
        cases.append(CompileCase(
            f"zero_nonfinite[{tag}]", jit_function(zero_nonfinite_kernel),
            {"res_ptr": "*fp32", "counter_ptr": "*i32", "n": "i32", "n_class": "i32",
             "BLOCK": "constexpr"},
            {"BLOCK": block}, warps, aligned=("res_ptr", "n"), wide=(WIDE_LOADS,)))
    block, warps = ROWS_CONFIG.kwargs["BLOCK"], ROWS_CONFIG.num_warps
    cases.append(CompileCase(
        f"topk_check[BLOCK={block},warps={warps}]", jit_function(topk_check_kernel),
        {"indices_ptr": "*i32", "bad_ptr": "*i32", "bounds_ptr": "*i32", "n": "i32", "k": "i32",
         "k_class": "i32", "tiles": "i32", "indices_row": "i32", "TILE": "constexpr",
         "BLOCK": "constexpr"},
        {"TILE": DECODE_TILE, "BLOCK": block}, warps,
        aligned=("indices_ptr", "bad_ptr", "bounds_ptr", "k", "indices_row"), wide=(WIDE_LOADS,)))
    cases.append(CompileCase(
        f"scatter_add[BLOCK={block},warps={warps}]", jit_function(scatter_add_kernel),
        {"values_ptr": "*fp32", "indices_ptr": "*i32", "bad_ptr": "*i32", "out_ptr": "*fp32",
         "dropped_ptr": "*i64", "n": "i32", "k": "i32", "k_class": "i32", "values_row": "i32",
         "indices_row": "i32", "V_BF16": "constexpr", "COUNT": "constexpr", "BLOCK": "constexpr"},
        {"V_BF16": False, "COUNT": True, "BLOCK": block},
        warps, aligned=("values_ptr", "indices_ptr", "bad_ptr", "out_ptr", "k", "values_row",
                        "indices_row"), wide=(WIDE_LOADS,)))
    for config in DECODE_CONFIGS:
        for addend in (None, "*fp32", "*bf16"):
            for chunk in (32, 256, 1024):
                cases.append(CompileCase(
                    f"topk_decode_tile[BLOCK={DECODE_TILE},warps={config.num_warps},CHUNK={chunk}"
                    f"{'' if addend is None else ',addend=' + addend[1:]}]",
                    jit_function(topk_decode_tile_kernel),
                    {"values_ptr": "*fp32", "indices_ptr": "*i32", "bounds_ptr": "*i32",
                     "bad_ptr": "*i32", "addend_ptr": "*i16" if addend == "*bf16" else addend or "*fp32",
                     "out_ptr": "*fp32", "n": "i32", "n_class": "i32", "world": "i32", "tiles": "i32",
                     "values_row": "i32", "indices_row": "i32", "addend_scale": "fp32",
                     "HAS_ADDEND": "constexpr", "ADDEND_BF16": "constexpr", "V_BF16": "constexpr",
                     "PART": "constexpr", "CHUNK": "constexpr", "BLOCK": "constexpr"},
                    {"HAS_ADDEND": addend is not None, "ADDEND_BF16": addend == "*bf16",
                     "V_BF16": False, "PART": DECODE_PART, "CHUNK": chunk, "BLOCK": DECODE_TILE},
                    config.num_warps,
                    aligned=("values_ptr", "indices_ptr", "bounds_ptr", "addend_ptr", "out_ptr", "n",
                             "values_row", "indices_row"),
                    wide=(WIDE_STORES,) if addend is None else (WIDE_LOADS, WIDE_STORES)))
    for low in (False, True):
        cases.append(CompileCase(
            f"topk_radix_scan[{'low' if low else 'high'}]", jit_function(topk_radix_scan_kernel),
            {"hist_ptr": "*i32", "counter_ptr": "*i32", "k": "i32", "k_class": "i32",
             "capacity": "i32", "LOW": "constexpr", "CHUNK": "constexpr"},
            {"LOW": low, "CHUNK": SCAN_CHUNK}, SCAN_CONFIG.num_warps, aligned=("hist_ptr",),
            wide=(WIDE_LOADS,)))
    return cases
