"""sign kernels under the interpreter against the torch path: bits exact, scales and residuals to
fp32 summation-order tolerance, the multi-rank decode-sum (groups of 4 ranks) exact given the
scales."""
import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from kernel_utils import (ADDEND_DTYPES, ADDEND_SCALES, PRESCALES, SPECIAL_SCALES,
                          assert_same_bits, assert_special_rows_decode_as_on_torch, backend,
                          compressed_scaled_on_each_path, decoded_with_addend_on_each_path, gradient,
                          rank_payloads, residual_like)

import gradcomp
from gradcomp import Payload
from gradcomp.kernels import sign as kernels

SIZES = st.one_of(st.integers(1, 40), st.integers(32760, 70000))
CHUNKS = st.sampled_from([8, 24, 1000, 1024, 8192])
SCALE_RTOL = 2e-6  # a chunk's |v| summed in another order: a few ulps


@settings(max_examples=12, deadline=None)
@given(n=SIZES, seed=st.integers(0, 2**16), chunk=CHUNKS,
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), feedback=st.booleans(),
       specials=st.booleans())
@example(n=(1 << 20) + 7, seed=4, chunk=1024, dtype=torch.float32, feedback=True, specials=True)
def test_matches_torch(n, seed, chunk, dtype, feedback, specials):
    x = gradient(n, seed, dtype, specials=specials)
    m = gradcomp.get_method("sign", chunk=chunk)
    residual = residual_like(n, seed) if feedback else None
    expected_residual = residual.clone() if feedback else None
    with backend("torch"):
        expected = m.compress(x, expected_residual)
    packed, scales = kernels.ef_sign(x, residual, chunk)
    assert_same_bits(packed, expected.parts["bits"])
    torch.testing.assert_close(scales, expected.parts["scales"], rtol=SCALE_RTOL, atol=0,
                               equal_nan=True)
    if feedback:
        # residual = c -+ scale: off by the scale's rounding difference at most
        atol = SCALE_RTOL * expected.parts["scales"].nan_to_num(0, 0, 0).abs().max().item()
        torch.testing.assert_close(residual, expected_residual, rtol=1e-6, atol=atol)
        assert torch.isfinite(residual).all()


@settings(max_examples=10, deadline=None)
@given(n=SIZES, seed=st.integers(0, 2**16), chunk=CHUNKS,
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       prescale=st.sampled_from(PRESCALES), feedback=st.booleans())
def test_compress_scale_is_the_fp32_product_on_both_paths(n, seed, chunk, dtype, prescale,
                                                          feedback):
    """compress(x, residual, scale=s) equals compress(x.float() * s, residual) bit for bit on
    each path (the kernel multiplies right after the load, before adding the residual); the
    paths agree as test_matches_torch says (bits exact, scales to summation-order ulps)."""
    m = gradcomp.get_method("sign", chunk=chunk)
    payloads = compressed_scaled_on_each_path(m, gradient(n, seed, dtype, specials=True), seed,
                                              prescale, feedback, ("bits", "scales"))
    assert_same_bits(payloads["triton"].parts["bits"], payloads["torch"].parts["bits"])
    torch.testing.assert_close(payloads["triton"].parts["scales"], payloads["torch"].parts["scales"],
                               rtol=SCALE_RTOL, atol=0, equal_nan=True)


@settings(max_examples=8, deadline=None)
@given(n=SIZES, world=st.integers(1, 9), seed=st.integers(0, 2**16), chunk=CHUNKS)
@example(n=5000, world=9, seed=5, chunk=1000)
def test_decode_sums_groups_of_ranks_in_order(n, world, seed, chunk):
    """Groups of 4 ranks (a short last one), each summed in rank order, then the groups' sums
    in order (kernel_utils.decode_order_sum): bit for bit."""
    m = gradcomp.get_method("sign", chunk=chunk)
    _, expected, parts = rank_payloads(
        m, [gradient(n, seed + w, specials=w == 0) for w in range(world)])
    out = kernels.sign_decode_sum(parts["bits"], parts["scales"], n, chunk)
    assert_same_bits(out, expected)


@pytest.mark.parametrize("chunk", [12, 4, 16384])
def test_chunks_the_kernels_cannot_tile_are_refused(chunk):
    assert not kernels.supports(chunk)
    with pytest.raises(ValueError, match="chunk"):
        kernels.ef_sign(torch.ones(100), None, chunk)


def test_bit_is_the_sign_bit():
    """-0.0 sets its bit (and decodes to -scale), as on the torch path."""
    x = torch.tensor([-0.0, 0.0, -1.0, 2.0, -0.0, 0.5, 3.0, -4.0])
    with backend("torch"):
        expected = gradcomp.get_method("sign", chunk=8).compress(x)
    packed, _ = kernels.ef_sign(x, None, 8)
    assert packed.item() == 0b10010101
    assert_same_bits(packed, expected.parts["bits"])


@pytest.mark.parametrize("addend_dtype", ADDEND_DTYPES)
@settings(max_examples=6, deadline=None)
@given(n=SIZES, rows=st.sampled_from([0, 1, 3]), seed=st.integers(0, 2**16),
       addend_scale=st.sampled_from(ADDEND_SCALES), out_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       chunk=CHUNKS)
@example(n=33, rows=0, seed=1, addend_scale=1 / 3, out_dtype=torch.float32, chunk=8)
@example(n=40000, rows=6, seed=2, addend_scale=0.5, out_dtype=torch.float32, chunk=1000)
@example(n=7, rows=1, seed=3, addend_scale=1.0, out_dtype=torch.bfloat16, chunk=8192)
def test_decode_sum_starts_from_the_scaled_addend(addend_dtype, n, rows, seed, addend_scale,
                                                  out_dtype, chunk):
    """decode_sum(rows, addend=a, addend_scale=s): fp32(a) * fp32(s), then each rank's row in
    order, on both paths and in the kernel launcher (0 rows included), bit for bit."""
    m = gradcomp.get_method("sign", chunk=chunk)
    decoded_with_addend_on_each_path(
        m, [gradient(n, seed + w, specials=w == 0) for w in range(rows)],
        gradient(n, seed + 99, addend_dtype, specials=True), addend_scale, out_dtype,
        kernel=lambda parts, out, addend, s: kernels.sign_decode_sum(
            parts["bits"], parts["scales"], n, chunk, out=out, addend=addend, addend_scale=s))


def test_decode_sum_refuses_a_bad_addend():
    bits, scales = torch.ones(2, 2, dtype=torch.uint8), torch.ones(2, 1)
    for addend, message in ((torch.ones(11), "addend must have 16 elements"),
                            (torch.ones(32)[::2], "addend must be contiguous"),
                            (torch.ones(16, dtype=torch.int32), "addend must have dtype in")):
        with pytest.raises((TypeError, ValueError), match=message):
            kernels.sign_decode_sum(bits, scales, 16, 16, addend=addend)


def test_every_byte_and_special_scale_decodes_as_on_the_torch_path():
    """Every byte a peer can send with every kind of scale, six ranks summed (a group of 4 and
    one of 2: the kernel XORs each bit into the scale's sign bit in its table of a group's signed
    sums; torch multiplies by 1 - 2 * bit): bit for bit what the torch path's decode_sum gives."""
    # every byte value in each rank; 37 chunks a row: chunk 7's six scales are all finite
    chunk, world, n = 64, 6, 64 * 37
    bits = torch.stack([(torch.arange(n // 8) % 256).roll(37 * w) for w in range(world)]).to(torch.uint8)
    assert_special_rows_decode_as_on_torch(gradcomp.get_method("sign", chunk=chunk), n, chunk, {"bits": bits})


@settings(max_examples=25, deadline=None)
@given(n=st.one_of(st.integers(1, 300), st.integers(4000, 9000)), world=st.integers(1, 13),
       seed=st.integers(0, 2**16), chunk=st.sampled_from([8, 16, 24, 40, 64, 96, 1024]),
       pad=st.sampled_from([0, 1, 2, 3, 5, 16]), addend=st.booleans(),
       out_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
@example(n=1024 * 5 + 40, world=13, seed=1, chunk=1024, pad=3, addend=False, out_dtype=torch.float32)
@example(n=17, world=1, seed=2, chunk=16, pad=1, addend=True, out_dtype=torch.float32)
@example(n=4096, world=4, seed=3, chunk=1024, pad=0, addend=False, out_dtype=torch.float32)
def test_decode_of_any_bytes_at_any_row_stride(n, world, seed, chunk, pad, addend,
                                                out_dtype):
    """The decode kernel's tile takes each thread's bytes of a plane as one word (4 bytes; 1
    below 4 bytes a plane: chunks 8 and 16) and loads a group's ranks a loop trip ahead: random
    bytes (every bit pattern, the pad bytes past a tail's planes too) and scales (signed zeros,
    infinities and NaN among them) of 1-13 ranks (groups of 4, a short last one, none after the
    first), in rows ``pad`` bytes longer than the payload (row strides not a multiple of 4; a
    part that starts off a word boundary), with or without an addend: bit for bit the torch
    path."""
    g = torch.Generator().manual_seed(seed)
    nbytes, nchunks = -(-n // 8), -(-n // chunk)
    bits = torch.randint(0, 256, (world, nbytes + pad + 1), generator=g, dtype=torch.uint8)
    bits = bits[:, 1:nbytes + 1]  # 1 byte into rows nbytes + pad + 1 apart
    picks = torch.randint(0, 4 * len(SPECIAL_SCALES), (world, nchunks + pad), generator=g)
    special = SPECIAL_SCALES[picks % len(SPECIAL_SCALES)]
    scales = torch.where(picks < len(SPECIAL_SCALES), special,
                         torch.randn(world, nchunks + pad, generator=g))[:, :nchunks]
    start = torch.randn(n, generator=g) if addend else None
    m = gradcomp.get_method("sign", chunk=chunk)
    with backend("torch"):
        template = m.compress(torch.zeros(n))
        rows = Payload(template.method, template.shape, template.dtype,
                       {"bits": bits, "scales": scales}, template.options, world)
        expected = m.decode_sum(rows, torch.empty(n, dtype=out_dtype), start, 0.5)
    got = kernels.sign_decode_sum(bits, scales, n, chunk, out=torch.empty(n, dtype=out_dtype),
                                  addend=start, addend_scale=0.5)
    assert_same_bits(got, expected)
