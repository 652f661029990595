"""ErrorFeedback: mass conservation, non-finite handling, state, and misuse."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcomp

FAST = settings(max_examples=10, deadline=None)
OPTIONS = {  # every method, plus the non-default paths that keep state
    "fp16": {}, "bf16": {}, "int8": {}, "int4": {"block": 64}, "sign": {"chunk": 104},
    "topk": {"ratio": 0.05}, "powersgd": {"rank": 2},
}
STATEFUL = [("int8", {"stochastic": True, "seed": 5}), ("topk", {"ratio": 0.02, "selector": "threshold",
                                                                 "sample": 64}),
            ("powersgd", {"rank": 3})]


def gradients(steps, shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(steps)]


def sent_and_inputs(method, options, grads, name="w"):
    """Sum of the fp32-decoded payloads, sum of the inputs (fp64), and the ErrorFeedback."""
    ef = gradcomp.ErrorFeedback()
    sent = torch.zeros(grads[0].shape, dtype=torch.float64)
    for g in grads:
        payload = ef.compress(name, g, method, **options)
        sent += gradcomp.decompress(payload, torch.empty(g.shape)).double()
    return sent, sum(g.double() for g in grads), ef


@pytest.mark.parametrize("method, options", list(OPTIONS.items()) + STATEFUL)
@given(steps=st.integers(1, 6), seed=st.integers(0, 999),
       shape=st.sampled_from([(1,), (333,), (40, 30), (8, 4, 3, 3)]))
@FAST
def test_mass_is_conserved(method, options, steps, seed, shape):
    grads = gradients(steps, shape, seed)
    sent, total, ef = sent_and_inputs(method, options, grads)
    residual = ef.residual("w")
    assert residual.dtype == torch.float32 and residual.shape == shape
    scale = max(1.0, float(total.abs().max()))
    torch.testing.assert_close(sent + residual.double(), total, rtol=0, atol=1e-5 * steps * scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8", "sign", "topk"])
def test_mass_is_conserved_for_half_inputs(method, dtype):
    grads = gradients(4, (500,), seed=1, dtype=dtype)
    sent, total, ef = sent_and_inputs(method, OPTIONS[method], grads)
    torch.testing.assert_close(sent + ef.residual("w").double(), total, rtol=0, atol=1e-4)


@pytest.mark.parametrize("method, options", list(OPTIONS.items()))
def test_error_feedback_lowers_the_accumulated_error(method, options):
    """Without feedback the per-step errors add up; with it the total owed stays one residual."""
    grads = gradients(8, (40, 30), seed=2)
    sent, total, ef = sent_and_inputs(method, options, grads)
    without = sum(gradcomp.decompress(gradcomp.compress(g, method, **options)).double() for g in grads)
    assert (sent - total).norm() <= (without - total).norm() * (1 + 1e-6) + 1e-6


@pytest.mark.parametrize("method, options", list(OPTIONS.items()))
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_is_sent_never_kept(method, options, bad):
    ef = gradcomp.ErrorFeedback()
    g = gradients(1, (40, 30), seed=3)[0]
    g[7, 11] = bad
    y = gradcomp.decompress(ef.compress("w", g, method, **options))
    assert not torch.isfinite(y).all()  # AMP's GradScaler sees the overflow
    assert torch.isfinite(ef.residual("w")).all()
    clean = gradients(1, (40, 30), seed=4)[0]
    assert torch.isfinite(gradcomp.decompress(ef.compress("w", clean, method, **options))).all()
    assert torch.isfinite(ef.residual("w")).all()


def test_powersgd_warm_start_stays_finite_after_a_nan_step():
    ef = gradcomp.ErrorFeedback()
    first = gradients(1, (40, 30), seed=5)[0]
    ef.compress("w", first, "powersgd")
    q_before = ef.state_dict()["entries"]["w"]["state"]["q"]
    bad = first.clone()
    bad[0, 0] = math.nan
    ef.compress("w", bad, "powersgd")
    q_after = ef.state_dict()["entries"]["w"]["state"]["q"]
    assert torch.isfinite(q_after).all() and torch.equal(q_after, q_before)


@pytest.mark.parametrize("method, options", STATEFUL)
def test_state_dict_resumes_exactly(method, options):
    grads = gradients(5, (60, 50), seed=6)
    ef = gradcomp.ErrorFeedback()
    for g in grads[:3]:
        ef.compress("w", g, method, **options)
    saved = ef.state_dict()
    expected = [ef.compress("w", g, method, **options).flatten() for g in grads[3:]]
    resumed = gradcomp.ErrorFeedback()
    resumed.load_state_dict(saved)
    got = [resumed.compress("w", g, method, **options).flatten() for g in grads[3:]]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert torch.equal(resumed.residual("w"), ef.residual("w"))


def test_state_dict_is_a_copy():
    ef = gradcomp.ErrorFeedback()
    ef.compress("w", gradients(1, (100,), seed=7)[0], "sign")
    saved = ef.state_dict()
    ef.compress("w", gradients(1, (100,), seed=8)[0], "sign")
    assert not torch.equal(saved["entries"]["w"]["residual"], ef.residual("w").reshape(-1))


def test_names_and_reset():
    ef = gradcomp.ErrorFeedback()
    ef.compress("a", torch.ones(4), "int8")
    ef.compress("b", torch.ones(3), "sign")
    assert ef.names() == ["a", "b"]
    ef.reset("a")
    assert ef.names() == ["b"]
    ef.compress("b", torch.ones(3), "sign")
    ef.reset()
    assert ef.names() == []


def test_misuse_is_named():
    ef = gradcomp.ErrorFeedback()
    ef.compress("w", torch.ones(4), "int8")
    with pytest.raises(ValueError, match="residual is \\[4\\].*gradient is \\[5\\]"):
        ef.compress("w", torch.ones(5), "int8")
    with pytest.raises(ValueError, match="built by 'int8'.*'sign'"):
        ef.compress("w", torch.ones(4), "sign")
    with pytest.raises(KeyError, match="no residual named 'v'"):
        ef.residual("v")
    with pytest.raises(TypeError, match="dtype torch.int64"):
        ef.compress("x", torch.arange(4), "int8")
    with pytest.raises(ValueError, match="missing"):
        ef.load_state_dict({"residuals": {}})


def test_method_residual_must_be_contiguous_fp32():
    m = gradcomp.get_method("int8")
    with pytest.raises(ValueError, match="contiguous float32 tensor with 4 elements"):
        m.compress(torch.ones(4), residual=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous float32"):
        m.compress(torch.ones(4), residual=torch.zeros(8)[::2])


@pytest.mark.parametrize("method, options", [("topk", {"ratio": 0.05}), ("sign", {"chunk": 64})])
def test_error_feedback_converges_where_plain_compression_stalls(method, options):
    """Gradient descent on a least-squares problem, at a step size (0.02) well inside plain
    descent's stability limit (2 / largest eigenvalue of A^T A, ~0.7), as EF's delayed updates
    need: with error feedback the biased compressor reaches the uncompressed run's loss; without
    it, it stalls an order of magnitude higher."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(1024, 512, generator=gen) / 32
    b = a @ torch.randn(512, generator=gen)

    def final_loss(compress):
        x = torch.zeros(512)
        for _ in range(600):
            x -= 0.02 * compress(a.T @ (a @ x - b))
        return float(((a @ x - b) ** 2).mean())

    memory = gradcomp.ErrorFeedback()
    exact = final_loss(lambda g: g)
    with_ef = final_loss(lambda g: gradcomp.decompress(memory.compress("x", g, method, **options)))
    without = final_loss(lambda g: gradcomp.decompress(gradcomp.compress(g, method, **options)))
    assert with_ef <= 1.1 * exact
    assert without >= 10 * exact


def test_slot_keeps_one_shape_per_name_with_or_without_a_residual():
    ef = gradcomp.ErrorFeedback()
    residual, state = ef.slot("5", (2, 5))
    assert residual.shape == (2, 5) and residual.dtype == torch.float32 and not residual.any()
    residual += 1
    state["rows"] = [{"step": 3}]
    again, same = ef.slot("5", (2, 5))
    assert torch.equal(again, torch.ones(2, 5)) and same is state
    assert ef.slot("7", (7,), residual=False) == (None, {})
    with pytest.raises(ValueError, match="residual is \\[2, 5\\].*gradient is \\[10\\]"):
        ef.slot("5", (10,))
    with pytest.raises(ValueError, match="kept without a residual"):
        ef.slot("7", (7,))
    with pytest.raises(ValueError, match="kept with a residual"):
        ef.slot("5", (2, 5), residual=False)
    with pytest.raises(KeyError, match="no residual named '7'; known: \\['5'\\]"):
        ef.residual("7")
    with pytest.raises(ValueError, match="kept without a residual"):
        ef.get("7", 7)
    saved = ef.state_dict()
    saved["entries"]["5"]["state"]["rows"][0]["step"] = 99  # nested states are copies too
    resumed = gradcomp.ErrorFeedback()
    resumed.load_state_dict(ef.state_dict())
    assert torch.equal(resumed.residual("5"), torch.ones(2, 5))
    assert resumed.slot("5", (2, 5))[1] == {"rows": [{"step": 3}]}
    assert resumed.slot("7", (7,), residual=False) == (None, {})


def test_a_parameter_of_another_size_is_refused_and_the_store_left_as_it_was():
    ef = gradcomp.ErrorFeedback()
    residual, _ = ef.get("bucket0", 6, (("a", 4), ("b", 2)))
    residual.copy_(torch.arange(6.0))
    before = ef.state_dict()
    for layout in ((("a", 3), ("b", 2)), (("b", 3),)):  # a resized in its bucket; b resized in another
        with pytest.raises(ValueError, match=r"parameters changed size \('\w' is owed \d elements, has 3\)"):
            ef.get("bucket1" if len(layout) == 1 else "bucket0", sum(n for _, n in layout), layout)
        after = ef.state_dict()
        assert after["entries"].keys() == before["entries"].keys() and not after["pieces"]
        assert torch.equal(after["entries"]["bucket0"]["residual"], before["entries"]["bucket0"]["residual"])
    moved, _ = ef.get("bucket1", 2, (("b", 2),))  # the control: the same size follows its parameter
    assert torch.equal(moved, torch.tensor([4.0, 5.0]))
