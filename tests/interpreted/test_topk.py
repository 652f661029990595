"""top-k kernels under the interpreter: whatever the sample, the exact top k (ties toward lower
indices) in ascending order, the torch path's magnitudes and residual, nothing lost to error
feedback, never read back to the host; multi-rank scatter-add."""

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from kernel_utils import (ADDEND_DTYPES, ADDEND_SCALES, PRESCALES, assert_same_bits, backend,
                          decoded_with_addend_on_each_path, gradient, rank_payloads, residual_like)

import gradcomp
from gradcomp.kernels import declared, topk as kernels
from gradcomp.kernels.traffic import count_bytes
from gradcomp.methods.topk import sample_rank


def few_specials(n, seed, dtype):
    """A gradient with one NaN and one -inf (many equal magnitudes would make the set ambiguous)."""
    x = gradient(n, seed)
    if n >= 4:
        x[n // 3], x[n // 2] = float("nan"), -float("inf")
    return x.to(dtype)


def corrected(x, residual):
    """c = x + residual in fp32, as the candidate pass computes it."""
    return x.float() + (residual if residual is not None else 0)


def assert_conserved(c, residual, values, indices):
    """Error feedback loses nothing: residual + decoded payload = c wherever c is finite (the
    sent values are c rounded to x's dtype and the residual keeps c - sent, both exact in
    fp32); every non-finite c is sent as is and zeroed in the residual."""
    decoded = torch.zeros(c.numel()).index_add_(0, indices.long(), values.float())
    finite = torch.isfinite(c)
    assert torch.equal((residual + decoded)[finite], c[finite])
    assert_same_bits(decoded[~finite], c[~finite])
    assert not residual[~finite].any()


def adversarial(kind, n, seed, dtype):
    """Inputs for the exact selector: "gaussian" (one NaN and one -inf), "specials" (NaN and
    +-inf, 3/64 of the elements: more non-finite values than k), "ties" (seven values, so the
    k-th magnitude is shared by thousands), "equal" (+-1 only: every threshold passes all or
    none), "huge" (about n / 500 values 1e4 times the rest, which a small sample misses)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return few_specials(n, seed, dtype)
    if kind == "specials":
        return gradient(n, seed, dtype, specials=True)
    if kind == "ties":
        x = torch.randint(-3, 4, (n,), generator=gen).float()
    elif kind == "equal":
        x = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    else:
        x = gradient(n, seed) * 1e-3
        x[torch.randint(n, (max(1, n // 500),), generator=gen)] = 10.0
    return x.to(dtype)


def keys_of(c):
    """The kernels' ordering keys of |c|: fp32 bits without the sign, every NaN 0x7FFFFFFF (above
    inf above finite; NaNs alike whatever their payload bits)."""
    keys = c.view(torch.int32) & 0x7FFFFFFF
    return torch.where(c.isnan(), 0x7FFFFFFF, keys)


def magnitude_keys(c):
    """Sorted ordering keys of |c| (:func:`keys_of`)."""
    return keys_of(c).sort().values


def assert_exact_top_k(c, values, indices, residual, expected_indices):
    """The kernels' payload: the k elements with the largest magnitude keys, the ties at the
    k-th taken from the lowest indices, in ascending order (so exactly one right answer), whose
    magnitudes are the torch path's (``expected_indices``: its ties may differ); values c there
    in the payload's dtype; with error feedback nothing lost: residual + decoded = c where c is
    finite, 0 where it is not (sent or not)."""
    k = expected_indices.numel()
    assert values.shape == (k,) and indices.dtype == torch.int32
    keys = keys_of(c)
    boundary = keys.sort(descending=True).values[k - 1] if k else 2**31 - 1
    above = torch.nonzero(keys > boundary).flatten()
    ties = torch.nonzero(keys == boundary).flatten()[:k - above.numel()]
    assert torch.equal(indices.long(), torch.cat([above, ties]).sort().values)
    chosen = indices.long()
    assert torch.equal(magnitude_keys(c[chosen]), magnitude_keys(c[expected_indices.long()]))
    assert_same_bits(values, c[chosen].to(values.dtype))
    if residual is not None:
        decoded = torch.zeros(c.numel()).index_add_(0, chosen, values.float())
        finite = torch.isfinite(c)
        assert torch.equal((residual + decoded)[finite], c[finite])
        assert not residual[~finite].any()


@settings(max_examples=12, deadline=None)
@given(n=st.one_of(st.integers(1, 50), st.integers(2000, 70000)), seed=st.integers(0, 2**16),
       ratio=st.sampled_from([0.001, 0.01, 0.1]), feedback=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       prescale=st.sampled_from(PRESCALES),
       kind=st.sampled_from(["gaussian", "specials", "ties", "equal", "huge"]),
       sample=st.sampled_from([0, 64, declared.MAX_SAMPLE]), data=st.data())
@example(n=30000, seed=1, ratio=0.01, feedback=True, dtype=torch.float32, prescale=1.0,
         kind="gaussian", sample=4096, data=None)
@example(n=30000, seed=2, ratio=0.01, feedback=False, dtype=torch.bfloat16, prescale=0.5,
         kind="ties", sample=64, data=None)
def test_the_top_k_whatever_the_sample(n, seed, ratio, feedback, dtype, prescale, kind, sample,
                                       data):
    """ef_topk with any sample and threshold rank (one its candidates hold the top k for, or
    one they miss it with: fewer than k pass, more than the buffer holds, none sampled) sends the
    exact top k, ties toward lower indices, in ascending order, with the torch path's residual
    semantics. The examples: the method's rank (the candidates hold the top k), and 7 values at
    1% (the buffer overflows)."""
    x = adversarial(kind, n, seed, dtype)
    method = gradcomp.get_method("topk", ratio=ratio)
    k = method.k(n)
    residual = residual_like(n, seed) if feedback else None
    c = x.float() * prescale + (residual if feedback else 0)
    with backend("torch"):
        expected = method.compress(x, residual.clone() if feedback else None, scale=prescale)
    sample = min(sample, n)
    rank = (sample_rank(n, k, sample) if data is None
            else data.draw(st.integers(min(1, sample), sample)))
    sample = sample if rank else 0
    values, indices = kernels.ef_topk(x, residual, k, prescale, sample, rank, seed)
    assert values.dtype == dtype
    assert_exact_top_k(c, values, indices, residual, expected.parts["indices"])


@settings(max_examples=12, deadline=None)
@given(n=st.integers(2000, 90000), seed=st.integers(0, 2**16), ratio=st.sampled_from([0.001, 0.01]),
       feedback=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       prescale=st.sampled_from(PRESCALES), sample=st.sampled_from([64, 65536]),
       kind=st.sampled_from(["gaussian", "specials", "ties", "equal", "huge"]))
def test_exact_selector_on_the_kernels_sends_the_torch_set(n, seed, ratio, feedback, dtype,
                                                            prescale, sample, kind):
    """The method's exact selector on the kernels (its sampled threshold, the radix select where
    the sample missed: a sample of 64 often does, ties and +-1 always overflow the buffer) and
    on the torch path send the same top k up to ties; the residual keeps the rest."""
    x = adversarial(kind, n, seed, dtype)
    method = gradcomp.get_method("topk", ratio=ratio, sample=sample, seed=seed)
    residual = residual_like(n, seed) if feedback else None
    c = x.float() * prescale + (residual if feedback else 0)
    with backend("torch"):
        expected = method.compress(x, residual.clone() if feedback else None, scale=prescale)
    state = {}
    with backend("triton"):
        got = method.compress(x, residual, state, scale=prescale)
    assert state == {}  # the exact selector keeps no step counter
    assert_exact_top_k(c, got.parts["values"], got.parts["indices"], residual,
                       expected.parts["indices"])


def read_c(traffic, n):
    """Whether the select kernels read c itself: the first histogram launch (the rest of the top
    histogram) moved at least 4 bytes per element (where the candidates hold the top k it reads
    the count and stops)."""
    moved = [b for name, b in traffic.launches if name == "topk_radix_hist_kernel"]
    assert len(moved) == 2
    return moved[0] >= 4 * n


@pytest.mark.parametrize("kind, missed", [("gaussian", False), ("equal", True), ("ties", True)])
def test_the_select_reads_c_only_where_the_sample_missed(kind, missed):
    """The same launches whatever the data; the select kernels read the candidates where they
    hold the top k (gaussian), and c itself where the sampled threshold lets the whole tensor
    through (+-1, or seven values at 1%: more than the buffer holds), both exact."""
    n = 100_003
    x, residual = adversarial(kind, n, 4, torch.float32), residual_like(n, 4)
    method = gradcomp.get_method("topk", ratio=0.01, sample=4096)
    c = x + residual if kind == "gaussian" else x
    with backend("torch"):
        expected = method.compress(x, residual.clone() if kind == "gaussian" else None)
    with backend("triton"), count_bytes() as traffic:
        got = method.compress(x, residual if kind == "gaussian" else None)
    assert read_c(traffic, n) == missed
    assert_exact_top_k(c, got.parts["values"], got.parts["indices"],
                       residual if kind == "gaussian" else None, expected.parts["indices"])


def test_threshold_selector_sends_what_torch_sends():
    """Another sample (the kernels' own), the same top k (no ties in a gaussian): the same
    elements, values and residual, and the same step counter."""
    x, residual = gradient(300_000, 8), residual_like(300_000, 8)
    method = gradcomp.get_method("topk", ratio=0.01, selector="threshold", sample=1024, seed=3)
    torch_residual, state_torch, state_triton = residual.clone(), {}, {}
    with backend("torch"):
        expected = method.compress(x, torch_residual, state_torch)
    with backend("triton"):
        got = method.compress(x, residual, state_triton)
    for name in ("values", "indices"):
        assert_same_bits(got.parts[name], expected.parts[name])
    assert_same_bits(residual, torch_residual)
    assert state_torch == state_triton == {"step": 1}


@settings(max_examples=10, deadline=None)
@given(n=st.one_of(st.integers(300, 2000), st.integers(30000, 120_000)), seed=st.integers(0, 2**16),
       selector=st.sampled_from(["exact", "threshold"]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       prescale=st.sampled_from(PRESCALES), feedback=st.booleans())
def test_compress_scale_is_the_fp32_product_on_both_paths(n, seed, selector, dtype, prescale, feedback):
    """compress(x, residual, scale=s) selects from c = fp32(x.float() * s) + residual: on both
    paths the same elements, values and residual as compressing that product (values rounded to
    x's dtype, which the payload keeps), and the two paths agree (up to ties among equal
    magnitudes)."""
    x = few_specials(n, seed, dtype)
    method = gradcomp.get_method("topk", ratio=0.01, selector=selector, sample=1024, seed=5)
    sent = {}
    for path in ("torch", "triton"):
        residual = residual_like(n, seed) if feedback else None
        expected_residual = residual.clone() if feedback else None
        with backend(path):
            got = method.compress(x, residual, scale=prescale)
            expected = method.compress(x.float() * prescale, expected_residual)
        order, expected_order = got.parts["indices"].argsort(), expected.parts["indices"].argsort()
        assert_same_bits(got.parts["indices"][order], expected.parts["indices"][expected_order])
        assert got.parts["values"].dtype == dtype
        assert_same_bits(got.parts["values"][order], expected.parts["values"][expected_order].to(dtype))
        if feedback:  # what the 16-bit value did not carry stays owed
            c = x.float() * prescale + residual_like(n, seed)
            assert_conserved(c, residual, got.parts["values"], got.parts["indices"])
            if dtype == torch.float32:
                assert_same_bits(residual, expected_residual)
        sent[path] = got
    if feedback or dtype == torch.float32:  # fp32 magnitudes: no ties, one right answer
        order = {path: sent[path].parts["indices"].argsort() for path in sent}
        for name in ("values", "indices"):
            assert_same_bits(sent["triton"].parts[name][order["triton"]],
                             sent["torch"].parts[name][order["torch"]])
    else:  # 16-bit magnitudes repeat: the paths may break a tie at the k-th differently
        got, want = (sent[path].parts["values"].float().abs().sort().values for path in ("triton", "torch"))
        assert_same_bits(got, want)


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 70000), world=st.integers(1, 3), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_scatter_add_sums_ranks(n, world, seed, dtype):
    method = gradcomp.get_method("topk", ratio=0.05)
    _, expected, parts = rank_payloads(
        method, [few_specials(n, seed + w, dtype) for w in range(world)])
    values, indices = parts["values"], parts["indices"]
    assert_same_bits(kernels.scatter_add_sum(values, indices, n), expected)
    assert_same_bits(kernels.scatter_add_sum(values, indices, n, dtype), expected.to(dtype))


@settings(max_examples=10, deadline=None)
@given(n=st.one_of(st.integers(1, 50), st.integers(30000, 90000)), seed=st.integers(0, 2**16),
       selector=st.sampled_from(["exact", "threshold"]), ratio=st.sampled_from([0.001, 0.05]),
       feedback=st.booleans(), path=st.sampled_from(["torch", "triton"]))
def test_payload_indices_strictly_ascend(n, seed, selector, ratio, feedback, path):
    """The payload contract the tile decode relies on: indices in [0, n), strictly ascending,
    values at their positions, on both paths and both selectors."""
    method = gradcomp.get_method("topk", ratio=ratio, selector=selector)
    x = gradient(n, seed)
    residual = residual_like(n, seed) if feedback else None
    c = corrected(x, residual)
    with backend(path):
        payload = method.compress(x, residual)
    indices = payload.parts["indices"].long()
    assert indices.numel() == method.k(n)
    assert (indices[1:] > indices[:-1]).all() and indices.min() >= 0 and indices.max() < n
    assert_same_bits(payload.parts["values"], c[indices])


def rank_rows(n, k, world, seed, kinds):
    """[world, k] int32 indices and fp32 values: per rank ``kinds[w]``: "sorted" (distinct,
    ascending in [0, n)), "descending" (the same reversed), or "any" (random in [-3, n + 3):
    repeats, disorder, entries outside the tensor)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for kind in kinds:
        if kind == "any":
            rows.append(torch.randint(-3, n + 3, (k,), generator=gen))
        else:
            chosen = torch.randperm(n, generator=gen)[:k].sort().values
            rows.append(chosen.flip(0) if kind == "descending" else chosen)
    return torch.stack(rows).int(), torch.randn(world, k, generator=gen)


def row_order_sum(indices, values, n):
    """The torch path's decode-sum: every rank's entries in [0, n) added in row order."""
    inside = (indices >= 0) & (indices < n)
    return torch.zeros(n).index_add_(0, indices[inside].long(), values[inside])


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 60000), k=st.integers(0, 600), seed=st.integers(0, 2**16),
       kinds=st.lists(st.sampled_from(["sorted", "sorted", "descending", "any"]), min_size=1,
                      max_size=3))
@example(n=3 * declared.DECODE_TILE + 5, k=500, seed=1, kinds=["sorted", "any", "sorted"])
@example(n=declared.DECODE_TILE * 2, k=1, seed=2, kinds=["sorted", "sorted"])
def test_tile_decode_sums_sorted_ranks_in_row_order_and_the_rest_by_atomics(n, k, seed, kinds):
    """Ranks with sorted indices are summed by the tile decode, bit for bit the row-order sum
    (deterministic: no atomics, over tile boundaries too); a rank whose indices repeat, are out
    of order or leave the tensor is added after them by the atomic fallback (the same sum up to
    the order of fp32 additions), its entries outside [0, n) dropped and counted."""
    k = min(k, n)  # a sorted rank holds distinct indices
    indices, values = rank_rows(n, k, len(kinds), seed, kinds)
    dropped = torch.zeros(len(kinds), dtype=torch.int64)
    got = kernels.scatter_add_sum(values, indices, n, dropped=dropped)
    expected = row_order_sum(indices, values, n)
    assert dropped.tolist() == ((indices < 0) | (indices >= n)).sum(dim=1).tolist()
    if all(kind == "sorted" for kind in kinds):
        assert_same_bits(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@settings(max_examples=10, deadline=None)
@given(world=st.integers(1, 9), tiles=st.integers(1, 3), tail=st.integers(-300, 300),
       density=st.sampled_from([0.002, 0.02, 0.2, 1.0]), shared=st.booleans(),
       failed=st.lists(st.integers(0, 8), max_size=2), bf16=st.booleans(), pad=st.integers(0, 7),
       seed=st.integers(0, 2**16))
@example(world=6, tiles=2, tail=5, density=1.0, shared=True, failed=[], bf16=False, pad=2, seed=6)
@example(world=5, tiles=2, tail=0, density=1.0, shared=True, failed=[2], bf16=False, pad=3, seed=1)
@example(world=9, tiles=1, tail=-1, density=0.2, shared=True, failed=[], bf16=False, pad=0, seed=5)
@example(world=8, tiles=1, tail=-1, density=0.2, shared=True, failed=[], bf16=True, pad=0, seed=2)
@example(world=7, tiles=3, tail=17, density=0.02, shared=True, failed=[4, 6], bf16=False, pad=1, seed=3)
def test_tile_decode_groups_of_four_ranks(world, tiles, tail, density, shared, failed, bf16, pad,
                                          seed):
    """The tile decode's groups of 4 ranks: 1-9 ranks (the last group short), tiles whose rank
    holds more entries than a chunk (up to every output: its further chunks' loop), ranks that
    share indices (the row order decides each sum's rounding), a failed rank (descending:
    added by the atomics after the others) anywhere in a group, bf16 values, rows strided
    apart by a padding (a gathered buffer): sorted ranks bit for bit the row-order sum (fp32
    values of ranks sharing indices: a rank added out of its place in the group changes the
    rounding, which the all-sorted fp32 examples catch)."""
    n = max(1, tiles * declared.DECODE_TILE + tail)
    k = max(1, min(n, round(density * n)))
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(n, generator=gen)[:min(n, 2 * k)]  # shared: every rank draws from it
    rows = []
    for w in range(world):
        chosen = (pool[torch.randperm(pool.numel(), generator=gen)[:k]] if shared
                  else torch.randperm(n, generator=gen)[:k]).sort().values
        rows.append(chosen.flip(0) if w in failed and k > 1 else chosen)
    dtype = torch.bfloat16 if bf16 else torch.float32
    buffer = torch.randn(world, k + pad, generator=gen).to(dtype)
    index_buffer = torch.zeros(world, k + pad, dtype=torch.int32)
    index_buffer[:, :k] = torch.stack(rows).int()
    values, indices = buffer[:, :k], index_buffer[:, :k]
    got = kernels.scatter_add_sum(values, indices, n)
    expected = row_order_sum(indices, values.float(), n)
    if any(w in failed for w in range(world)) and k > 1:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        assert_same_bits(got, expected)


@pytest.mark.parametrize("kinds", [["sorted", "sorted"], ["sorted", "descending"]])
def test_only_a_rank_that_fails_the_check_takes_the_atomic_fallback(kinds):
    """The bytes say which path added each rank (scatter_add_sum_bytes, bad_ranks): sorted ranks
    by the tile decode, the descending one (distinct, inside the tensor) by the atomics."""
    n, k = 2 * declared.DECODE_TILE + 100, 5000
    indices, values = rank_rows(n, k, len(kinds), 3, kinds)
    with count_bytes() as traffic:
        got = kernels.scatter_add_sum(values, indices, n)
    torch.testing.assert_close(got, row_order_sum(indices, values, n), rtol=1e-6, atol=1e-6)
    assert traffic.total == declared.scatter_add_sum_bytes(n, k, len(kinds), 4, 4,
                                                          bad_ranks=kinds.count("descending"))


@pytest.mark.parametrize("addend_dtype", ADDEND_DTYPES)
@settings(max_examples=2, deadline=None)  # the examples: 0 rows, many rows, bf16 out
@given(n=st.one_of(st.integers(1, 50), st.integers(30000, 70000)), rows=st.integers(0, 3),
       seed=st.integers(0, 2**16), addend_scale=st.sampled_from(ADDEND_SCALES),
       out_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
@example(n=33, rows=0, seed=1, addend_scale=1 / 3, out_dtype=torch.float32)
@example(n=40000, rows=3, seed=2, addend_scale=0.5, out_dtype=torch.float32)
@example(n=7, rows=1, seed=3, addend_scale=1.0, out_dtype=torch.bfloat16)
def test_decode_sum_starts_from_the_scaled_addend(addend_dtype, n, rows, seed, addend_scale,
                                                  out_dtype):
    """decode_sum(rows, addend=a, addend_scale=s) on the scatter-add: fp32(a) * fp32(s) (a as it
    is for s = 1; NaN, inf and values beyond fp16's range in a), then each rank's values at
    their indices in row order (the interpreter runs the atomics in order), bit for bit on both
    paths; 0 rows: the scaled addend."""
    decoded_with_addend_on_each_path(
        gradcomp.get_method("topk", ratio=0.05),
        [few_specials(n, seed + r, torch.float32) for r in range(rows)],
        gradient(n, seed + 99, addend_dtype, specials=True), addend_scale, out_dtype,
        kernel=lambda parts, out, addend, s: kernels.scatter_add_sum(
            parts["values"], parts["indices"], n, out.dtype, out, addend, s))


def test_decode_sum_refuses_a_bad_addend():
    values, indices = torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.int32)
    for addend, message in ((torch.ones(11), "addend must have 10 elements"),
                            (torch.ones(20)[::2], "addend must be contiguous"),
                            (torch.ones(10, dtype=torch.int32), "addend must have dtype in")):
        with pytest.raises((TypeError, ValueError), match=message):
            kernels.scatter_add_sum(values, indices, 10, addend=addend)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="k must be"):
        kernels.ef_topk(torch.ones(5), None, 6)
    for sample, rank in ((declared.MAX_SAMPLE * 2, 1), (64, 0), (64, 65), (0, 1)):
        with pytest.raises(ValueError, match="sample must be in"):
            kernels.ef_topk(torch.ones(100), None, 2, 1.0, sample, rank)
    with pytest.raises(TypeError, match="rank must be an int"):
        kernels.ef_topk(torch.ones(100), None, 2, 1.0, 64, 1.5)


@pytest.mark.parametrize("sample, rank, missed", [(64, 1, True), (64, 40, False), (4096, 4000, False),
                                                  (4096, 4090, True)])
def test_the_rest_of_the_top_histogram_counts_only_what_the_candidates_left(sample, rank, missed):
    """The magnitudes in two top-histogram buckets (1 + j 2^-20 for 30 of them, 0.5 + j 2^-21
    for the rest: within a bucket the keys differ in their low 16 bits only), so the k-th
    largest (k = 50) lies in the lower bucket and a sampled threshold near the top cuts the
    upper one: the candidate pass counts the keys at or above it, and where the candidates miss
    the top k (the lowest rank lets all through: more than the buffer holds; a rank near the
    top lets fewer than k through) the rest counts only the keys below it (counted twice, the
    upper bucket would seem to hold the k-th). Either way the exact top k."""
    n, k = 5000, 50
    gen = torch.Generator().manual_seed(rank)
    order = torch.randperm(n, generator=gen)
    magnitudes = torch.where(order < 30, 1.0 + order.float() * 2.0**-20, 0.5 + order.float() * 2.0**-21)
    signs = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    x = magnitudes * signs
    assert len(set((keys_of(x) >> 16).tolist())) == 2
    residual = torch.zeros(n)
    with count_bytes() as traffic:
        values, indices = kernels.ef_topk(x, residual, k, 1.0, sample, rank, rank)
    assert read_c(traffic, n) == missed
    assert_exact_top_k(x, values, indices, residual, x.abs().topk(k).indices)
