"""top-k kernels under the interpreter: exactly k, the torch path's elements and residual (dense
decodes compared bit for bit), on the one-pass path and on both fallbacks; multi-rank scatter-add."""
import math

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from kernel_utils import assert_same_bits, backend, gradient, rank_payloads, residual_like

import gradcomp
from gradcomp.kernels import topk as kernels
from gradcomp.kernels.traffic import count_bytes


def few_specials(n, seed, dtype):
    """A gradient with one NaN and one -inf (many equal magnitudes would make the set ambiguous)."""
    x = gradient(n, seed)
    if n >= 4:
        x[n // 3], x[n // 2] = float("nan"), -float("inf")
    return x.to(dtype)


def dense(values, indices, n):
    return torch.zeros(n).index_put_((indices.long(),), values.float())


@settings(max_examples=12, deadline=None)
@given(n=st.one_of(st.integers(1, 50), st.integers(30000, 90000)), seed=st.integers(0, 2**16),
       ratio=st.sampled_from([0.001, 0.01, 0.1]), feedback=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       where=st.sampled_from(["estimate", "too high", "too low", "exact"]))
@example(n=(1 << 20) + 1, seed=5, ratio=0.01, feedback=True, dtype=torch.float32, where="estimate")
def test_exact_top_k_for_any_threshold(n, seed, ratio, feedback, dtype, where):
    """Whatever the threshold (a good estimate, above every element, below all of them: the
    candidate buffer overflows, or none: the exact path), the result is the exact top k and the
    residual is the torch one (the NaN and -inf zeroed in it)."""
    x = few_specials(n, seed, dtype)
    method = gradcomp.get_method("topk", ratio=ratio)
    k = method.k(n)
    residual = residual_like(n, seed) if feedback else None
    expected_residual = residual.clone() if feedback else None
    with backend("torch"):
        expected = method.compress(x, expected_residual)
    c = x.float() + (residual if feedback else 0)
    magnitudes = c.abs().nan_to_num(math.inf).sort(descending=True).values
    threshold = {"estimate": magnitudes[min(n - 1, int(k * 1.1))], "too high": torch.tensor(math.inf),
                 "too low": torch.tensor(0.0), "exact": None}[where]
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


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match="k must be"):
        kernels.ef_topk(torch.ones(5), None, 6, None)


@pytest.mark.parametrize("threshold", [0.5, torch.tensor([0.5]), torch.tensor(0.5, dtype=torch.float64)])
def test_a_threshold_not_on_the_device_as_a_0d_fp32_tensor_is_refused(threshold):
    """The kernel reads the threshold from device memory: a Python number (which a caller would
    have read back from the device) or a tensor of another shape or dtype is an error."""
    with pytest.raises(ValueError, match="threshold must be None or a 0-d float32 tensor"):
        kernels.ef_topk(torch.ones(5), None, 2, threshold)
