"""Every method's round trip: error bounds, shapes and dtypes, wire bytes, bad input, NaN/inf."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcomp
from gradcomp import Payload
from gradcomp.methods.base import forced_backend as backend
from kernel_utils import decode_order_sum, int4_codes
from gradcomp.methods.bits import pack_bit31, set_bit_positions, unpack_bits
from gradcomp.methods.powersgd import initial_q, matrix_shape, orthonormalize_
from gradcomp.methods.quant import (dequantize_blocks, pack_int4, quantize_blocks,
                                    quantize_rows, unpack_int4)
from gradcomp.methods import topk
from gradcomp.methods.topk import magnitude_at_least, select_exact, select_threshold, topk_count

FAST = settings(max_examples=25, deadline=None)
SHAPES = [(), (0,), (1,), (7,), (257,), (1000,), (5, 300), (4, 3, 5, 5), (64, 48)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def randn(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def roundtrip(x, method, **options):
    payload = gradcomp.compress(x, method, **options)
    return payload, gradcomp.decompress(payload)


def block_view(t: torch.Tensor, block: int) -> list[torch.Tensor]:
    """t's elements in consecutive blocks (the last may be short)."""
    return list(t.reshape(-1).split(block))


# --- shapes, dtypes, wire bytes ---------------------------------------------------------------

@pytest.mark.parametrize("method", gradcomp.METHODS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shape_dtype_and_wire_bytes(method, shape, dtype):
    x = randn(shape, dtype=dtype)
    payload, y = roundtrip(x, method)
    assert y.shape == x.shape and y.dtype == x.dtype
    m = gradcomp.get_method(method)
    assert payload.nbytes == m.wire_bytes(x.numel(), x.shape, dtype) == payload.flatten().numel()


@pytest.mark.parametrize("method", gradcomp.METHODS)
def test_non_contiguous_input_matches_its_contiguous_copy(method):
    base = randn((40, 30), seed=3)
    x = base.t()[:, ::2]  # [30, 20], strides (1, 60)
    assert not x.is_contiguous()
    _, y = roundtrip(x, method)
    _, y_ref = roundtrip(x.contiguous(), method)
    # elementwise math and per-row reductions see the same values in the same order: exact;
    # PowerSGD's products read the strided view through another BLAS layout (transposed), whose
    # blocking may sum in another order: fp32 rounding, torch's default fp32 tolerance
    exact = method != "powersgd"
    torch.testing.assert_close(y, y_ref, rtol=0 if exact else None, atol=0 if exact else None)


@pytest.mark.parametrize(
    "method, options, formula",
    [
        ("fp16", {}, lambda n, shape: 2 * n),
        ("bf16", {}, lambda n, shape: 2 * n),
        ("int8", {"block": 100}, lambda n, shape: n + 4 * math.ceil(n / 100)),
        ("int4", {"block": 64}, lambda n, shape: math.ceil(n / 2) + 4 * math.ceil(n / 64)),
        ("sign", {"chunk": 96}, lambda n, shape: math.ceil(n / 8) + 4 * math.ceil(n / 96)),
        ("topk", {"ratio": 0.05}, lambda n, shape: (8 * max(1, math.floor(0.05 * n + 0.5)) if n else 0)),
        ("powersgd", {"rank": 2},
         lambda n, shape: 4 * (shape[0] + n // shape[0]) * 2 if len(shape) == 2 else 4 * n),
    ],
)
@given(rows=st.integers(0, 70), cols=st.integers(1, 90))
@FAST
def test_nbytes_is_the_documented_formula(method, options, formula, rows, cols):
    shape = (rows, cols) if method == "powersgd" and rows * cols and (rows + cols) * 2 * 2 < rows * cols \
        else (rows * cols,)
    x = randn(shape, seed=rows * 100 + cols)
    payload = gradcomp.compress(x, method, **options)
    chosen = gradcomp.get_method(method, **options)
    assert payload.parts_nbytes == formula(x.numel(), shape) == chosen.parts_bytes(x.numel(), shape)
    # in the wire layout each part is padded to a multiple of 16 bytes
    padded = sum(-(-t.numel() * t.element_size() // 16) * 16 for t in payload.parts.values())
    assert payload.nbytes == padded == chosen.wire_bytes(x.numel(), shape)


# --- fp16 / bf16 -----------------------------------------------------------------------------

@given(seed=st.integers(0, 10_000), magnitude=st.floats(1e-4, 6e4))
@FAST
def test_cast_rounds_to_nearest(seed, magnitude):
    x = randn(300, seed)
    x = x / x.abs().max() * magnitude  # within fp16's range: no saturation
    for method, dtype, mantissa in (("fp16", torch.float16, 10), ("bf16", torch.bfloat16, 7)):
        _, y = roundtrip(x, method)
        assert torch.equal(y, x.to(dtype).float())  # torch's cast: round to nearest even
        tiny = torch.finfo(dtype).tiny * 2 ** -mantissa  # subnormal spacing
        assert ((y - x).abs() <= x.abs() * 2.0 ** -(mantissa + 1) + tiny).all()


def test_fp16_saturates_finite_values_and_keeps_inf_nan():
    x = torch.tensor([1e6, -1e6, 65519.0, 70000.0, math.inf, -math.inf, math.nan, 1.0])
    _, y = roundtrip(x, "fp16")
    assert y[:4].tolist() == [65504.0, -65504.0, 65504.0, 65504.0]
    assert y[4] == math.inf and y[5] == -math.inf and math.isnan(y[6]) and y[7] == 1.0


def test_bf16_saturates_beyond_its_range():
    big = torch.finfo(torch.float32).max
    x = torch.tensor([big, -big, math.inf])
    _, y = roundtrip(x, "bf16")
    limit = torch.finfo(torch.bfloat16).max
    assert y.tolist() == [limit, -limit, math.inf]


@given(seed=st.integers(0, 10_000))
@FAST
def test_cast_scale_divides_back_out(seed):
    x = randn(200, seed) * 100
    _, y = roundtrip(x, "fp16", scale=0.25)
    assert torch.equal(y, (x * 0.25).half().float() / 0.25)


# --- int8 / int4 -----------------------------------------------------------------------------

@pytest.mark.parametrize("method, levels", [("int8", 127), ("int4", 7)])
@given(n=st.integers(1, 2000), block=st.sampled_from([2, 16, 100, 256]), seed=st.integers(0, 999),
       scale=st.floats(1e-6, 1e6))
@FAST
def test_block_quant_error_is_at_most_half_a_step(method, levels, n, block, seed, scale):
    x = randn(n, seed) * scale
    payload, y = roundtrip(x, method, block=block)
    steps = payload.parts["scales"]
    for xb, yb, step in zip(block_view(x, block), block_view(y, block), steps):
        assert step == pytest.approx(float(xb.abs().max()) / levels, rel=1e-6)
        assert ((yb - xb).abs() <= step / 2 * (1 + 1e-5)).all()


def test_int4_pairs_the_halves_of_each_block_in_a_byte():
    # blocks of 4: [-7, 7 | 0, 1] -> bytes (-7, 0) (7, 1); short last block [3, -2, 7]: h = 2,
    # bytes (3, 7) (-2, 0 for the missing element); every absmax is 7: scale 1, codes = x
    x = torch.tensor([-7.0, 7.0, 0.0, 1.0, 3.0, -2.0, 7.0])
    payload, y = roundtrip(x, "int4", block=4)
    nib = [(-7, 0), (7, 1), (3, 7), (-2, 0)]
    assert payload.parts["q"].tolist() == [(lo + 8) + 16 * (hi + 8) for lo, hi in nib]
    assert torch.equal(y, x)


@given(codes=st.lists(st.integers(-7, 7), min_size=0, max_size=101))
@FAST
def test_pack_int4_round_trips(codes):
    q = torch.tensor(codes, dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(len(codes) / 2)
    h = packed.numel()
    assert ((packed & 15).int() - 8).tolist() == codes[:h]
    assert ((packed >> 4).int() - 8).tolist()[:len(codes) - h] == codes[h:]
    assert torch.equal(unpack_int4(packed, len(codes)), q.int())


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_stochastic_rounding_is_unbiased(method):
    x = randn(256, seed=5)
    m = gradcomp.get_method(method, stochastic=True, seed=3)
    state, total, draws = {}, torch.zeros(256), 400
    for _ in range(draws):
        total += m.decompress(m.compress(x, state=state))
    step = float(x.abs().max()) / m.levels
    # each draw errs by < step with std <= step / 2: the mean is off by < 4 std of the mean
    assert ((total / draws - x).abs() < 4 * (step / 2) / math.sqrt(draws)).all()
    assert state["step"] == draws


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_stochastic_rounding_is_reproducible_and_seeded(method):
    x = randn(1000, seed=6)
    m = gradcomp.get_method(method, stochastic=True, seed=11, block=64)

    def codes(method_, steps):
        state = {}
        return [method_.compress(x, state=state).parts["q"] for _ in range(steps)]

    first, again = codes(m, 3), codes(m, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], first[1])  # the step advances the draws
    other = codes(gradcomp.get_method(method, stochastic=True, seed=12, block=64), 1)
    assert not torch.equal(first[0], other[0])
    y = m.decompress(m.compress(x))
    step = torch.stack([b.abs().max() for b in block_view(x, 64)]) / m.levels
    for xb, yb, s in zip(block_view(x, 64), block_view(y, 64), step):
        assert ((yb - xb).abs() < s * (1 + 1e-5)).all()


@pytest.mark.parametrize("method, levels", [("int8", 127), ("int4", 7)])
def test_block_too_small_to_scale_is_sent_as_zeros_and_kept_by_error_feedback(method, levels):
    # levels / absmax overflows fp32 below levels / 3.4e38: such a block goes out as zeros
    tiny = randn(256, seed=4) * (levels / 3.5e38 / 4)
    x = torch.cat([tiny, randn(100, seed=5)])
    ef = gradcomp.ErrorFeedback()
    payload = ef.compress("w", x, method)
    assert payload.parts["scales"][0] == 0
    y = gradcomp.decompress(payload)
    assert torch.equal(y[:256], torch.zeros(256))
    assert torch.equal(ef.residual("w")[:256], tiny)
    _, y_alone = roundtrip(x[256:], method)
    assert torch.equal(y[256:], y_alone)


@given(values=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1,
                       max_size=64),
       levels=st.sampled_from([7, 127]))
@FAST
def test_round_to_nearest_codes_stay_within_levels_without_a_clamp(values, levels):
    rows = torch.tensor(values, dtype=torch.float32)[None, :]
    amax = rows.abs().max()
    rows[0, 0] = -amax  # the element that reaches the bound, with either sign
    q, _ = quantize_rows(torch.cat([rows, -rows]), levels)
    # the bound is reached, unless levels / amax overflows (near 3.7e-37 and 2.1e-38): zeros
    assert q.abs().max() == levels if amax > 1e-36 else q.abs().max() in (0, levels)
    assert q.abs().max() == 0 or amax > 1e-38


def test_zero_block_decodes_to_zero():
    x = torch.cat([torch.zeros(256), randn(10)])
    for method in ("int8", "int4"):
        payload, y = roundtrip(x, method)
        assert payload.parts["scales"][0] == 0 and torch.equal(y[:256], torch.zeros(256))


@pytest.mark.parametrize("method, levels", [("int8", 127), ("int4", 7)])
def test_quantize_blocks_reference_matches_the_method(method, levels):
    """quantize_blocks (the tests' reference) and the method against a block loop written here
    from the definition: scale = amax / L (one correctly rounded division), code = round(x *
    (L * (1 / amax))) (two roundings, as documented), the last block short."""
    x = randn(1000, seed=8)
    q, scales = quantize_blocks(x, 256, levels)
    own_q, own_scales = [], []
    for start in range(0, 1000, 256):
        block = x[start:start + 256]
        amax = block.abs().max()
        inverse = torch.ones((), dtype=torch.float32) / amax * levels
        own_q.append(torch.round(block * inverse))
        own_scales.append(amax / torch.tensor(float(levels)))
    assert torch.equal(q, torch.cat(own_q)) and torch.equal(scales, torch.stack(own_scales))
    payload = gradcomp.compress(x, method)
    codes = payload.parts["q"] if method == "int8" else int4_codes(payload.parts["q"], 1000, 256)
    assert torch.equal(q, codes.float())
    assert torch.equal(scales, payload.parts["scales"])
    assert torch.equal(dequantize_blocks(q, scales, 256), gradcomp.decompress(payload))


# --- sign -------------------------------------------------------------------------------------

@given(n=st.integers(1, 3000), chunk=st.sampled_from([8, 24, 64, 1000, 1024]), seed=st.integers(0, 999))
@FAST
def test_sign_decodes_to_signed_chunk_mean(n, chunk, seed):
    x = randn(n, seed)
    _, y = roundtrip(x, "sign", chunk=chunk)
    for xb, yb in zip(block_view(x, chunk), block_view(y, chunk)):
        scale = xb.abs().mean()
        expected = torch.where(xb < 0, -scale, scale)
        torch.testing.assert_close(yb, expected, rtol=1e-6, atol=0)


def test_sign_bits_are_bit_planes_of_each_chunk():
    # chunk 16: g = 2 bytes, bit i of byte j is element 2i + j; short last chunk of 9: g = 2,
    # bit i of byte j is element 2i + j (< 9)
    x = torch.ones(25)
    x[[0, 3, 15]] = -1.0  # chunk 0: element 0 -> byte 0 bit 0; 3 -> byte 1 bit 1; 15 -> byte 1 bit 7
    x[[16, 24]] = -2.0  # last chunk: element 0 -> byte 0 bit 0; 8 -> byte 0 bit 4
    payload = gradcomp.compress(x, "sign", chunk=16)
    assert payload.parts["bits"].tolist() == [0b1, 0b10000010, 0b10001, 0]
    torch.testing.assert_close(gradcomp.decompress(payload), torch.where(x < 0, -1.0, 1.0)
                               * torch.tensor([1.0] * 16 + [(7 + 2 * 2) / 9] * 9))


@given(values=st.lists(st.floats(allow_nan=False, width=32), max_size=70))
@FAST
def test_pack_bit31_packs_sign_bits_in_planes(values):
    v = torch.tensor(values, dtype=torch.float32)
    g = -(-len(values) // 8)
    flags = np.zeros(8 * g, dtype=bool)
    flags[:len(values)] = np.signbit(v.numpy())
    expected = np.packbits(flags.reshape(8, g).T, axis=1, bitorder="little").reshape(-1)
    packed = pack_bit31(v.view(torch.int32))
    assert packed.view(torch.uint8).tolist() == expected.tolist()
    assert torch.equal(unpack_bits(packed, len(values)), torch.signbit(v).int())


def test_negative_zero_decodes_to_minus_scale():
    _, y = roundtrip(torch.tensor([-0.0, 0.0, 2.0, -2.0]), "sign")
    assert y.tolist() == [-1.0, 1.0, 1.0, -1.0]


# --- topk -------------------------------------------------------------------------------------

@given(n=st.integers(1, 3000), ratio=st.floats(1e-3, 1.0), seed=st.integers(0, 999))
@FAST
def test_topk_exact_keeps_exactly_the_k_largest(n, ratio, seed):
    x = randn(n, seed)
    payload, y = roundtrip(x, "topk", ratio=ratio)
    k = max(1, min(n, int(ratio * n + 0.5)))
    indices = payload.parts["indices"].long()
    assert indices.numel() == k == topk_count(ratio, n) and indices.unique().numel() == k
    kept = x[indices].abs()
    dropped = torch.ones(n, dtype=torch.bool)
    dropped[indices] = False
    assert not dropped.any() or kept.min() >= x[dropped].abs().max()
    assert torch.equal(payload.parts["values"], x[indices])
    assert torch.equal(y[indices], x[indices]) and not y[dropped].any()


@given(n=st.integers(300, 20_000), ratio=st.floats(0.001, 0.25), seed=st.integers(0, 10_000))
@FAST
def test_topk_threshold_selects_the_same_k_as_exact(n, ratio, seed):
    x = randn(n, seed)  # continuous values: no ties
    k = topk_count(ratio, n)
    by_threshold, values = select_threshold(x, k, 64, seed)
    assert by_threshold.numel() == k  # the count is exactly k: its tolerance is zero
    assert set(by_threshold.tolist()) == set(select_exact(x, k)[0].tolist())
    assert torch.equal(values, x[by_threshold])


@given(flags=st.lists(st.booleans(), max_size=200))
@FAST
def test_set_bit_positions_finds_every_set_bit_once(flags):
    words = torch.tensor([-1 if f else 0 for f in flags], dtype=torch.int32)
    width = 16  # runs of 16 flags (2 bytes each), the last run short
    bits = torch.cat([pack_bit31(run).view(torch.uint8) for run in words.split(width)]
                     + [torch.empty(0, dtype=torch.uint8)])
    assert bits.numel() == -(-len(flags) // 8)
    positions = set_bit_positions(bits, len(flags), width)
    assert sorted(positions.tolist()) == [i for i, f in enumerate(flags) if f]
    assert positions.numel() == sum(flags)


SPECIALS = st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 3.4e38])


@given(values=st.lists(st.one_of(st.floats(-10, 10, width=32), SPECIALS), max_size=300),
       threshold=st.one_of(st.floats(-10, 10, width=32), SPECIALS))
@FAST
def test_magnitude_at_least_matches_a_compare(values, threshold):
    c = torch.tensor(values, dtype=torch.float32)
    effective = math.inf if math.isnan(threshold) else threshold  # documented: NaN threshold = inf
    expected = ((c.abs() >= effective) | c.isnan()).nonzero().squeeze(1)
    assert torch.equal(magnitude_at_least(c, threshold).sort().values, expected)


@pytest.mark.xdist_group("compiles_in_process")  # with test_core_compiled.py's: one dynamo set-up
def test_magnitude_at_least_compiled_matches_eager(monkeypatch):
    c = randn(3 * 1024 + 77, seed=5)
    c[[3, 2000]] = torch.tensor([math.nan, -math.inf])
    eager = magnitude_at_least(c, 1.5)
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_MIN", "1")
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_AFTER_S", "0")  # compiled at once
    calls = topk._at_least_bits_into.compiled_calls
    assert torch.equal(magnitude_at_least(c, 1.5), eager)
    assert topk._at_least_bits_into.compiled_calls == calls + 1
    assert torch.equal(eager.sort().values, ((c.abs() >= 1.5) | c.isnan()).nonzero().squeeze(1))


def test_topk_threshold_selector_through_the_method():
    x = randn(50_000, seed=4)
    p_threshold = gradcomp.compress(x, "topk", ratio=0.01, selector="threshold", sample=1024)
    p_exact = gradcomp.compress(x, "topk", ratio=0.01)
    assert p_threshold.parts["indices"].numel() == 500
    assert set(p_threshold.parts["indices"].tolist()) == set(p_exact.parts["indices"].tolist())


def test_topk_values_keep_the_input_dtype():
    x = randn(100, dtype=torch.bfloat16)
    payload, _ = roundtrip(x, "topk", ratio=0.1)
    assert payload.parts["values"].dtype == torch.bfloat16
    assert payload.parts["indices"].dtype == torch.int32


# --- powersgd ---------------------------------------------------------------------------------

@given(n=st.integers(25, 60), m=st.integers(25, 60), true_rank=st.integers(1, 4),
       extra=st.integers(0, 2), seed=st.integers(0, 999))
@FAST
def test_powersgd_is_exact_when_rank_covers_the_matrix(n, m, true_rank, extra, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, true_rank, generator=g) @ torch.randn(true_rank, m, generator=g)
    payload, y = roundtrip(x, "powersgd", rank=true_rank + extra)
    assert "p" in payload.parts
    torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4 * float(x.abs().max()))


def test_powersgd_conv_weight_is_viewed_as_out_by_rest():
    assert matrix_shape((16, 8, 3, 3)) == (16, 72)
    x = randn((16, 8, 3, 3), seed=2)
    payload = gradcomp.compress(x, "powersgd", rank=2)
    assert payload.parts["p"].shape == (16, 2) and payload.parts["q"].shape == (72, 2)


@pytest.mark.parametrize("shape", [(), (5,), (1000,), (4, 4), (3, 1000)])
def test_powersgd_falls_back_to_uncompressed_values(shape):
    x = randn(shape, seed=1)
    payload, y = roundtrip(x, "powersgd", rank=4)
    assert list(payload.parts) == ["values"] and torch.equal(y, x)
    assert payload.parts["values"].data_ptr() != x.data_ptr() or x.numel() == 0


def test_powersgd_warm_start_is_kept_in_state():
    x = randn((50, 40), seed=3)
    m = gradcomp.get_method("powersgd", rank=2)
    state = {}
    first = m.compress(x, state=state)
    assert torch.equal(state["q"], first.parts["q"])
    second = m.compress(x, state=state)
    # warm-started power iteration converges: the second step approximates x at least as well
    err1 = (m.decompress(first) - x).norm()
    err2 = (m.decompress(second) - x).norm()
    assert err2 <= err1 * (1 + 1e-5)


def test_powersgd_warm_start_depends_only_on_the_columns_directions():
    """The warm Q's columns are scaled to norm 1 before M Q (as the hook does): scaling each
    column of the kept Q changes nothing (scaling its rows would)."""
    x, q = randn((50, 40), seed=4), initial_q(40, 3, seed=5, device="cpu")
    m = gradcomp.get_method("powersgd", rank=3)
    plain, scaled = m.compress(x, state={"q": q.clone()}), m.compress(x, state={"q": q * torch.tensor([3.0, 0.5, 7.0])})
    torch.testing.assert_close(scaled.parts["p"], plain.parts["p"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scaled.parts["q"], plain.parts["q"], rtol=1e-5, atol=1e-5)


def test_orthonormalize_gives_orthonormal_columns():
    p = initial_q(30, 4, seed=0, device="cpu")
    orthonormalize_(p)
    torch.testing.assert_close(p.T @ p, torch.eye(4), rtol=0, atol=1e-5)


def test_orthonormalize_handles_dependent_and_zero_columns():
    u = initial_q(30, 1, seed=1, device="cpu")
    dependent = torch.cat([u, 2 * u + 1e-7 * initial_q(30, 1, seed=2, device="cpu")], dim=1)
    orthonormalize_(dependent)
    torch.testing.assert_close(dependent.T @ dependent, torch.eye(2), rtol=0, atol=1e-4)
    zero = torch.zeros(30, 3)
    assert torch.equal(orthonormalize_(zero), torch.zeros(30, 3))


def test_powersgd_zero_gradient_decodes_to_zeros():
    payload, y = roundtrip(torch.zeros(40, 30), "powersgd")
    assert "p" in payload.parts and torch.equal(y, torch.zeros(40, 30))


# --- decompress(out=) -------------------------------------------------------------------------

@pytest.mark.parametrize("method", gradcomp.METHODS)
def test_decompress_into_out(method):
    x = randn((30, 40), seed=9)
    payload = gradcomp.compress(x, method)
    expected = gradcomp.decompress(payload)
    out = torch.full((1200,), 7.0)
    assert gradcomp.decompress(payload, out) is out
    assert torch.equal(out.view(30, 40), expected)
    half = torch.empty((30, 40), dtype=torch.float16)
    gradcomp.decompress(payload, half)
    assert torch.equal(half, expected.half())


def test_decompress_out_must_fit():
    payload = gradcomp.compress(randn(10), "int8")
    with pytest.raises(ValueError, match="10 elements"):
        gradcomp.decompress(payload, torch.empty(11))
    with pytest.raises(ValueError, match="contiguous"):
        gradcomp.decompress(payload, torch.empty(20)[::2])
    with pytest.raises(TypeError, match="floating-point"):
        gradcomp.decompress(payload, torch.empty(10, dtype=torch.int32))


# --- decode_sum(addend=) -----------------------------------------------------------------------

ADDEND_SCALES = [1.0, 0.5, 1 / 3]


@pytest.mark.parametrize("method", gradcomp.METHODS)
@pytest.mark.parametrize("addend_dtype", [torch.float32, torch.bfloat16, torch.float16])
@settings(max_examples=4, deadline=None)
@given(rows=st.sampled_from([0, 1, 3]), scale=st.sampled_from(ADDEND_SCALES),
       seed=st.integers(0, 2**16))
def test_decode_sum_adds_the_scaled_addend_first(method, addend_dtype, rows, scale, seed):
    """decode_sum(rows, addend=a, addend_scale=s) is fp32(a) * fp32(s) (the product rounded to
    fp32) plus each decoded row in row order, in fp32 (sign: each group of 4 rows summed first,
    kernel_utils.decode_order_sum): the torch path, against that sum built by hand from
    decompress (top-k's scatter-add leaves an element no row carries as it is, so a -0.0 addend
    can stay -0.0 there: compared with torch.equal, -0.0 == 0.0)."""
    m = gradcomp.get_method(method)
    n = 40 * 50
    payloads = [m.compress(randn((40, 50), seed=seed + r)) for r in range(rows)]
    stacked = (Payload.stack(payloads) if rows else
               m.compress(randn((40, 50), seed=seed)).as_rows())
    if not rows:
        stacked = Payload(stacked.method, stacked.shape, stacked.dtype,
                          {k: v[:0] for k, v in stacked.parts.items()}, stacked.options, 0)
    addend = randn(n, seed=seed + 99).to(addend_dtype)
    expected = decode_order_sum(m, [m.decompress(p, torch.empty(n)) for p in payloads],
                                addend.float() * scale if scale != 1 else addend.float())
    with backend("torch"):
        got = m.decode_sum(stacked, torch.full((40, 50), 7.0), addend=addend, addend_scale=scale)
    assert torch.equal(got.view(-1), expected)
    with backend("torch"):  # the same into a 16-bit out: the fp32 sum cast on store
        half = m.decode_sum(stacked, torch.empty(n, dtype=torch.bfloat16), addend, scale)
    assert torch.equal(half, expected.bfloat16())


@pytest.mark.parametrize("method", gradcomp.METHODS)
def test_decode_sum_addend_may_be_out(method):
    """out += decoded rows, in place: the addend is read before any row lands in out."""
    m = gradcomp.get_method(method)
    payloads = [m.compress(randn((30, 40), seed=r)) for r in range(2)]
    start = randn(1200, seed=5)
    expected = m.decode_sum(Payload.stack(payloads), torch.empty(1200), start, 0.5)
    out = start.clone()
    assert m.decode_sum(Payload.stack(payloads), out, out, 0.5) is out
    assert torch.equal(out, expected)


def _addend_case(kind):
    n = 64
    return {"numel": (torch.ones(n + 1), "got torch.float32\\[65\\] on cpu"),
            "device": (torch.ones(n, device="meta"), "on cpu, got torch.float32\\[64\\] on meta"),
            "strided": (torch.ones(2 * n)[::2], "not contiguous"),
            "int": (torch.ones(n, dtype=torch.int32), "got torch.int32\\[64\\] on cpu"),
            "list": ([1.0] * n, "got list")}[kind]


@pytest.mark.parametrize("method", gradcomp.METHODS)
@pytest.mark.parametrize("kind", ["numel", "device", "strided", "int", "list"])
def test_decode_sum_rejects_a_bad_addend(method, kind):
    m = gradcomp.get_method(method)
    stacked = m.compress(randn(64)).as_rows()
    addend, message = _addend_case(kind)
    with pytest.raises(ValueError, match=f"{method}.decode_sum: addend must be a contiguous "
                                         f"floating-point tensor with 64 elements.*{message}"):
        m.decode_sum(stacked, addend=addend)


@pytest.mark.parametrize("method", gradcomp.METHODS)
@pytest.mark.parametrize("scale", [0, -0.5, math.inf, math.nan, True, "0.5", None])
def test_decode_sum_addend_scale_must_be_a_finite_positive_number(method, scale):
    m = gradcomp.get_method(method)
    stacked = m.compress(randn(64)).as_rows()
    with pytest.raises(ValueError, match=f"{method}.decode_sum: addend_scale must be a finite "
                                         "number > 0"):
        m.decode_sum(stacked, addend=randn(64), addend_scale=scale)


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("method", gradcomp.METHODS)
@pytest.mark.parametrize("x", [torch.arange(6), torch.ones(6, dtype=torch.bool),
                               torch.ones(6, dtype=torch.complex64), torch.ones(6, dtype=torch.uint8)])
def test_non_float_tensors_are_rejected(method, x):
    with pytest.raises(TypeError, match=str(x.dtype)):
        gradcomp.compress(x, method)


def test_non_tensors_are_rejected():
    with pytest.raises(TypeError, match="torch.Tensor"):
        gradcomp.compress([1.0, 2.0], "int8")
    with pytest.raises(TypeError, match="Payload"):
        gradcomp.decompress(torch.ones(3))


@pytest.mark.parametrize("method, options, message", [
    ("int9", {}, "unknown method 'int9'"),
    ("int8", {"blocks": 4}, r"unknown option\(s\) \['blocks'\]"),
    ("topk", {"ratio": 0}, "ratio must be in \\(0, 1\\]"),
    ("topk", {"ratio": 1.5}, "ratio must be in \\(0, 1\\]"),
    ("topk", {"ratio": -0.1}, "ratio must be in \\(0, 1\\]"),
    ("topk", {"ratio": float("nan")}, "ratio must be in \\(0, 1\\]"),
    ("topk", {"selector": "approx"}, "selector must be one of"),
    ("topk", {"sample": 10}, "sample must be an integer >= 64"),
    ("powersgd", {"rank": 0}, "rank must be an integer >= 1"),
    ("powersgd", {"rank": 2.5}, "rank must be an integer >= 1"),
    ("powersgd", {"epsilon": -1}, "epsilon must be >= 0"),
    ("powersgd", {"min_compression_rate": 0.5}, "min_compression_rate must be >= 1"),
    ("int8", {"block": 1}, "block must be an integer >= 2"),
    ("int4", {"block": 33}, "block must be even"),
    ("int8", {"stochastic": 1}, "stochastic must be True or False"),
    ("int8", {"seed": -1}, "seed must be an integer >= 0"),
    ("sign", {"chunk": 0}, "chunk must be a positive multiple of 8"),
    ("sign", {"chunk": 12}, "chunk must be a positive multiple of 8"),
    ("fp16", {"scale": 0}, "scale must be a finite number > 0"),
    ("bf16", {"scale": math.inf}, "scale must be a finite number > 0"),
])
def test_bad_methods_and_options_name_the_problem(method, options, message):
    with pytest.raises(ValueError, match=message):
        gradcomp.compress(torch.ones(4), method, **options)


@pytest.mark.parametrize("method", gradcomp.METHODS)
@pytest.mark.parametrize("scale", [0, -0.5, math.inf, math.nan, True, "0.5", None])
def test_compress_scale_must_be_a_finite_positive_number(method, scale):
    m = gradcomp.get_method(method)
    with pytest.raises(ValueError, match=f"{method}.compress: scale must be a finite number > 0"):
        m.compress(randn(64), scale=scale)


PRESCALES = [1.0, 0.5, 1 / 3, 1 / 7, 0.125]


@pytest.mark.parametrize("method", gradcomp.METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=6, deadline=None)
@given(scale=st.sampled_from(PRESCALES), seed=st.integers(0, 2**16), feedback=st.booleans())
def test_compress_scale_is_compressing_the_fp32_product(method, dtype, scale, seed, feedback):
    """compress(x, residual, scale=s) is compress(x.float() * s, residual) bit for bit for a
    method that folds the scale into its own pass (``prescales``: the product rounded to fp32,
    then the residual added), and compress(x * s, residual) for the others (torch's product in
    x's dtype); the payload decompresses to x's dtype. A payload part in x's dtype (top-k's
    values) is the fp32 product's rounded to it, and the residual keeps what that rounding did
    not carry (compared where the dtypes agree)."""
    m = gradcomp.get_method(method)
    x = randn((40, 50), seed=seed).to(dtype)
    r0 = randn(x.numel(), seed=seed + 1) * 0.1
    residual, expected_residual = (r0.clone(), r0.clone()) if feedback else (None, None)
    scaled = m.compress(x, residual, {}, scale)
    expected = m.compress(x.float() * scale if m.prescales else x * scale, expected_residual, {})
    assert scaled.parts.keys() == expected.parts.keys()
    for name, part in scaled.parts.items():
        assert torch.equal(part, expected.parts[name].to(part.dtype)), name
    if feedback and all(p.dtype == expected.parts[n].dtype for n, p in scaled.parts.items()):
        assert torch.equal(residual, expected_residual)
    assert scaled.dtype == dtype and scaled.shape == x.shape


def test_payload_and_method_must_match():
    payload = gradcomp.compress(randn(10), "int8")
    with pytest.raises(ValueError, match="cannot be decoded by method 'int4'"):
        gradcomp.get_method("int4").decompress(payload)
    with pytest.raises(ValueError, match="options"):
        gradcomp.get_method("int8", block=16).decompress(payload)


# --- non-finite values ------------------------------------------------------------------------

@pytest.mark.parametrize("method", gradcomp.METHODS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("shape", [(1,), (2000,), (40, 50)])
def test_non_finite_values_never_vanish(method, bad, shape):
    x = randn(shape, seed=7)
    x.view(-1)[x.numel() // 3] = bad
    y = gradcomp.decompress(gradcomp.compress(x, method))
    assert not torch.isfinite(y).all()
