"""top-k kernels under the interpreter: exactly k, the torch path's elements and residual (dense
decodes compared bit for bit) when k to capacity candidates pass; when fewer or more pass, what
the kernels send instead (never read back to the host), with nothing lost to error feedback;
multi-rank scatter-add."""
import math

import pytest
import torch
from hypothesis import assume, example, given, settings, strategies as st
from kernel_utils import (ADDEND_DTYPES, ADDEND_SCALES, PRESCALES, assert_same_bits, backend, bits,
                          decoded_with_addend_on_each_path, gradient, rank_payloads, residual_like)

import gradcomp
from gradcomp.kernels import declared, topk as kernels
from gradcomp.kernels.traffic import count_bytes


def few_specials(n, seed, dtype):
    """A gradient with one NaN and one -inf (many equal magnitudes would make the set ambiguous)."""
    x = gradient(n, seed)
    if n >= 4:
        x[n // 3], x[n // 2] = float("nan"), -float("inf")
    return x.to(dtype)


def dense(values, indices, n):
    return torch.zeros(n).index_put_((indices.long(),), values.float())


def corrected(x, residual):
    """c = x + residual in fp32, as the candidate pass computes it."""
    return x.float() + (residual if residual is not None else 0)


def passing(c, threshold):
    """Ascending indices of the elements the candidate pass keeps: finite |c| >= threshold and
    every non-finite c (those in their own slots), as (finite ones, non-finite ones)."""
    finite = torch.isfinite(c)
    return (torch.nonzero(finite & (c.abs() >= threshold)).flatten(),
            torch.nonzero(~finite).flatten())


def assert_conserved(c, residual, values, indices):
    """Error feedback loses nothing: residual + decoded payload = c wherever c is finite (the
    sent values are c rounded to x's dtype and the residual keeps c - sent, both exact in
    fp32); every non-finite c is sent as is and zeroed in the residual."""
    decoded = torch.zeros(c.numel()).index_add_(0, indices.long(), values.float())
    finite = torch.isfinite(c)
    assert torch.equal((residual + decoded)[finite], c[finite])
    assert_same_bits(decoded[~finite], c[~finite])
    assert not residual[~finite].any()


def threshold_at(c, rank):
    """The rank-th largest finite |c| (0: the largest) as a 0-d fp32 tensor; inf for rank -1."""
    finite = c[torch.isfinite(c)].abs().sort(descending=True).values
    return torch.tensor(math.inf) if rank < 0 else finite[rank].clone()


@settings(max_examples=12, deadline=None)
@given(n=st.one_of(st.integers(1, 50), st.integers(30000, 90000)), seed=st.integers(0, 2**16),
       ratio=st.sampled_from([0.001, 0.01, 0.1]), feedback=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       where=st.sampled_from(["estimate", "all pass", "exact"]))
@example(n=(1 << 20) + 1, seed=5, ratio=0.01, feedback=True, dtype=torch.float32, where="estimate")
def test_exact_top_k_when_k_to_capacity_pass(n, seed, ratio, feedback, dtype, where):
    """Whatever the threshold that lets between k and the candidate buffer's capacity through
    (a good estimate; below every element when the buffer holds all n; none: the exact path),
    the result is the exact top k, k distinct indices, and the residual is the torch one (the
    NaN and -inf zeroed in it)."""
    x = few_specials(n, seed, dtype)
    method = gradcomp.get_method("topk", ratio=ratio)
    k = method.k(n)
    if where == "all pass":
        assume(declared.candidate_capacity(n, k) == n)
    residual = residual_like(n, seed) if feedback else None
    expected_residual = residual.clone() if feedback else None
    with backend("torch"):
        expected = method.compress(x, expected_residual)
    magnitudes = corrected(x, residual).abs().nan_to_num(math.inf).sort(descending=True).values
    threshold = {"estimate": magnitudes[min(n - 1, int(k * 1.1))], "all pass": torch.tensor(0.0),
                 "exact": None}[where]
    values, indices = kernels.ef_topk(x, residual, k, threshold)
    assert values.shape == (k,) and values.dtype == dtype and indices.dtype == torch.int32
    assert indices.unique().numel() == k
    if feedback or dtype == torch.float32:  # fp32 magnitudes: no ties, one right answer
        assert_same_bits(dense(values, indices, n), dense(expected.parts["values"],
                                                          expected.parts["indices"], n))
    else:  # 16-bit inputs repeat magnitudes: any k of the tied ones will do
        got, want = values.float().abs(), expected.parts["values"].float().abs()
        assert_same_bits(got.sort().values, want.sort().values)
        assert_same_bits(values, x[indices.long()])
    if feedback:
        assert_same_bits(residual, expected_residual)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(2000, 70000), seed=st.integers(0, 2**16), ratio=st.sampled_from([0.01, 0.1]),
       feedback=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       data=st.data())
@example(n=3000, seed=1, ratio=0.01, feedback=True, dtype=torch.float32, data=None)
def test_fewer_than_k_pass_send_every_candidate_and_zero_fillers(n, seed, ratio, feedback, dtype,
                                                                 data):
    """A threshold too high (fewer than k pass; the example: above every finite element, so only
    the NaN and -inf pass): the payload holds every passing element with its value, and k - count
    fillers of value 0 at index 0; nothing is read back to choose another path. Error feedback
    keeps the rest: residual + decoded payload = x + old residual."""
    x = few_specials(n, seed, dtype)
    k = gradcomp.get_method("topk", ratio=ratio).k(n)
    residual = residual_like(n, seed) if feedback else None
    c = corrected(x, residual)
    threshold = threshold_at(c, -1 if data is None else data.draw(st.integers(-1, k - 4)))
    finite, nonfinite = passing(c, threshold)
    count = finite.numel() + nonfinite.numel()
    assume(count < k)  # ties among 16-bit magnitudes can let more through
    values, indices = kernels.ef_topk(x, residual, k, threshold)
    filler = (indices == 0) & (bits(values) == 0)  # a passing c is not 0: |c| >= threshold > 0
    assert int(filler.sum()) == k - count
    order = indices[~filler].argsort()
    want = torch.cat([finite, nonfinite]).sort().values
    assert torch.equal(indices[~filler][order].long(), want)
    assert_same_bits(values[~filler][order], c[want].to(dtype))
    if feedback:
        assert_conserved(c, residual, values, indices)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(20000, 70000), seed=st.integers(0, 2**16),
       ratio=st.sampled_from([0.001, 0.01]), feedback=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), data=st.data())
@example(n=30000, seed=2, ratio=0.01, feedback=True, dtype=torch.float32, data=None)
def test_more_than_capacity_pass_send_k_of_the_first_candidates(n, seed, ratio, feedback, dtype,
                                                                data):
    """A threshold too low (more finite candidates than the buffer holds; the example: 0, every
    element passes): k distinct elements are sent, every one at or above the threshold, every
    non-finite one among them (they have their own slots), the rest the largest of the first
    ``capacity`` finite candidates (ascending under the interpreter: its programs run in order);
    the residual keeps every element not sent."""
    x = few_specials(n, seed, dtype)
    k = gradcomp.get_method("topk", ratio=ratio).k(n)
    capacity = declared.candidate_capacity(n, k)
    residual = residual_like(n, seed) if feedback else None
    c = corrected(x, residual)
    rank = n - 3 if data is None else data.draw(st.integers(capacity, n - 3))
    threshold = torch.tensor(0.0) if data is None else threshold_at(c, rank)
    finite, nonfinite = passing(c, threshold)
    assert finite.numel() > capacity
    values, indices = kernels.ef_topk(x, residual, k, threshold)
    assert indices.unique().numel() == k
    assert_same_bits(values, c[indices.long()].to(dtype))
    sent = indices.long()
    assert set(nonfinite.tolist()) <= set(sent.tolist())
    sent_finite = sent[torch.isfinite(c[sent])]
    assert (c[sent_finite].abs() >= threshold).all()
    first = finite[:capacity]
    assert set(sent_finite.tolist()) <= set(first.tolist())
    largest = c[first].abs().topk(k - nonfinite.numel()).values
    assert_same_bits(c[sent_finite].abs().sort().values, largest.sort().values)
    if feedback:
        assert_conserved(c, residual, values, indices)


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


def magnitude_keys(c):
    """Sorted ordering keys of |c| (fp32 bits without the sign: NaN above inf above finite)."""
    return (c.view(torch.int32) & 0x7FFFFFFF).sort().values


def assert_exact_top_k(c, values, indices, residual, expected_indices):
    """k distinct indices whose |c| are the torch path's (``expected_indices``) up to ties among
    equal magnitudes, values c there in the payload's dtype; with error feedback nothing lost:
    residual + decoded = c where c is finite, 0 where it is not (sent or not)."""
    k = expected_indices.numel()
    assert values.shape == (k,) and indices.dtype == torch.int32
    assert indices.unique().numel() == k
    chosen = indices.long()
    assert torch.equal(magnitude_keys(c[chosen]), magnitude_keys(c[expected_indices.long()]))
    assert_same_bits(values, c[chosen].to(values.dtype))
    if residual is not None:
        decoded = torch.zeros(c.numel()).index_add_(0, chosen, values.float())
        finite = torch.isfinite(c)
        assert torch.equal((residual + decoded)[finite], c[finite])
        assert not residual[~finite].any()


@settings(max_examples=16, deadline=None)
@given(n=st.one_of(st.integers(1, 50), st.integers(2000, 70000)), seed=st.integers(0, 2**16),
       ratio=st.sampled_from([0.001, 0.01, 0.1]), feedback=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       prescale=st.sampled_from(PRESCALES),
       kind=st.sampled_from(["gaussian", "specials", "ties", "equal", "huge"]),
       where=st.sampled_from(["estimate", "fewer than k", "none", "more than capacity", "all"]),
       data=st.data())
@example(n=30000, seed=1, ratio=0.01, feedback=True, dtype=torch.float32, prescale=1.0,
         kind="gaussian", where="fewer than k", data=None)
@example(n=30000, seed=2, ratio=0.01, feedback=False, dtype=torch.bfloat16, prescale=0.5,
         kind="ties", where="estimate", data=None)
def test_exact_is_the_top_k_whatever_the_threshold(n, seed, ratio, feedback, dtype, prescale,
                                                   kind, where, data):
    """ef_topk(exact=True) with any threshold, the one its candidates hold the top k for or one
    they miss it with (fewer than k pass, none, more than the buffer holds, all), sends the
    torch path's exact top k up to ties, with the torch path's residual semantics."""
    x = adversarial(kind, n, seed, dtype)
    method = gradcomp.get_method("topk", ratio=ratio)
    k = method.k(n)
    capacity = declared.candidate_capacity(n, k)
    residual = residual_like(n, seed) if feedback else None
    c = x.float() * prescale + (residual if feedback else 0)
    with backend("torch"):
        expected = method.compress(x, residual.clone() if feedback else None, scale=prescale)
    finite = c[torch.isfinite(c)].abs().sort(descending=True).values
    rank = {"estimate": int(k * 1.1), "fewer than k": k // 2, "none": -1,
            "more than capacity": capacity + (n - capacity) // 2, "all": n}[where]
    if data is not None and where in ("fewer than k", "more than capacity"):
        rank = data.draw(st.integers(0, k - 1) if where == "fewer than k"
                         else st.integers(capacity, n))
    threshold = (torch.tensor(math.inf) if rank < 0 or not finite.numel()
                 else torch.tensor(0.0) if rank >= finite.numel() else finite[rank].clone())
    values, indices = kernels.ef_topk(x, residual, k, threshold, prescale, exact=True)
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


def fallback_ran(traffic, n):
    """Whether the radix select ran: its first histogram moved more than the counts' 8 bytes
    per program."""
    moved = [b for name, b in traffic.launches if name == "topk_radix_hist_kernel"]
    programs = math.ceil(n / kernels.CPU_CONFIG.kwargs["BLOCK"])
    assert len(moved) == 2 and moved[1] >= 8 * programs
    return moved[0] > 8 * programs


@pytest.mark.parametrize("kind, runs", [("gaussian", False), ("equal", True), ("ties", True)])
def test_the_radix_select_runs_only_where_the_sample_missed(kind, runs):
    """The same launches whatever the data; the radix select's kernels read the counts and stop
    where the candidates hold the top k (gaussian, a sample of 4096), and run where the sampled
    threshold lets the whole tensor through (+-1, or seven values at 1%: more than the buffer
    holds), both exact."""
    n = 100_003
    x, residual = adversarial(kind, n, 4, torch.float32), residual_like(n, 4)
    method = gradcomp.get_method("topk", ratio=0.01, sample=4096)
    c = x + residual if kind == "gaussian" else x
    with backend("torch"):
        expected = method.compress(x, residual.clone() if kind == "gaussian" else None)
    with backend("triton"), count_bytes() as traffic:
        got = method.compress(x, residual if kind == "gaussian" else None)
    assert fallback_ran(traffic, n) == runs
    assert_exact_top_k(c, got.parts["values"], got.parts["indices"],
                       residual if kind == "gaussian" else None, expected.parts["indices"])


def test_a_finite_gradient_costs_no_zeroing_pass():
    """The non-finite zeroing reads the candidate pass's count on the device and stops when it is
    0: 4 bytes per program for a finite gradient; a pass over the residual when one was not."""
    n, k = 3 * 32768 + 5, 100
    programs = math.ceil(n / kernels.CPU_CONFIG.kwargs["BLOCK"])
    for specials in (False, True):
        x = few_specials(n, 3, torch.float32) if specials else gradient(n, 3)
        residual = residual_like(n, 3)
        with count_bytes() as traffic:
            kernels.ef_topk(x, residual, k, None)
        moved = dict(traffic.launches)["zero_nonfinite_kernel"]
        if specials:  # the count and the residual read (NaN and -inf were sent, the gather
            assert moved == 4 * programs + 4 * n  # zeroed them there: nothing left to write)
        else:
            assert moved == 4 * programs
        assert torch.isfinite(residual).all()


def test_threshold_selector_sends_what_torch_sends():
    """Same sample, same threshold: the same elements and values (the order within the payload
    may differ), the same residual and the same step counter."""
    x, residual = gradient(300_000, 8), residual_like(300_000, 8)
    method = gradcomp.get_method("topk", ratio=0.01, selector="threshold", sample=1024, seed=3)
    torch_residual, state_torch, state_triton = residual.clone(), {}, {}
    with backend("torch"):
        expected = method.compress(x, torch_residual, state_torch)
    with backend("triton"):
        got = method.compress(x, residual, state_triton)
    order, expected_order = got.parts["indices"].argsort(), expected.parts["indices"].argsort()
    for name in ("values", "indices"):
        assert_same_bits(got.parts[name][order], expected.parts[name][expected_order])
    assert_same_bits(residual, torch_residual)
    assert state_torch == state_triton == {"step": 1}


@settings(max_examples=10, deadline=None)
@given(n=st.one_of(st.integers(300, 2000), st.integers(30000, 300_000)), seed=st.integers(0, 2**16),
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
@settings(max_examples=6, deadline=None)
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


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match="k must be"):
        kernels.ef_topk(torch.ones(5), None, 6, None)


@pytest.mark.parametrize("threshold", [0.5, torch.tensor([0.5]), torch.tensor(0.5, dtype=torch.float64)])
def test_a_threshold_not_on_the_device_as_a_0d_fp32_tensor_is_refused(threshold):
    """The kernel reads the threshold from device memory: a Python number (which a caller would
    have read back from the device) or a tensor of another shape or dtype is an error."""
    with pytest.raises(ValueError, match="threshold must be None or a 0-d float32 tensor"):
        kernels.ef_topk(torch.ones(5), None, 2, threshold)
