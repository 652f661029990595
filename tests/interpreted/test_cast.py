"""fp16/bf16 kernels under the interpreter against the torch path: bit-exact values and residuals."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from kernel_utils import (ADDEND_DTYPES, ADDEND_SCALES, PRESCALES, assert_same_bits, backend,
                          compressed_scaled_on_each_path, decoded_with_addend_on_each_path, gradient,
                          rank_payloads, residual_like)

import gradcomp
from gradcomp.kernels import cast as kernels

SIZES = st.one_of(st.integers(1, 40), st.integers(32760, 70000))
IN_DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64])
WIRES = st.sampled_from(["fp16", "bf16"])


@settings(max_examples=12, deadline=None)
@given(n=SIZES, seed=st.integers(0, 2**16), wire=WIRES, dtype=IN_DTYPES,
       scale=st.sampled_from([1.0, 0.25, 1 / 3]), feedback=st.booleans())
@example(n=(1 << 20) + 3, seed=1, wire="bf16", dtype=torch.float32, scale=1 / 3, feedback=True)
def test_ef_cast_matches_torch_bit_for_bit(n, seed, wire, dtype, scale, feedback):
    x = gradient(n, seed, dtype, specials=True, scale=3e4)
    residual = residual_like(n, seed) if feedback else None
    method = gradcomp.get_method(wire, scale=scale)
    expected_residual = residual.clone() if feedback else None
    with backend("torch"):
        expected = method.compress(x, expected_residual).parts["values"]
    values = kernels.ef_cast(x, residual, scale, method.wire_dtype)
    assert_same_bits(values, expected)
    if feedback:
        assert_same_bits(residual, expected_residual)
        assert torch.isfinite(residual).all()


@settings(max_examples=10, deadline=None)
@given(n=SIZES, seed=st.integers(0, 2**16), wire=WIRES, dtype=IN_DTYPES, prescale=st.sampled_from(PRESCALES),
       wire_scale=st.sampled_from([1.0, 1 / 3]), feedback=st.booleans())
def test_compress_scale_is_the_fp32_product_on_both_paths(n, seed, wire, dtype, prescale,
                                                          wire_scale, feedback):
    """compress(x, residual, scale=s) equals compress(x.float() * s, residual) bit for bit on the
    torch path and in the kernel (s multiplied right after the load, before the residual is
    added), and the two paths agree."""
    method = gradcomp.get_method(wire, scale=wire_scale)
    payloads = compressed_scaled_on_each_path(method, gradient(n, seed, dtype, specials=True, scale=3e4),
                                              seed, prescale, feedback, ("values",))
    assert_same_bits(payloads["triton"].parts["values"], payloads["torch"].parts["values"])


@settings(max_examples=8, deadline=None)
@given(n=SIZES, world=st.integers(1, 4), seed=st.integers(0, 2**16), wire=WIRES,
       out_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_decode_sums_ranks_in_order(n, world, seed, wire, out_dtype):
    method = gradcomp.get_method(wire, scale=0.5)
    _, expected, parts = rank_payloads(
        method, [gradient(n, seed + w, specials=w == 0) for w in range(world)])
    assert_same_bits(kernels.cast_decode_sum(parts["values"], 0.5, out_dtype), expected.to(out_dtype))


def test_decode_writes_into_out_and_rejects_bad_shapes():
    values = torch.ones(2, 10, dtype=torch.float16)
    out = torch.empty(10, dtype=torch.float64)
    result = kernels.cast_decode_sum(values, 1.0, out=out)
    assert result.data_ptr() == out.data_ptr() and out.eq(2).all()
    try:
        kernels.cast_decode_sum(values.view(-1), 1.0)
    except ValueError as err:
        assert "[world, n]" in str(err)
    else:
        raise AssertionError("1-D values accepted")


@pytest.mark.parametrize("addend_dtype", ADDEND_DTYPES)
@settings(max_examples=6, deadline=None)
@given(n=SIZES, rows=st.sampled_from([0, 1, 3]), seed=st.integers(0, 2**16),
       addend_scale=st.sampled_from(ADDEND_SCALES), out_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       wire=WIRES)
@example(n=33, rows=0, seed=1, addend_scale=1 / 3, out_dtype=torch.float32, wire="fp16")
@example(n=40000, rows=3, seed=2, addend_scale=0.5, out_dtype=torch.float32, wire="bf16")
@example(n=7, rows=1, seed=3, addend_scale=1.0, out_dtype=torch.bfloat16, wire="fp16")
def test_decode_sum_starts_from_the_scaled_addend(addend_dtype, n, rows, seed, addend_scale,
                                                  out_dtype, wire):
    """decode_sum(rows, addend=a, addend_scale=s): fp32(a) * fp32(s), then each rank's row in
    order, on both paths and in the kernel launcher (0 rows included), bit for bit."""
    method = gradcomp.get_method(wire, scale=0.5)
    decoded_with_addend_on_each_path(
        method, [gradient(n, seed + w, specials=w == 0) for w in range(rows)],
        gradient(n, seed + 99, addend_dtype, specials=True), addend_scale, out_dtype,
        kernel=lambda parts, out, addend, s: kernels.cast_decode_sum(
            parts["values"], 0.5, out=out, addend=addend, addend_scale=s))


def test_decode_sum_refuses_a_bad_addend():
    values = torch.ones(2, 10, dtype=torch.float16)
    for addend, message in ((torch.ones(11), "addend must have 10 elements"),
                            (torch.ones(20)[::2], "addend must be contiguous"),
                            (torch.ones(10, dtype=torch.int32), "addend must have dtype in")):
        with pytest.raises((TypeError, ValueError), match=message):
            kernels.cast_decode_sum(values, 1.0, addend=addend)
