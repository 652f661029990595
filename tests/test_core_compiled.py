"""The compiled CPU fast path computes what the eager math computes (one small tensor per method).

Each method's functions compile once per process (~2-5 s with a warm inductor cache), so these
tests are marked slow and use the smallest tensor that still covers full rows and a short row.
"""
from __future__ import annotations

import pytest
import torch

import gradcomp
from gradcomp.methods import cast, fast, quant, sign, topk
from gradcomp.methods.base import finite_residual

N = 2 * 1024 + 300  # two full sign chunks and nine int8 blocks, plus a short last one
CASES = {  # options, and the compiled functions the method runs
    "fp16": ({}, [cast._cast_into, cast._widen_into]),
    "bf16": ({"scale": 0.5}, [cast._cast_into, cast._widen_into]),
    "int8": ({}, [quant._encode_int8, quant._decode_int8]),
    "int4": ({}, [quant._encode_int4, quant._decode_int4]),
    "sign": ({}, [sign._encode_rows, sign._decode_rows]),
    "topk": ({"ratio": 0.05, "selector": "threshold", "sample": 64}, [topk._at_least_bits_into]),
}


def run(method, options, x, steps=2):
    """Payload bytes, fp32 decode and residual after ``steps`` error-feedback steps."""
    ef = gradcomp.ErrorFeedback()
    for step in range(steps):
        payload = ef.compress("w", x * (step + 1), method, **options)
    return payload, gradcomp.decompress(payload, torch.empty(x.shape)), ef.residual("w").clone()


@pytest.mark.slow
@pytest.mark.parametrize("method", CASES)
def test_compiled_path_matches_eager(method, monkeypatch):
    options, functions = CASES[method]
    x = torch.randn(N, generator=torch.Generator().manual_seed(0))
    x[5] = float("nan")  # in a full row; the short last row stays finite
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE", "0")
    payload_e, decoded_e, residual_e = run(method, options, x)
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE", "1")
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_MIN", "1000")
    counted = functions + [finite_residual]
    before = [f.compiled_calls for f in counted]
    payload_c, decoded_c, residual_c = run(method, options, x)
    assert all(f.compiled_calls > b for f, b in zip(counted, before))
    for name, part in payload_e.parts.items():
        exact = not (name == "scales" and method == "sign")  # a sum, added in another order
        torch.testing.assert_close(payload_c.parts[name], part, rtol=0 if exact else 1e-6, atol=0,
                                   equal_nan=True)
    torch.testing.assert_close(decoded_c, decoded_e, rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(residual_c, residual_e, rtol=1e-5, atol=1e-6)


def test_small_tensors_and_switch_off_stay_eager(monkeypatch):
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_MIN", "1000")
    assert fast.runs_compiled([(torch.empty(1000),)]) and not fast.runs_compiled([(torch.empty(999),)])
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE", "off")
    assert not fast.runs_compiled([(torch.empty(10**6),)])
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE", "1")
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_MIN", "lots")
    with pytest.raises(ValueError, match="GRADCOMP_CPU_COMPILE_MIN must be an integer"):
        fast.runs_compiled([(torch.empty(10),)])
