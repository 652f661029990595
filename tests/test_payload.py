"""Payload: wire bytes, one flat buffer and back, as a collective carries it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcomp

FAST = settings(max_examples=20, deadline=None)


def randn(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", gradcomp.METHODS)
@given(n=st.integers(0, 1500), seed=st.integers(0, 999),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
@FAST
def test_flatten_unflatten_round_trip(method, n, seed, dtype):
    shape = (n // 30, 30) if method == "powersgd" and n >= 900 else (n,)  # low-rank or fallback
    x = randn(shape, seed).to(dtype)
    payload = gradcomp.compress(x, method, **({"block": 33} if method == "int8" else {}))
    buffer = payload.flatten()
    assert buffer.dtype == torch.uint8 and buffer.shape == (payload.nbytes,)
    # a peer's buffer: the same bytes in a fresh tensor, decoded with the local payload as template
    peer = payload.unflatten(buffer.clone())
    assert peer.method == payload.method and peer.shape == payload.shape
    assert peer.options == payload.options and list(peer.parts) == list(payload.parts)
    for name, part in payload.parts.items():
        assert peer.parts[name].dtype == part.dtype and torch.equal(peer.parts[name], part)
    assert torch.equal(gradcomp.decompress(peer), gradcomp.decompress(payload))


def test_parts_follow_each_other_in_order():
    payload = gradcomp.compress(randn(10), "int4", block=4)  # q: 5 bytes, scales: 3 x fp32
    buffer = payload.flatten()
    assert torch.equal(buffer[:5], payload.parts["q"])
    assert torch.equal(buffer[5:].clone().view(torch.float32), payload.parts["scales"])


def test_unflatten_rejects_a_wrong_buffer():
    payload = gradcomp.compress(randn(10), "int8")
    with pytest.raises(ValueError, match=f"uint8\\[{payload.nbytes}\\]"):
        payload.unflatten(torch.zeros(payload.nbytes + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        payload.unflatten(torch.zeros(payload.nbytes, dtype=torch.int8))


@pytest.mark.parametrize("method", gradcomp.METHODS)
def test_ratio_numel_device_and_to(method):
    x = randn((64, 64), seed=1)
    payload = gradcomp.compress(x, method)
    assert payload.numel == 4096 and payload.device == torch.device("cpu")
    assert payload.ratio == pytest.approx(4096 * 4 / payload.nbytes)
    moved = payload.to("cpu")
    assert torch.equal(gradcomp.decompress(moved), gradcomp.decompress(payload))


def test_empty_tensor_payload():
    payload = gradcomp.compress(torch.empty(0), "int8")
    assert payload.nbytes == 0 and payload.flatten().numel() == 0
    assert payload.ratio == float("inf")
    assert gradcomp.decompress(payload.unflatten(payload.flatten())).shape == (0,)
