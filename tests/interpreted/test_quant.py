"""int8/int4 kernels under the interpreter against the torch path: round-to-nearest codes, scales
and residuals bit for bit; stochastic rounding reproducible and unbiased; multi-rank dequantize."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from kernel_utils import (assert_same_bits, assert_special_rows_decode_as_on_torch, backend, gradient,
                          rank_payloads, residual_like)

import gradcomp
from gradcomp.kernels import quant as kernels
from kernel_utils import (ADDEND_DTYPES, ADDEND_SCALES, PRESCALES, compressed_scaled_on_each_path,
                          decoded_with_addend_on_each_path, int4_codes)

SIZES = st.one_of(st.integers(1, 40), st.integers(32760, 70000))
METHODS = st.sampled_from(["int8", "int4"])
BLOCKS = st.sampled_from([2, 64, 100, 256, 4096])


def codes_to_float(codes, method, n, block):
    return (int4_codes(codes, n, block) if method == "int4" else codes).float()


@settings(max_examples=12, deadline=None)
@given(n=SIZES, seed=st.integers(0, 2**16), method=METHODS, block=BLOCKS,
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       feedback=st.booleans(), specials=st.booleans())
@example(n=(1 << 20) + 5, seed=3, method="int8", block=256, dtype=torch.float32, feedback=True,
         specials=True)
def test_round_to_nearest_matches_torch_bit_for_bit(n, seed, method, block, dtype, feedback,
                                                     specials):
    x = gradient(n, seed, dtype, specials=specials)
    m = gradcomp.get_method(method, block=block)
    residual = residual_like(n, seed) if feedback else None
    expected_residual = residual.clone() if feedback else None
    with backend("torch"):
        expected = m.compress(x, expected_residual)
    codes, scales = kernels.ef_quantize(x, residual, block, m.levels)
    assert_same_bits(codes, expected.parts["q"])
    assert_same_bits(scales, expected.parts["scales"])
    if feedback:
        assert_same_bits(residual, expected_residual)


@settings(max_examples=10, deadline=None)
@given(n=SIZES, seed=st.integers(0, 2**16), method=METHODS, block=BLOCKS,
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       prescale=st.sampled_from(PRESCALES), feedback=st.booleans())
def test_compress_scale_is_the_fp32_product_on_both_paths(n, seed, method, block, dtype,
                                                          prescale, feedback):
    """compress(x, residual, scale=s) equals compress(x.float() * s, residual) bit for bit on the
    torch path and in the kernel (s multiplied right after the load, before the residual is
    added), and the two paths agree."""
    m = gradcomp.get_method(method, block=block)
    payloads = compressed_scaled_on_each_path(m, gradient(n, seed, dtype, specials=True), seed,
                                              prescale, feedback, ("q", "scales"))
    for part in ("q", "scales"):
        assert_same_bits(payloads["triton"].parts[part], payloads["torch"].parts[part])


@settings(max_examples=8, deadline=None)
@given(n=SIZES, world=st.integers(1, 3), seed=st.integers(0, 2**16), method=METHODS,
       block=BLOCKS, out_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_dequantize_sums_ranks_in_order(n, world, seed, method, block, out_dtype):
    m = gradcomp.get_method(method, block=block)
    _, expected, parts = rank_payloads(
        m, [gradient(n, seed + w, specials=w == 1) for w in range(world)])
    out = kernels.dequantize_sum(parts["q"], parts["scales"], n, block, out_dtype)
    assert_same_bits(out, expected.to(out_dtype))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_stochastic_rounding_is_reproducible_and_unbiased(method):
    n, block, trials = 4096, 256, 50
    levels = gradcomp.get_method(method).levels
    x = gradient(n, 11)
    first = kernels.ef_quantize(x, None, block, levels, seed=5)
    again = kernels.ef_quantize(x, None, block, levels, seed=5)
    other = kernels.ef_quantize(x, None, block, levels, seed=6)
    assert torch.equal(first[0], again[0]) and not torch.equal(first[0], other[0])
    scale = first[1].repeat_interleave(block)[:n]
    total = torch.zeros(n, dtype=torch.float64)
    for seed in range(trials):
        codes, _ = kernels.ef_quantize(x, None, block, levels, seed=seed)
        q = codes_to_float(codes, method, n, block)
        assert (q - x / scale).abs().max() < 1 + 1e-4  # floor(t + u): one of the two neighbours
        total += q.double() * scale.double()
    # each decode is x plus zero-mean noise of variance <= scale^2 / 4 per element
    z = (total / trials - x.double()) / (scale.double() / 2 / trials ** 0.5)
    assert z.abs().mean() < 1.0 and z.mean().abs() < 0.1


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_block_too_small_to_scale_matches_torch(method):
    """A block whose absmax is below L / 3.4e38 (L / absmax overflows): zeros, scale 0."""
    m = gradcomp.get_method(method)
    x = gradient(1000, 7)
    x[256:512] *= m.levels / 3.5e38 / 8
    residual = torch.zeros(1000)
    expected_residual = residual.clone()
    with backend("torch"):
        expected = m.compress(x, expected_residual)
    codes, scales = kernels.ef_quantize(x, residual, m.block, m.levels)
    assert scales[1] == 0
    assert_same_bits(codes, expected.parts["q"])
    assert_same_bits(scales, expected.parts["scales"])
    assert_same_bits(residual, expected_residual)


def test_stochastic_residual_is_exactly_what_was_not_sent():
    n, block = 70001, 256
    x, residual = gradient(n, 2, specials=True), residual_like(n, 2)
    corrected = x + residual
    codes, scales = kernels.ef_quantize(x, residual, block, 127, seed=9)
    decoded = codes.float() * scales.repeat_interleave(block)[:n]
    expected = torch.where(torch.isfinite(corrected - decoded), corrected - decoded, 0.0)
    assert_same_bits(residual, expected)


@pytest.mark.parametrize("levels, block", [(127, 4097), (7, 3), (5, 256)])
def test_unsupported_configurations_are_refused(levels, block):
    with pytest.raises(ValueError, match="levels"):
        kernels.ef_quantize(torch.ones(10), None, block, levels)


@pytest.mark.parametrize("addend_dtype", ADDEND_DTYPES)
@settings(max_examples=2, deadline=None)  # the examples: 0 rows, many rows, bf16 out
@given(n=SIZES, rows=st.sampled_from([0, 1, 3]), seed=st.integers(0, 2**16),
       addend_scale=st.sampled_from(ADDEND_SCALES), out_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       method=METHODS, block=BLOCKS)
@example(n=33, rows=0, seed=1, addend_scale=1 / 3, out_dtype=torch.float32, method="int8", block=2)
@example(n=40000, rows=3, seed=2, addend_scale=0.5, out_dtype=torch.float32, method="int4", block=100)
@example(n=7, rows=1, seed=3, addend_scale=1.0, out_dtype=torch.bfloat16, method="int8", block=4096)
def test_dequantize_sum_starts_from_the_scaled_addend(addend_dtype, n, rows, seed, addend_scale,
                                                      out_dtype, method, block):
    """decode_sum(rows, addend=a, addend_scale=s): fp32(a) * fp32(s), then each rank's row in
    order, on both paths and in the kernel launcher (0 rows included), bit for bit."""
    m = gradcomp.get_method(method, block=block)
    decoded_with_addend_on_each_path(
        m, [gradient(n, seed + w, specials=w == 1) for w in range(rows)],
        gradient(n, seed + 99, addend_dtype, specials=True), addend_scale, out_dtype,
        kernel=lambda parts, out, addend, s: kernels.dequantize_sum(
            parts["q"], parts["scales"], n, block, out=out, addend=addend, addend_scale=s))


def test_dequantize_sum_refuses_a_bad_addend():
    codes, scales = torch.ones(2, 10, dtype=torch.int8), torch.ones(2, 1)
    for addend, message in ((torch.ones(11), "addend must have 10 elements"),
                            (torch.ones(20)[::2], "addend must be contiguous"),
                            (torch.ones(10, dtype=torch.int32), "addend must have dtype in")):
        with pytest.raises((TypeError, ValueError), match=message):
            kernels.dequantize_sum(codes, scales, 10, 16, addend=addend)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_every_code_and_special_scale_decodes_as_on_the_torch_path(method):
    """Every byte a peer can send (int4: nibbles 0..15, q = -8..7, each decoded by its magic
    exponent; int8: codes -128..127) with every kind of scale, three ranks summed: bit for bit
    what the torch path's decode_sum gives."""
    block, world = 16, 3
    n = 512 if method == "int4" else 256  # every byte value once per rank
    codes = torch.stack([torch.arange(256).roll(37 * w) for w in range(world)])
    codes = codes.to(torch.uint8) if method == "int4" else codes.to(torch.uint8).view(torch.int8)
    assert_special_rows_decode_as_on_torch(gradcomp.get_method(method, block=block), n, block, {"q": codes})
