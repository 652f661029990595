"""PowerSGD kernels under the interpreter against the torch path, to fp32 summation-order
tolerance: P, Q and the residual of a step (with error feedback fused in), and the batched
Gram-Schmidt of ragged P matrices in one launch."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from kernel_utils import backend, gradient, residual_like

import gradcomp
from gradcomp.kernels import powersgd as kernels
from gradcomp.methods.powersgd import orthonormalize_

TOL = 2e-5  # relative to the largest entry: sums of up to ~1e5 fp32 products in another order


def assert_close(actual, expected, scale=None):
    scale = expected.abs().max().item() if scale is None else scale
    assert (actual - expected).abs().max().item() <= TOL * max(scale, 1e-30), \
        f"max diff {(actual - expected).abs().max().item()} vs scale {scale}"


@settings(max_examples=6, deadline=None)
@given(n=st.integers(8, 300), m=st.one_of(st.integers(40, 700), st.just(9000)),
       rank=st.integers(1, 8), seed=st.integers(0, 2**16), feedback=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_step_matches_torch(n, m, rank, seed, feedback, dtype):
    method = gradcomp.get_method("powersgd", rank=rank, seed=seed)
    if method.low_rank((n, m)) is None:
        return
    x = gradient(n * m, seed, dtype).view(n, m)
    residual = residual_like(n * m, seed) if feedback else None
    expected_residual = residual.clone() if feedback else None
    with backend("torch"):
        expected = method.compress(x, expected_residual, {})
    with backend("triton"):
        got = method.compress(x, residual, {})
    p, q = got.parts["p"], got.parts["q"]
    assert_close(p, expected.parts["p"], scale=1.0)
    assert_close(q, expected.parts["q"])
    if feedback:
        corrected = x.float().reshape(-1) + residual_like(n * m, seed)
        assert_close(residual, expected_residual, scale=corrected.abs().max().item())


def test_wide_matrix_splits_columns_across_programs():
    """A short, wide matrix is cut into column splits whose partial P meet in fp32 atomics."""
    n, m = 16, 40_000
    x, q0 = gradient(n * m, 1).view(n, m), torch.randn(m, 4)
    assert kernels._splits(n, m, kernels.MATMUL_CPU_CONFIG.kwargs["BLOCK_N"]) > 1
    assert_close(kernels.ef_matmul(x, None, q0), x @ q0)


def test_non_finite_gradient_never_enters_the_residual():
    x = gradient(64 * 500, 2).view(64, 500)
    x[3, 7] = float("nan")
    residual = residual_like(64 * 500, 2)
    with backend("triton"):
        p = gradcomp.get_method("powersgd").compress(x, residual).parts["p"]
    assert torch.isfinite(residual).all() and not torch.isfinite(p).all()


@settings(max_examples=6, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 1000), st.integers(1, 8)), min_size=1,
                       max_size=5),
       epsilon=st.sampled_from([0.0, 1e-8]), seed=st.integers(0, 2**16))
def test_batched_gram_schmidt_matches_per_matrix_reference(shapes, epsilon, seed):
    gen = torch.Generator().manual_seed(seed)
    matrices = [torch.randn(n, r, generator=gen) for n, r in shapes]
    matrices[0].zero_()  # an all-zero gradient must stay zero (no 0/0)
    flat = torch.cat([t.reshape(-1) for t in matrices])
    kernels.orthonormalize_batched_(flat, shapes, epsilon)
    offset = 0
    for t, (n, r) in zip(matrices, shapes):
        got = flat[offset:offset + n * r].view(n, r)
        assert_close(got, orthonormalize_(t.clone(), epsilon), scale=1.0)
        offset += n * r


def test_ranks_beyond_the_kernels_run_on_torch():
    x = gradient(200 * 300, 3).view(200, 300)
    method = gradcomp.get_method("powersgd", rank=kernels.MAX_RANK + 1)
    with backend("triton"):
        payload = method.compress(x)
    assert payload.parts["p"].shape == (200, kernels.MAX_RANK + 1)
    with pytest.raises(ValueError, match="ranks"):
        kernels.ef_matmul(x, None, torch.zeros(300, kernels.MAX_RANK + 1))
