"""top-k kernels: the exact k largest |c| (c = x * prescale + residual) in ascending index order,
with error feedback, in one pass over x and the residual plus kernels over about k entries; and a
decode-sum of all ranks' payloads. Nothing is read back to the host and the launches do not depend
on the data.

Compress (:func:`ef_topk`, nine launches):
1. sample (one program): zero the counters and the top histogram's two parts; the magnitude
   keys of c at ``sample`` seeded pseudo-random positions (a splitmix64 hash of the seed and
   the lane, one in each of ``sample`` near-equal strata of x; c with the candidate pass's
   rounding), and their ``rank``-th smallest (a bitwise search) as the threshold key (no
   sample: above every finite key, so only non-finite values pass).
2. candidates (one program per BLOCK of x): c = x * prescale + r (the product rounded to fp32
   first) is written into the residual; every element whose magnitude key (its fp32 bits without
   the sign: they order like |c|, inf above every finite value, NaN above inf, as torch.topk ranks
   them) is at or above the threshold, and every non-finite one, is a candidate: counted by its
   key's bits 30..16 into the top histogram (2^15 buckets, an atomic each: under the pass's
   bytes), and c and its int32 index appended at an atomic slot of a buffer of
   :func:`.declared.candidate_capacity` slots. A program's candidates are one run of
   consecutive slots in ascending index order; the table ``runs`` records, for every TOPK_RUN
   elements of x, where its candidates start and how many there are.
3-6. a radix select of the exact k-th largest key T: the rest of the top histogram (only where
   the candidates miss the top k: every key below the threshold, into its second part; else
   nothing), a one-program scan finds the boundary bucket B (the highest whose bucket and those
   above hold at least k keys) and the count above it, a second histogram counts the low 16
   bits of the keys in B, a second scan gives T and the count G of keys above it (G < k; at
   least k - G keys equal T). Each scan takes two dependent steps: every chunk's sum at once,
   then the boundary's chunk.
7. count: per run, its keys above T and equal to T; per program (TOPK_GROUP runs) their sums.
8. scan (one program): the programs' sums to exclusive prefixes.
9. write: per run, in index order, every entry above T and the ties whose rank among all ties
   (index order) is below k - G: the payload's value (c in x's dtype) and index at the place its
   rank gives, so the k indices ascend without a sort; the residual at the sent positions becomes
   c - sent (the sent value rounded in registers, as stored), and 0 wherever c is not finite.
Steps 5-9 read the candidates (the runs' c, and for the write their indices) when they
hold the top k: k <= candidates <= capacity (every element left out is below every finite
candidate, and every non-finite value is one). Otherwise (the sample missed: too few pass, or more
than the buffer holds) step 3 counts every other element into the top histogram (which then
holds every key) and steps 5-9 read c itself (from the residual, or x * prescale recomputed with
the same rounding) in runs of TOPK_RUN elements: the same result. Each kernel reads the count on
the device (4 bytes) and takes its source from it.

The result is always the exact top k: its magnitudes are torch.topk's, ties at the k-th
magnitude broken toward lower indices (deterministic), k distinct ascending indices. Residual +
decoded payload = c wherever c is finite; every non-finite c is zeroed in the residual (sent
where it is among the k: NaN ranks first, then inf).

Decode-sum (:func:`scatter_add_sum`): a check of every rank's indices (strictly increasing within
[0, n): a flag per rank) that also records where each rank's entries cross every DECODE_TILE
boundary of the output, then one program per output tile (16 KB: every resident program's tile
stays in the L2) that writes the start (zeros or the scaled addend) and adds every checked rank's
entries of its tile, rank by rank in row order, with plain loads and stores (no atomics: the sum
is deterministic, bit for bit the torch path's row-order scatter-add); the ranks' bounds and
first entries are loaded four ranks at a time, so a rank's turn waits only for the output's
L2 round trip. A rank whose check failed (corrupt or hostile bytes) is added afterwards by fp32
atomics, entries outside [0, n) dropped and counted.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .common import (EXACT, GRADIENT_DTYPES, WIDE_LOADS, WIDE_STORES, CompileCase, bf16_bits_to_f32,
                     f32_to_bf16_bits,
                     check_addend, check_flat, decode_target, jit_function, kernel_view, load_f32,
                     load_scaled_f32, size_class, store_f32, tuned)
from .declared import (DECODE_GROUP, DECODE_TILE, DECODE_WARPS, FALLBACK_SPLIT, HIGH_BUCKETS, LOW_BUCKETS, MAX_SAMPLE, SCAN_CHUNK, TOPK_GROUP, TOPK_LANES,
                       TOPK_RUN, TOPK_TILES, candidate_capacity, decode_chunk)

CONFIGS = [triton.Config({"BLOCK": block}, num_warps=warps) for block, warps in TOPK_TILES]
CPU_CONFIG = triton.Config({"BLOCK": 32768})
ROWS_CONFIG = triton.Config({"BLOCK": TOPK_TILES[0][0]}, num_warps=TOPK_TILES[0][1])
"""The one config of the decode's index check and atomic fallback (their declared
bytes depend on the block: :func:`.declared.scatter_add_sum_bytes`)."""
DECODE_CONFIGS = [triton.Config({"BLOCK": DECODE_TILE}, num_warps=DECODE_WARPS)]
DECODE_CPU_CONFIG = triton.Config({"BLOCK": DECODE_TILE})
"""The tile decode's config: DECODE_TILE outputs per program (the check splits the indices at
that tile), DECODE_WARPS warps (32 x DECODE_WARPS <= its smallest CHUNK: no lane of a rank's
entries is held twice)."""
DECODE_PART = 1024
"""Outputs per step of the tile decode's start."""
HINTED_WIDE_STORES = r"st\.global(?:\.L[12]::\w+)*\.v4"
"""The tile decode's 16-byte stores of its start, with their evict-last hints
(``st.global.L1::evict_last.L2::cache_hint.v4``)."""
SELECT_CONFIG = triton.Config({"LANES": TOPK_LANES}, num_warps=4)
SELECT_CPU_CONFIG = triton.Config({"LANES": TOPK_RUN})
"""The select kernels' configs over runs: LANES entries of each run per step (their grid and
tallies follow TOPK_GROUP)."""
SCAN_CONFIG = triton.Config({"CHUNK": SCAN_CHUNK}, num_warps=4)
"""The radix scans' config, interpreted too (their bytes depend on CHUNK): the histogram in
chunks of CHUNK buckets (their sums at once, then the boundary's chunk)."""
SCAN_CPU_CONFIG = triton.Config({"CHUNK": 32768})
"""The sample's config when interpreting: CHUNK buckets zeroed per step."""
TALLY_CONFIG = triton.Config({"ROWS": 4, "CHUNK": 1024}, num_warps=16)
TALLY_CPU_CONFIG = triton.Config({"ROWS": 1, "CHUNK": 32768})
"""The tally scan's configs: ROWS x CHUNK program sums per step."""
SAMPLE_CONFIG = triton.Config({"CHUNK": 4096}, num_warps=32)
"""The sample kernel's config (up to MAX_SAMPLE lanes in one program; it zeroes CHUNK buckets per
step), SCAN_CPU_CONFIG when interpreting."""
HIGH_SPAN: tl.constexpr = tl.constexpr(HIGH_BUCKETS)
LOW_SPAN: tl.constexpr = tl.constexpr(LOW_BUCKETS)
RUN_SPAN: tl.constexpr = tl.constexpr(TOPK_RUN)
"""declared's histogram sizes and run length as the kernels read them (globals a kernel reads
must be constexpr)."""
INF_KEY: tl.constexpr = tl.constexpr(0x7F800000)
"""The magnitude key of inf: every non-finite value's key is at or above it."""
COUNTER = 8
"""int32 counts on the device: [0] candidates, [1] non-finite values, [2] G (keys above T),
[3] T, [4] B (the boundary top bucket), [5] keys above B."""


@triton.jit
def magnitude_key(c):
    """The int32 ordering key of |c|: its fp32 bits without the sign (for non-negative floats the
    bit pattern orders like the value; inf above every finite value), every NaN 0x7FFFFFFF above
    inf: NaNs rank alike, as torch.topk ranks them, whatever their payload bits (which the
    conversion of a bf16/fp16 NaN sets differently on different hardware), so the ties at the
    k-th key go to the lowest indices among NaNs too."""
    key = c.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(key > INF_KEY, 0x7FFFFFFF, key)


@triton.jit
def load_corrected(source_ptr, offs, mask, prescale, FROM_X: tl.constexpr, X_BF16: tl.constexpr):
    """c at ``offs``: from the residual the candidate pass wrote it into, or (FROM_X: no
    residual) recomputed as x * prescale, the same rounding as that pass."""
    if FROM_X:
        c = load_scaled_f32(source_ptr, offs, mask, prescale, X_BF16)
    else:  # one return: a constexpr-skipped return would still be typed (bf16 x is int16)
        c = tl.load(source_ptr + offs, mask=mask, other=0.0)
    return c


@triton.jit
def sent_f32(c, values_ptr, X_BF16: tl.constexpr):
    """fp32 ``c`` as :func:`store_f32` stores it into ``values_ptr`` (rounded to nearest even to
    its dtype; bf16 by bits), back in fp32: the payload's value, without reading it back."""
    if X_BF16:
        v = bf16_bits_to_f32(f32_to_bf16_bits(c))
    else:
        v = c.to(values_ptr.dtype.element_ty).to(tl.float32)
    return v


@triton.jit
def splitmix64(z):
    """SplitMix64's output function of uint64 ``z`` (Steele, Lea, Flood 2014): 64 well-mixed
    bits, a bijection (64-bit products only)."""
    z += 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@tuned([SAMPLE_CONFIG], SCAN_CPU_CONFIG, key=["n_class"])
@triton.jit
def topk_sample_kernel(x_ptr, res_ptr, threshold_ptr, counter_ptr, hist_ptr, n, n_class, sample,
                       stride, rank, seed, prescale, HAS_RESIDUAL: tl.constexpr,
                       X_BF16: tl.constexpr, SAMPLE: tl.constexpr, CHUNK: tl.constexpr):
    """One program: counter[:COUNTER] and hist[:2 x 2^15] (the top histogram's two parts) <- 0;
    threshold[0] <- the ``rank``-th smallest (1-based) magnitude key of c = x * prescale + res
    at ``sample`` (<= SAMPLE <= n) distinct positions, one per stratum [(i stride) >> 32,
    ((i + 1) stride) >> 32) (``stride`` = :func:`sample_stride`: n / sample in 32.32 fixed
    point, so the strata cover [0, n) in near-equal parts of at least one element, with no
    division on the device), drawn uniformly by the top 32 bits of splitmix64((seed << 32) | i);
    with no sample (0), 0x7FFFFFFF (no finite key reaches it). The key is found bit by bit from
    the top: the largest T with at least sample - rank + 1 keys >= T. ``n_class`` only keys
    autotuning."""
    for i in tl.static_range(2 * HIGH_SPAN // CHUNK):  # the top histogram's two parts
        tl.store(hist_ptr + i * CHUNK + tl.arange(0, CHUNK), tl.zeros([CHUNK], dtype=tl.int32))
    tl.store(counter_ptr + tl.arange(0, 8), tl.zeros([8], dtype=tl.int32))
    lanes = tl.arange(0, SAMPLE)
    live = lanes < sample
    # stratum i: [(i stride) >> 32, ((i + 1) stride) >> 32); i stride < n 2^32 < 2^63
    first = (lanes.to(tl.int64) * stride) >> 32
    width = ((lanes.to(tl.int64) + 1) * stride >> 32) - first
    stream = ((lanes * 0 + seed).to(tl.uint64) << 32) | lanes.to(tl.uint64)  # seed may be a constexpr
    u = (splitmix64(stream) >> 32).to(tl.int64)
    at = first + ((u * width) >> 32)
    c = load_scaled_f32(x_ptr, at, live, prescale, X_BF16)
    if HAS_RESIDUAL:
        c += tl.load(res_ptr + at, mask=live, other=0.0)
    key = tl.where(live, magnitude_key(c), -1)
    need = sample - rank + 1
    found = 0
    for bit in tl.static_range(30, -1, -1):
        trial = found | (1 << bit)
        found = tl.where(tl.sum((key >= trial).to(tl.int32), axis=0) >= need, trial, found)
    tl.store(threshold_ptr, tl.where(sample > 0, found, 0x7FFFFFFF))


@tuned(CONFIGS, CPU_CONFIG, key=["n_class"], restore=("res_ptr",), reset=("counter_ptr", "hist_ptr"))
@triton.jit
def topk_candidates_kernel(x_ptr, res_ptr, cand_ptr, slots_ptr, runs_ptr, threshold_ptr,
                           counter_ptr, hist_ptr, n, n_class, prescale, capacity, runs,
                           HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """c = x * prescale + res (the product rounded first); res <- c; counter[1] += the non-finite
    c. Every c whose key is at or above threshold[0] or inf's: counted by the key's bits 30..16
    into hist[0 : 2^15] (an atomic; all of them, stored or not), and c and its index at slot
    counter[0] (atomic, per program) + its rank in the program, when below ``capacity``; for each
    run r (TOPK_RUN elements) of the block, runs[r] <- its first slot, runs[runs + r] <- its
    candidates. ``n_class`` (common.size_class(n)) only keys autotuning."""
    program = tl.program_id(0).to(tl.int64)
    offs = program * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = load_scaled_f32(x_ptr, offs, mask, prescale, X_BF16)
    if HAS_RESIDUAL:
        c += tl.load(res_ptr + offs, mask=mask, other=0.0)
        tl.store(res_ptr + offs, c, mask=mask)
    key = magnitude_key(c)
    bad = tl.sum((mask & (key >= INF_KEY)).to(tl.int32), axis=0)
    tl.atomic_add(counter_ptr + 1, bad, mask=bad > 0, sem="relaxed")
    passed = mask & (key >= tl.minimum(tl.load(threshold_ptr), INF_KEY))
    tl.atomic_add(hist_ptr + (key >> 16), 1, mask=passed, sem="relaxed")
    keep = passed.to(tl.int32)
    base = tl.atomic_add(counter_ptr, tl.sum(keep, axis=0), sem="relaxed")
    slot = base + tl.cumsum(keep, axis=0) - 1
    store = (keep != 0) & (slot < capacity)
    tl.store(cand_ptr + slot, c, mask=store)
    tl.store(slots_ptr + slot, offs.to(tl.int32), mask=store)
    per_run = tl.sum(tl.reshape(keep, [BLOCK // RUN_SPAN, RUN_SPAN]), axis=1)
    run = program * (BLOCK // RUN_SPAN) + tl.arange(0, BLOCK // RUN_SPAN)
    tl.store(runs_ptr + run, base + tl.cumsum(per_run, axis=0) - per_run, mask=run < runs)
    tl.store(runs_ptr + runs + run, per_run, mask=run < runs)


@triton.jit
def fast_path_missed(counter_ptr, k, capacity):
    """Whether the candidates do not hold the exact top k, from their count (read on the device):
    fewer than k, or more than the buffer's ``capacity``."""
    count = tl.load(counter_ptr)
    return (count < k) | (count > capacity)


@triton.jit
def run_span(runs_ptr, n, runs, missed, GROUP: tl.constexpr):
    """(first, length), int32 [GROUP] (slots and elements are below n < 2^31): this program's
    runs, as candidate slots (runs[r] and runs[runs + r]) or, when the candidates ``missed``, as
    elements of c (r * TOPK_RUN, up to TOPK_RUN of them); runs past the last have length 0."""
    run = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP)
    inside = run < runs
    # the table is read whatever the count (the loads wait for no other, so one round trip
    # covers them, the count's and the caller's others)
    slot = tl.load(runs_ptr + run, mask=inside, other=0)
    slots = tl.load(runs_ptr + runs + run, mask=inside, other=0)
    element = tl.where(inside, run * RUN_SPAN, n).to(tl.int32)  # runs past the last: none
    first = tl.where(missed, element, slot)
    length = tl.where(missed, tl.minimum(tl.maximum(n - element, 0), RUN_SPAN), slots)
    return first, length


@triton.jit
def run_keys(source_ptr, cand_ptr, at, live, missed, prescale, FROM_X: tl.constexpr,
             X_BF16: tl.constexpr):
    """The magnitude keys at ``at`` of the runs: of the candidates' c, or (``missed``) of c.
    Both loads are issued, one of them masked off entirely: no branch between them, so the
    compiled code issues a step's loads together before it waits."""
    # (masks by tl.where: the interpreter refuses a block & a scalar condition as a mask)
    from_c = load_corrected(source_ptr, at, tl.where(missed, live, False), prescale, FROM_X, X_BF16)
    from_candidates = tl.load(cand_ptr + at, mask=tl.where(missed, False, live), other=0.0)
    return magnitude_key(tl.where(missed, from_c, from_candidates))


@tuned([SELECT_CONFIG], SELECT_CPU_CONFIG, key=["n_class"], reset=("hist_ptr",))
@triton.jit
def topk_radix_hist_kernel(source_ptr, cand_ptr, runs_ptr, threshold_ptr, hist_ptr, counter_ptr, n,
                           n_class, k, capacity, runs, prescale, LOW: tl.constexpr,
                           FROM_X: tl.constexpr, X_BF16: tl.constexpr, GROUP: tl.constexpr,
                           LANES: tl.constexpr):
    """Over GROUP runs, LANES entries of each per step. Not LOW (``hist``: the rest of the top
    histogram): only where the candidates missed the top k, every element of c in the program's
    runs whose key is below the threshold (the candidate pass counted the others) counted by its
    bits 30..16 into hist[0 : 2^15]; where they hold it, nothing (no trip, no c read). LOW
    (``hist``: the low histogram): the keys of the runs (:func:`run_span`) whose top bits are the
    boundary bucket counter[4] (the high scan's) counted by their bits 15..0 into
    hist[0 : 2^16]. ``n_class`` only keys autotuning."""
    missed = fast_path_missed(counter_ptr, k, capacity)
    if LOW:
        first, length = run_span(runs_ptr, n, runs, missed, GROUP)
        high = tl.load(counter_ptr + 4)
    else:
        run = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP)
        first = tl.where(run < runs, run * RUN_SPAN, n).to(tl.int32)  # runs past the last: none
        length = tl.where(missed, tl.minimum(tl.maximum(n - first, 0), RUN_SPAN), 0)
        floor = tl.minimum(tl.load(threshold_ptr, mask=missed, other=0), INF_KEY)
    for step in range(0, tl.max(length, axis=0), LANES):
        at = step + tl.arange(0, LANES)[None, :]
        live = at < length[:, None]
        key = run_keys(source_ptr, cand_ptr, first[:, None] + at, live, missed, prescale, FROM_X,
                       X_BF16)
        if LOW:
            live &= (key >> 16) == high
            tl.atomic_add(hist_ptr + (key & 0xFFFF), 1, mask=live, sem="relaxed")
        else:
            live &= key < floor
            tl.atomic_add(hist_ptr + (key >> 16), 1, mask=live, sem="relaxed")


@triton.jit
def load_buckets(hist_ptr, rest_ptr, b, REST: tl.constexpr):
    """hist[b] (+ rest[b] with REST: the top histogram's two parts)."""
    h = tl.load(hist_ptr + b)
    if REST:
        h += tl.load(rest_ptr + b)
    return h


@triton.jit
def boundary_bucket(hist_ptr, rest_ptr, need, REST: tl.constexpr, BUCKETS: tl.constexpr,
                    CHUNK: tl.constexpr):
    """(b, above): the largest bucket b with sum(hist[b:]) >= need (need >= 0, reached by the
    whole histogram; with REST, hist + rest), and sum(hist[b + 1:]). Two dependent steps, not
    one per chunk: every chunk's sum (independent loads), the chunk holding b from their suffix
    sums, then that chunk's suffix sums (its buckets loaded again: L2 hits)."""
    PARTS: tl.constexpr = BUCKETS // CHUNK
    part = tl.arange(0, PARTS)
    # every chunk's sum at once: one [PARTS, CHUNK] tile, one reduction
    sums = tl.sum(load_buckets(hist_ptr, rest_ptr, part[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :],
                               REST), axis=1)
    reach = tl.cumsum(sums, 0, reverse=True)  # elements in chunks >= p
    top = tl.max(tl.where(reach >= need, part, -1), axis=0)
    above_top = tl.sum(tl.where(part == top, reach - sums, 0), axis=0)
    b = top.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    h = load_buckets(hist_ptr, rest_ptr, b, REST)
    reach = above_top + tl.cumsum(h, 0, reverse=True)  # elements in buckets >= b
    found = tl.max(tl.where(reach >= need, b, -1), axis=0)
    above = tl.sum(tl.where(b == found, reach - h, 0), axis=0)
    return found, above


@tuned([SCAN_CONFIG], SCAN_CONFIG, key=["k_class"])
@triton.jit
def topk_radix_scan_kernel(hist_ptr, counter_ptr, k, k_class, LOW: tl.constexpr,
                           CHUNK: tl.constexpr):
    """One program. Not LOW: the boundary bucket B of the top-bits histogram (the largest whose
    bucket and those above hold >= k keys) -> counter[4], the keys above it -> counter[5], and
    the low histogram zeroed. LOW: within B, the boundary b of the low histogram for the
    k - counter[5] keys still needed: the exact k-th largest key T = (B << 16) | b ->
    counter[3], the keys above T -> counter[2] (fewer than k; at least k - counter[2] equal T).
    Each run writes the same from the same histograms (autotuning's trials repeat it)."""
    if LOW:
        high, above_high = tl.load(counter_ptr + 4), tl.load(counter_ptr + 5)
        low, above = boundary_bucket(hist_ptr + 2 * HIGH_SPAN, hist_ptr, k - above_high, False,
                                     LOW_SPAN, CHUNK)
        tl.store(counter_ptr + 3, (high << 16) | low)
        tl.store(counter_ptr + 2, above_high + above)
    else:
        high, above = boundary_bucket(hist_ptr, hist_ptr + HIGH_SPAN, k, True, HIGH_SPAN, CHUNK)
        tl.store(counter_ptr + 4, high)
        tl.store(counter_ptr + 5, above)
        for i in tl.static_range(LOW_SPAN // CHUNK):
            tl.store(hist_ptr + 2 * HIGH_SPAN + i * CHUNK + tl.arange(0, CHUNK),
                     tl.zeros([CHUNK], dtype=tl.int32))


@tuned([SELECT_CONFIG], SELECT_CPU_CONFIG, key=["n_class"])
@triton.jit
def topk_count_kernel(source_ptr, cand_ptr, runs_ptr, tally_ptr, counter_ptr, n, n_class, k,
                      capacity, runs, prescale, FROM_X: tl.constexpr, X_BF16: tl.constexpr,
                      GROUP: tl.constexpr, LANES: tl.constexpr):
    """Per run r of this program's GROUP (:func:`run_span`): tally[r] <- (keys above T) << 32 |
    (keys equal to T), T = counter[3]; tally[runs + program] <- their sum over the program's
    runs (int64: neither half carries). ``n_class`` only keys autotuning."""
    missed = fast_path_missed(counter_ptr, k, capacity)
    first, length = run_span(runs_ptr, n, runs, missed, GROUP)
    boundary = tl.load(counter_ptr + 3)
    above = tl.zeros([GROUP], dtype=tl.int64)
    ties = tl.zeros([GROUP], dtype=tl.int64)
    for step in range(0, tl.max(length, axis=0), LANES):
        at = step + tl.arange(0, LANES)[None, :]
        live = at < length[:, None]
        key = run_keys(source_ptr, cand_ptr, first[:, None] + at, live, missed, prescale, FROM_X,
                       X_BF16)
        above += tl.sum((live & (key > boundary)).to(tl.int64), axis=1)
        ties += tl.sum((live & (key == boundary)).to(tl.int64), axis=1)
    program = tl.program_id(0).to(tl.int64)
    run = program * GROUP + tl.arange(0, GROUP)
    packed = (above << 32) | ties
    tl.store(tally_ptr + run, packed, mask=run < runs)
    tl.store(tally_ptr + runs + program, tl.sum(packed, axis=0))


@tuned([TALLY_CONFIG], TALLY_CPU_CONFIG, key=["n_class"], restore=("tally_ptr",))
@triton.jit
def topk_tally_scan_kernel(tally_ptr, n_class, runs, programs, ROWS: tl.constexpr,
                           CHUNK: tl.constexpr):
    """One program: the ``programs`` sums at tally[runs:] (int64) to exclusive prefix sums, a
    [ROWS, CHUNK] tile a step (each row's scan plus the rows before it: one step covers
    ROWS x CHUNK sums). ``n_class`` only keys autotuning."""
    carry = tl.zeros([], dtype=tl.int64)
    row = tl.arange(0, ROWS)
    for first in range(0, programs, ROWS * CHUNK):
        offs = first + row[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        mask = offs < programs
        t = tl.load(tally_ptr + runs + offs, mask=mask, other=0)
        sums = tl.sum(t, axis=1)
        before = carry + tl.cumsum(sums, axis=0) - sums
        tl.store(tally_ptr + runs + offs, before[:, None] + tl.cumsum(t, axis=1) - t, mask=mask)
        carry += tl.sum(sums, axis=0)


@tuned([SELECT_CONFIG], SELECT_CPU_CONFIG, key=["n_class"], restore=("res_ptr",))
@triton.jit
def topk_write_kernel(source_ptr, cand_ptr, slots_ptr, runs_ptr, tally_ptr, counter_ptr, res_ptr,
                      values_ptr, indices_ptr, n, n_class, k, capacity, runs, prescale,
                      HAS_RESIDUAL: tl.constexpr, X_BF16: tl.constexpr, GROUP: tl.constexpr,
                      LANES: tl.constexpr):
    """Per run of this program's GROUP (:func:`run_span`), in index order: every entry (index i:
    the candidate's, or the element's when the candidates missed) with key(c_i) > T, and every
    tie (key T) whose rank among all ties is below k - G (T = counter[3], G = counter[2]), goes
    to payload place P = (entries above T before it) + min(ties before it, k - G), from the
    count's tallies and their scanned sums: values[P] = c_i in x's dtype, indices[P] = i; with a
    residual, res[i] <- c_i - values[P] (0 where not finite) there, and 0 at every non-finite c_i
    of the runs. c: the candidate's, or (missed) from the residual (source) or, without one,
    x * prescale. ``n_class`` only keys autotuning."""
    missed = fast_path_missed(counter_ptr, k, capacity)
    first, length = run_span(runs_ptr, n, runs, missed, GROUP)
    boundary, need = tl.load(counter_ptr + 3), k - tl.load(counter_ptr + 2)
    program = tl.program_id(0).to(tl.int64)
    run = program * GROUP + tl.arange(0, GROUP)
    own = tl.load(tally_ptr + run, mask=run < runs, other=0)
    before = tl.load(tally_ptr + runs + program) + tl.cumsum(own, axis=0) - own
    # int32 from here: counts and places are below k < 2^31
    above_before, ties_before = (before >> 32).to(tl.int32), (before & 0xFFFFFFFF).to(tl.int32)
    for step in range(0, tl.max(length, axis=0), LANES):
        at = step + tl.arange(0, LANES)[None, :]
        live = at < length[:, None]
        # both sources' loads issued, one masked off entirely (no branch: they issue together)
        slot = first[:, None] + at
        stored = tl.where(missed, False, live)
        index = tl.where(missed, slot, tl.load(slots_ptr + slot, mask=stored, other=0))
        c = tl.where(missed, load_corrected(source_ptr, slot, tl.where(missed, live, False), prescale,
                                            not HAS_RESIDUAL, X_BF16),
                     tl.load(cand_ptr + slot, mask=stored, other=0.0))
        key = magnitude_key(c)
        above = (live & (key > boundary)).to(tl.int32)
        tie = (live & (key == boundary)).to(tl.int32)
        # one scan for both counts: above in bits 16.., ties in bits 0..15 (a step holds LANES
        # entries of a run: neither part carries)
        both = (above << 16) | tie
        earlier = tl.cumsum(both, axis=1) - both
        ties = ties_before[:, None] + (earlier & 0xFFFF)
        sent = (above != 0) | ((tie != 0) & (ties < need))
        place = above_before[:, None] + (earlier >> 16) + tl.minimum(ties, need)
        store_f32(values_ptr, place, c, sent, X_BF16)
        tl.store(indices_ptr + place, index, mask=sent)
        if HAS_RESIDUAL:  # the value as stored, rounded here (no read back)
            diff = c - sent_f32(c, values_ptr, X_BF16)
            tl.store(res_ptr + index, tl.where(sent & (tl.abs(diff) < float("inf")), diff, 0.0),
                     mask=sent | (live & (key >= INF_KEY)))
        above_before += tl.sum(above, axis=1)
        ties_before += tl.sum(tie, axis=1)


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
    # outside [0, n) as one unsigned compare (a negative index is above n - 1 as uint32)
    bad = (entry & ((cur.to(tl.uint32, bitcast=True) >= n) | (cur <= prev))).to(tl.int32)
    count = tl.sum(bad, axis=0)
    tl.atomic_add(bad_ptr + rank, count, mask=count > 0, sem="relaxed")
    if count == 0:  # -1 <= prev < cur <= n on every lane: boundaries (prev, cur]
        # the first boundary above prev and the last at or below cur, by unsigned division (a
        # shift: prev + TILE and cur are >= 0 and below 2^32)
        low = ((prev + TILE).to(tl.uint32, bitcast=True) // TILE).to(tl.int32, bitcast=True)
        high = tl.where(entry, (cur.to(tl.uint32, bitcast=True) // TILE).to(tl.int32, bitcast=True),
                        tiles)  # entry k: every boundary left, up to tiles
        span = tl.where(j <= k, high - low + 1, 0)
        bounds_row = bounds_ptr + rank * (tiles + 1)
        for step in range(tl.max(span, axis=0)):
            tl.store(bounds_row + low + step, j, mask=step < span)


@triton.jit
def rank_span(bounds_at, bad_ptr, w, world):
    """(lo, hi): rank w's entries of this tile, [lo, hi) (:func:`topk_check_kernel`'s bounds at
    ``bounds_at``, the tile's column of the rank's row), loaded at the top of the rank's group's
    turn; hi = lo (nothing to add) for a rank whose check failed, and lo = hi = 0 with nothing
    read for w >= world (the last group's missing ranks)."""
    inside = w < world
    lo = tl.load(bounds_at, mask=inside, other=0)
    good = tl.load(bad_ptr + w, mask=inside, other=1) == 0
    return lo, tl.where(good, tl.load(bounds_at + 1, mask=inside, other=0), lo)


@triton.jit
def rank_entries(indices_at, values_at, first, hi, lanes, V_BF16: tl.constexpr):
    """(index, fp32 value, live) of a rank's entries first + lanes below hi: read once, so
    loaded evict-first (they do not push the open output tiles out of the L2)."""
    j = first + lanes  # int32: first + CHUNK < 2^31 (scatter_add_sum refuses larger payloads)
    live = j < hi
    idx = tl.load(indices_at + j, mask=live, other=0, eviction_policy="evict_first")
    if V_BF16:
        v = bf16_bits_to_f32(tl.load(values_at + j, mask=live, other=0, eviction_policy="evict_first"))
    else:
        v = tl.load(values_at + j, mask=live, other=0, eviction_policy="evict_first").to(tl.float32)
    return idx, v, live


@triton.jit
def add_entries(out_ptr, idx, v, live):
    """out[idx] += v where live: a plain load, fp32 add and store of the tile this program owns
    (the indices of one rank are distinct), kept in the L2 (evict-last)."""
    total = tl.load(out_ptr + idx, mask=live, other=0.0, eviction_policy="evict_last") + v
    tl.store(out_ptr + idx, total, mask=live, eviction_policy="evict_last")


@triton.jit
def add_rank(out_ptr, indices_at, values_at, idx, v, live, lo, hi, lanes, V_BF16: tl.constexpr,
             CHUNK: tl.constexpr):
    """One rank's turn: its first CHUNK entries of the tile (loaded already), then the rest (a
    loop whose bounds were loaded at the top of the group's turn: no trip when the first chunk
    holds them all), then a barrier that every thread takes, so the next rank reads these sums."""
    add_entries(out_ptr, idx, v, live)
    for first in range(lo + CHUNK, hi, CHUNK):
        more_idx, more_v, more_live = rank_entries(indices_at, values_at, first, hi, lanes, V_BF16)
        add_entries(out_ptr, more_idx, more_v, more_live)
        tl.debug_barrier()
    tl.debug_barrier()


@tuned(DECODE_CONFIGS, DECODE_CPU_CONFIG, key=["n_class", "world"])
@triton.jit
def topk_decode_tile_kernel(values_ptr, indices_ptr, bounds_ptr, bad_ptr, addend_ptr, out_ptr, n,
                            n_class, world, tiles, values_row, indices_row, addend_scale,
                            HAS_ADDEND: tl.constexpr, ADDEND_BF16: tl.constexpr,
                            V_BF16: tl.constexpr, PART: tl.constexpr, CHUNK: tl.constexpr,
                            GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Program t owns out[t * BLOCK : (t + 1) * BLOCK] (fp32; BLOCK = DECODE_TILE, small enough
    that the tiles of every resident program stay in the L2): writes its start, fp32(addend) *
    fp32(addend_scale) (:func:`load_scaled_f32`; bf16 as int16 bits) or 0, PART elements at a
    time, then adds rank by rank, in row order, the values of every rank with bad[w] == 0 whose
    entries j in [bounds[w, t], bounds[w, t + 1]) fall in the tile (:func:`topk_check_kernel`):
    plain loads and stores (the checked indices of one rank are distinct, and only this program
    touches the tile), a barrier after every rank. The ranks go in groups of GROUP = 4: a
    group's bounds are loaded at the top of its turn, then the first CHUNK entries of all four
    ranks, then each rank's turn (:func:`add_rank`): the payload's round trips are paid once a
    group, the output's (an L2 hit) once a rank. No atomics; the sum's order is fixed, so it is
    deterministic. ``n_class`` (common.size_class(n)) and ``world`` only key autotuning."""
    tl.static_assert(GROUP == 4)
    tile = tl.program_id(0).to(tl.int64)
    for part in tl.static_range(BLOCK // PART):
        offs = tile * BLOCK + part * PART + tl.arange(0, PART)
        mask = offs < n
        if HAS_ADDEND:
            start = load_scaled_f32(addend_ptr, offs, mask, addend_scale, ADDEND_BF16)
        else:
            start = tl.zeros([PART], dtype=tl.float32)
        tl.store(out_ptr + offs, start, mask=mask, eviction_policy="evict_last")
    tl.debug_barrier()
    # No value is carried from one group's turn to the next but the row pointers: a group's
    # bounds are loaded at the top of its turn and every barrier is outside any `if` (inside
    # loops whose trips every thread shares, as the rank loop measured exact on an H200, which
    # loaded each rank's bounds at the top of its turn; prefetching the next rank's bounds across
    # the turn, with the barrier inside `if flag == 0`, added some entries twice there).
    lanes = tl.arange(0, CHUNK)
    step = tiles + 1
    bounds_at, indices_at, values_at = bounds_ptr + tile, indices_ptr, values_ptr
    for w in range(0, world, GROUP):  # rows by pointer steps: 64-bit, whatever world * row
        bounds_1, indices_1, values_1 = bounds_at + step, indices_at + indices_row, values_at + values_row
        bounds_2, indices_2, values_2 = bounds_1 + step, indices_1 + indices_row, values_1 + values_row
        bounds_3, indices_3, values_3 = bounds_2 + step, indices_2 + indices_row, values_2 + values_row
        lo_0, hi_0 = rank_span(bounds_at, bad_ptr, w, world)
        lo_1, hi_1 = rank_span(bounds_1, bad_ptr, w + 1, world)
        lo_2, hi_2 = rank_span(bounds_2, bad_ptr, w + 2, world)
        lo_3, hi_3 = rank_span(bounds_3, bad_ptr, w + 3, world)
        idx_0, v_0, live_0 = rank_entries(indices_at, values_at, lo_0, hi_0, lanes, V_BF16)
        idx_1, v_1, live_1 = rank_entries(indices_1, values_1, lo_1, hi_1, lanes, V_BF16)
        idx_2, v_2, live_2 = rank_entries(indices_2, values_2, lo_2, hi_2, lanes, V_BF16)
        idx_3, v_3, live_3 = rank_entries(indices_3, values_3, lo_3, hi_3, lanes, V_BF16)
        add_rank(out_ptr, indices_at, values_at, idx_0, v_0, live_0, lo_0, hi_0, lanes, V_BF16, CHUNK)
        add_rank(out_ptr, indices_1, values_1, idx_1, v_1, live_1, lo_1, hi_1, lanes, V_BF16, CHUNK)
        add_rank(out_ptr, indices_2, values_2, idx_2, v_2, live_2, lo_2, hi_2, lanes, V_BF16, CHUNK)
        add_rank(out_ptr, indices_3, values_3, idx_3, v_3, live_3, lo_3, hi_3, lanes, V_BF16, CHUNK)
        bounds_at = bounds_3 + step
        indices_at = indices_3 + indices_row
        values_at = values_3 + values_row


@tuned([ROWS_CONFIG], ROWS_CONFIG, key=["k_class"], restore=("out_ptr", "dropped_ptr"))
@triton.jit
def scatter_add_kernel(values_ptr, indices_ptr, bad_ptr, out_ptr, dropped_ptr, n, k, k_class,
                       values_row, indices_row, split, V_BF16: tl.constexpr, COUNT: tl.constexpr,
                       BLOCK: tl.constexpr):
    """The ranks the tile decode skipped (bad[w] != 0: indices unsorted, repeated or outside the
    tensor): out[indices[w, j]] += values[w, j] (fp32 atomics, after the tile decode's sum) for
    the entries whose index lies in [0, n); the others (bytes from another process: corrupt or
    hostile) are never written through and, with COUNT, counted per rank into int64
    ``dropped[w]`` (one atomic per block that saw any). Program i of rank i // split loads the
    rank's flag (4 bytes) and, only when it is set, adds the blocks i % split, + split, ... of
    the rank's cdiv(k, BLOCK) (its loop runs no trip for a checked rank); each rank's row starts
    ``*_row`` elements after the previous one. Autotuning restores ``out`` and ``dropped`` after
    each trial; ``k_class`` (common.size_class(k)) only keys autotuning."""
    program = tl.program_id(0)
    rank = (program // split).to(tl.int64)
    blocks = tl.where(tl.load(bad_ptr + rank) != 0, tl.cdiv(k, BLOCK), 0).to(tl.int64)
    for block in range((program % split).to(tl.int64), blocks, split):  # int64: block * BLOCK
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < k
        v = load_f32(values_ptr + rank * values_row, offs, mask, V_BF16)
        idx = tl.load(indices_ptr + rank * indices_row + offs, mask=mask, other=0)
        inside = mask & (idx >= 0) & (idx < n)
        tl.atomic_add(out_ptr + idx, v, mask=inside, sem="relaxed")
        if COUNT:
            outside = tl.sum((mask & ~inside).to(tl.int64), axis=0)
            tl.atomic_add(dropped_ptr + rank, outside, mask=outside > 0, sem="relaxed")


def elementwise_grid(n: int):
    """Grid of the candidate pass (n elements) and the tile decode (n outputs): one program per
    BLOCK."""
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


def scatter_add_grid(k: int, world: int):
    """Grid of the decode's index check (k + 1 lanes per rank): cdiv(k, BLOCK) programs per
    rank, every rank on axis 0."""
    return lambda meta: (world * triton.cdiv(k, meta["BLOCK"]),)


def fallback_split(k: int) -> int:
    """Programs per rank of the atomic fallback over k entries a rank: FALLBACK_SPLIT, or fewer
    when the rank has fewer blocks."""
    return min(FALLBACK_SPLIT, triton.cdiv(k, ROWS_CONFIG.kwargs["BLOCK"]))


def fallback_grid(k: int, world: int):
    """Grid of the atomic fallback: :func:`fallback_split` programs per rank, every rank on axis 0."""
    return lambda meta: (world * fallback_split(k),)


def one_program_grid():
    """Grid of the sample and the scans: one program."""
    return lambda meta: (1,)


def run_grid(n: int):
    """Grid of the select kernels over the runs of n elements: TOPK_GROUP runs per program."""
    return lambda meta: (triton.cdiv(triton.cdiv(n, TOPK_RUN), TOPK_GROUP),)


def sample_stride(n: int, sample: int) -> int:
    """The sample's stratum width, n / sample in 32.32 fixed point (rounded down; 0 without a
    sample): stratum i is [(i stride) >> 32, ((i + 1) stride) >> 32), at least one element wide
    when sample <= n, the last ending at or below n."""
    return (n << 32) // sample if sample else 0


def sample_tile(sample: int) -> int:
    """The sample kernel's lanes for ``sample`` elements: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(sample))


def ef_topk(x: torch.Tensor, residual: torch.Tensor | None, k: int, prescale: float = 1.0,
            sample: int = 0, rank: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n] (+ residual fp32 [n], updated in place) -> (values [k] in x's dtype, indices int32
    [k]): the exact k largest |c|, c = x * prescale + residual (the product rounded to fp32
    first; NaN first, ties at the k-th magnitude toward lower indices), indices ascending; the
    residual keeps c - sent at the sent positions, c elsewhere, 0 where c is not finite.

    sample, rank, seed: the candidate threshold is the ``rank``-th smallest (1 <= rank <= sample)
    magnitude of c at ``sample`` (at most declared.MAX_SAMPLE and n) positions, one drawn in each
    of ``sample`` equal strata of [0, n) with ``seed`` (taken modulo 2^31); it
    only decides what the select kernels read (the candidates, or c itself where they miss the
    top k), never the result. sample 0: no threshold (c itself).
    Nothing is read back to the host, and the launches do not depend on the data. Global
    memory: :func:`.declared.ef_topk_bytes`.
    """
    check_flat("x", x, GRADIENT_DTYPES)
    for name, value in (("k", k), ("sample", sample), ("rank", rank), ("seed", seed)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if residual is not None:
        check_flat("residual", residual, (torch.float32,), x.device)
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}")
    if n >= 2**31:
        raise ValueError(f"top-k indices are int32: x must have fewer than 2^31 elements, got {n}")
    if not 0 <= sample <= min(n, MAX_SAMPLE) or not (1 <= rank <= sample or rank == sample == 0):
        raise ValueError(f"sample must be in [0, min(n, {MAX_SAMPLE})] and rank in [1, sample] (0 "
                         f"without a sample), got sample {sample}, rank {rank}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    indices = torch.empty(k, dtype=torch.int32, device=x.device)
    if not n:
        return values, indices
    device = x.device
    capacity = candidate_capacity(n, k)
    runs = triton.cdiv(n, TOPK_RUN)
    programs = triton.cdiv(runs, TOPK_GROUP)
    threshold = torch.empty(1, dtype=torch.int32, device=device)
    counter = torch.empty(COUNTER, dtype=torch.int32, device=device)
    # the top histogram (the candidate pass's keys), its rest (the other keys, only where the
    # candidates miss the top k), the low histogram
    hist = torch.empty(2 * HIGH_BUCKETS + LOW_BUCKETS, dtype=torch.int32, device=device)
    top, rest, low_hist = hist[:HIGH_BUCKETS], hist[HIGH_BUCKETS:2 * HIGH_BUCKETS], hist[2 * HIGH_BUCKETS:]
    cand = torch.empty(capacity, dtype=torch.float32, device=device)
    slots = torch.empty(capacity, dtype=torch.int32, device=device)
    table = torch.empty(2 * runs, dtype=torch.int32, device=device)
    tally = torch.empty(runs + programs, dtype=torch.int64, device=device)
    x_arg, x_bf16 = kernel_view(x.reshape(-1))
    flat_res = residual.reshape(-1) if residual is not None else None
    has_res = flat_res is not None
    res_arg = flat_res if has_res else x_arg  # stands in for the unused pointer
    values_arg, _ = kernel_view(values)
    n_class, k_class = size_class(n), size_class(k)
    select = dict(GROUP=TOPK_GROUP, **EXACT)
    topk_sample_kernel[one_program_grid()](x_arg, res_arg, threshold, counter, hist, n, n_class,
                                           sample, sample_stride(n, sample), rank, seed % 2**31,
                                           prescale, HAS_RESIDUAL=has_res,
                                           X_BF16=x_bf16, SAMPLE=sample_tile(sample), **EXACT)
    topk_candidates_kernel[elementwise_grid(n)](x_arg, res_arg, cand, slots, table, threshold,
                                                counter, top, n, n_class, prescale, capacity, runs,
                                                HAS_RESIDUAL=has_res, X_BF16=x_bf16, **EXACT)
    for low in (False, True):
        topk_radix_hist_kernel[run_grid(n)](res_arg, cand, table, threshold, low_hist if low else rest,
                                            counter, n, n_class, k, capacity, runs, prescale,
                                            LOW=low, FROM_X=not has_res, X_BF16=x_bf16, **select)
        topk_radix_scan_kernel[one_program_grid()](hist, counter, k, k_class, LOW=low, **EXACT)
    topk_count_kernel[run_grid(n)](res_arg, cand, table, tally, counter, n, n_class, k, capacity,
                                   runs, prescale, FROM_X=not has_res, X_BF16=x_bf16, **select)
    topk_tally_scan_kernel[one_program_grid()](tally, n_class, runs, programs, **EXACT)
    topk_write_kernel[run_grid(n)](res_arg, cand, slots, table, tally, counter, res_arg,
                                   values_arg, indices, n, n_class, k, capacity, runs, prescale,
                                   HAS_RESIDUAL=has_res, X_BF16=x_bf16, **select)
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
    bytes) is added after them by fp32 atomics (on GPUs the order of additions to one
    index varies: such sums agree with torch to fp32 rounding); its entries whose index is
    outside [0, n) are skipped and counted into ``dropped`` (int64 [world], on the device;
    None: not counted). The per-rank flags zeroed, then three kernels whatever the data (the
    check, the tile decode, the fallback: FALLBACK_SPLIT programs a rank at most, which stop
    after loading the flag of a checked rank); nothing is read back.
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
            CHUNK=decode_chunk(n, k), GROUP=DECODE_GROUP, **EXACT)
    if world and k:
        scatter_add_kernel[fallback_grid(k, world)](v_arg, indices, bad, acc,
                                                   acc if dropped is None else dropped, n, k, k_class,
                                                   values.stride(0), indices.stride(0),
                                                   fallback_split(k), V_BF16=v_bf16,
                                                   COUNT=dropped is not None, **EXACT)
    if acc is not target:
        target.copy_(acc)
    return target



def compile_cases() -> list[CompileCase]:
    """Shipped configs of the kernels for fp32 gradients with a residual."""
    cases = []
    ints = {"n": "i32", "n_class": "i32", "k": "i32", "capacity": "i32", "runs": "i32",
            "prescale": "fp32"}
    select = {"GROUP": TOPK_GROUP, "LANES": SELECT_CONFIG.kwargs["LANES"]}
    warps, chunk = SCAN_CONFIG.num_warps, SCAN_CONFIG.kwargs["CHUNK"]
    for tile in (sample_tile(MAX_SAMPLE // 4), sample_tile(MAX_SAMPLE)):
        cases.append(CompileCase(
            f"topk_sample[SAMPLE={tile}]", jit_function(topk_sample_kernel),
            {"x_ptr": "*fp32", "res_ptr": "*fp32", "threshold_ptr": "*i32", "counter_ptr": "*i32",
             "hist_ptr": "*i32", "n": "i32", "n_class": "i32", "sample": "i32", "stride": "i64",
             "rank": "i32",
             "seed": "i32", "prescale": "fp32", "HAS_RESIDUAL": "constexpr", "X_BF16": "constexpr",
             "SAMPLE": "constexpr", "CHUNK": "constexpr"},
            {"HAS_RESIDUAL": True, "X_BF16": False, "SAMPLE": tile, "CHUNK": chunk},
            SAMPLE_CONFIG.num_warps, aligned=("hist_ptr",), wide=(WIDE_STORES,)))
    for config in CONFIGS:
        block, block_warps = config.kwargs["BLOCK"], config.num_warps
        cases.append(CompileCase(
            f"topk_candidates[BLOCK={block},warps={block_warps}]", jit_function(topk_candidates_kernel),
            {"x_ptr": "*fp32", "res_ptr": "*fp32", "cand_ptr": "*fp32", "slots_ptr": "*i32",
             "runs_ptr": "*i32", "threshold_ptr": "*i32", "counter_ptr": "*i32", "hist_ptr": "*i32",
             "n": "i32", "n_class": "i32", "prescale": "fp32", "capacity": "i32", "runs": "i32",
             "HAS_RESIDUAL": "constexpr", "X_BF16": "constexpr", "BLOCK": "constexpr"},
            {"HAS_RESIDUAL": True, "X_BF16": False, "BLOCK": block}, block_warps,
            aligned=("x_ptr", "res_ptr", "n"), wide=(WIDE_LOADS, WIDE_STORES)))
    for low in (False, True):
        cases.append(CompileCase(
            f"topk_radix_hist[{'low' if low else 'high'}]", jit_function(topk_radix_hist_kernel),
            {"source_ptr": "*fp32", "cand_ptr": "*fp32", "runs_ptr": "*i32", "threshold_ptr": "*i32",
             "hist_ptr": "*i32", "counter_ptr": "*i32", **ints, "LOW": "constexpr", "FROM_X": "constexpr",
             "X_BF16": "constexpr", "GROUP": "constexpr", "LANES": "constexpr"},
            {"LOW": low, "FROM_X": False, "X_BF16": False, **select}, SELECT_CONFIG.num_warps,
            aligned=("source_ptr", "n")))
        cases.append(CompileCase(
            f"topk_radix_scan[{'low' if low else 'high'}]", jit_function(topk_radix_scan_kernel),
            {"hist_ptr": "*i32", "counter_ptr": "*i32", "k": "i32", "k_class": "i32",
             "LOW": "constexpr", "CHUNK": "constexpr"},
            {"LOW": low, "CHUNK": chunk}, warps, aligned=("hist_ptr",), wide=(WIDE_LOADS,)))
    cases.append(CompileCase(
        "topk_count", jit_function(topk_count_kernel),
        {"source_ptr": "*fp32", "cand_ptr": "*fp32", "runs_ptr": "*i32", "tally_ptr": "*i64",
         "counter_ptr": "*i32", **ints, "FROM_X": "constexpr", "X_BF16": "constexpr",
         "GROUP": "constexpr", "LANES": "constexpr"},
        {"FROM_X": False, "X_BF16": False, **select}, SELECT_CONFIG.num_warps,
        aligned=("source_ptr", "n")))
    cases.append(CompileCase(
        "topk_tally_scan", jit_function(topk_tally_scan_kernel),
        {"tally_ptr": "*i64", "n_class": "i32", "runs": "i32", "programs": "i32",
         "ROWS": "constexpr", "CHUNK": "constexpr"},
        dict(TALLY_CONFIG.kwargs), TALLY_CONFIG.num_warps))
    for bf16 in (False, True):  # bf16 x without a residual: c recomputed from int16 bits
        cases.append(CompileCase(
            f"topk_write{'[bf16]' if bf16 else ''}", jit_function(topk_write_kernel),
            {"source_ptr": "*i16" if bf16 else "*fp32", "cand_ptr": "*fp32", "slots_ptr": "*i32",
             "runs_ptr": "*i32", "tally_ptr": "*i64", "counter_ptr": "*i32", "res_ptr": "*fp32",
             "values_ptr": "*i16" if bf16 else "*fp32", "indices_ptr": "*i32", **ints,
             "HAS_RESIDUAL": "constexpr", "X_BF16": "constexpr", "GROUP": "constexpr",
             "LANES": "constexpr"},
            {"HAS_RESIDUAL": not bf16, "X_BF16": bf16, **select}, SELECT_CONFIG.num_warps,
            aligned=("source_ptr", "res_ptr", "n")))
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
         "indices_row": "i32", "split": "i32", "V_BF16": "constexpr", "COUNT": "constexpr",
         "BLOCK": "constexpr"},
        {"V_BF16": False, "COUNT": True, "BLOCK": block},
        warps, aligned=("values_ptr", "indices_ptr", "bad_ptr", "out_ptr", "k", "values_row",
                        "indices_row"), wide=(WIDE_LOADS,)))
    for config in DECODE_CONFIGS:
        for addend in (None, "*fp32", "*bf16"):
            for chunk in (128, 256):  # declared.decode_chunk's values
                cases.append(CompileCase(
                    f"topk_decode_tile[BLOCK={DECODE_TILE},warps={config.num_warps},CHUNK={chunk}"
                    f"{'' if addend is None else ',addend=' + addend[1:]}]",
                    jit_function(topk_decode_tile_kernel),
                    {"values_ptr": "*fp32", "indices_ptr": "*i32", "bounds_ptr": "*i32",
                     "bad_ptr": "*i32", "addend_ptr": "*i16" if addend == "*bf16" else addend or "*fp32",
                     "out_ptr": "*fp32", "n": "i32", "n_class": "i32", "world": "i32", "tiles": "i32",
                     "values_row": "i32", "indices_row": "i32", "addend_scale": "fp32",
                     "HAS_ADDEND": "constexpr", "ADDEND_BF16": "constexpr", "V_BF16": "constexpr",
                     "PART": "constexpr", "CHUNK": "constexpr", "GROUP": "constexpr",
                     "BLOCK": "constexpr"},
                    {"HAS_ADDEND": addend is not None, "ADDEND_BF16": addend == "*bf16",
                     "V_BF16": False, "PART": DECODE_PART, "CHUNK": chunk, "GROUP": DECODE_GROUP,
                     "BLOCK": DECODE_TILE},
                    config.num_warps,
                    aligned=("values_ptr", "indices_ptr", "bounds_ptr", "addend_ptr", "out_ptr", "n",
                             "values_row", "indices_row"),
                    wide=(HINTED_WIDE_STORES,) if addend is None else (WIDE_LOADS, HINTED_WIDE_STORES)))
    return cases
