"""The public API gives the same results with GRADCOMP_BACKEND=torch and =triton (the kernels run
on CPU tensors under the interpreter): gradcomp.compress / decompress and ErrorFeedback."""
import pytest
import torch
from kernel_utils import assert_same_bits, backend, gradient

import gradcomp

EXACT = [("fp16", {}), ("bf16", {"scale": 0.125}), ("int8", {}), ("int4", {"block": 64}),
         ("topk", {"ratio": 0.02}),
         ("topk", {"ratio": 0.01, "selector": "threshold", "sample": 256})]
CLOSE = [("sign", {}), ("sign", {"chunk": 96}), ("powersgd", {"rank": 2})]
SHAPES = [(96, 700), (4099,)]


def run(name, options, shape, backend_name, steps=2):
    """Decoded tensors of each step, the final residual and the payloads, on one backend."""
    ef, decoded, payloads = gradcomp.ErrorFeedback(), [], []
    n = torch.Size(shape).numel()
    with backend(backend_name):
        for step in range(steps):
            # top-k: the specials' many equal magnitudes would make the chosen set ambiguous
            g = gradient(n, 100 + step, specials=step == 1 and name != "topk").view(shape)
            payloads.append(ef.compress("w", g, name, **options))
            decoded.append(gradcomp.decompress(payloads[-1]))
        plain = gradcomp.decompress(gradcomp.compress(gradient(n, 7).view(shape), name, **options))
    return decoded + [plain], ef.residual("w").clone(), payloads


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name, options", EXACT, ids=[f"{n}{o}" for n, o in EXACT])
def test_backends_agree_bit_for_bit(name, options, shape):
    reference, ref_residual, ref_payloads = run(name, options, shape, "torch")
    got, residual, payloads = run(name, options, shape, "triton")
    for a, b in zip(got, reference):
        assert_same_bits(a, b)
    assert_same_bits(residual, ref_residual)
    assert [p.nbytes for p in payloads] == [p.nbytes for p in ref_payloads]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name, options", CLOSE, ids=[f"{n}{o}" for n, o in CLOSE])
def test_backends_agree_to_summation_order(name, options, shape):
    reference, ref_residual, ref_payloads = run(name, options, shape, "torch")
    got, residual, payloads = run(name, options, shape, "triton")
    for a, b in zip(got, reference):
        atol = 1e-4 * b.nan_to_num(0, 0, 0).abs().max().item()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=atol, equal_nan=True)
    torch.testing.assert_close(residual, ref_residual, rtol=1e-4, atol=1e-4)
    assert [p.nbytes for p in payloads] == [p.nbytes for p in ref_payloads]


def test_stochastic_rounding_keeps_error_feedback_exact():
    """The kernel's stochastic draws differ from torch's, but what it sends plus what it keeps is
    exactly the input (error feedback loses nothing)."""
    ef, g = gradcomp.ErrorFeedback(), gradient(70_000, 4)
    with backend("triton"):
        payload = ef.compress("w", g, "int8", stochastic=True, seed=1)
        decoded = gradcomp.decompress(payload)
    assert ef.state_dict()["entries"]["w"]["state"] == {"step": 1}
    assert torch.allclose(decoded + ef.residual("w"), g, rtol=0, atol=1e-6)
