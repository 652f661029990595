"""Payload: wire bytes, one flat buffer and back, as a collective carries it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcomp
from dist_utils import run_ranks
from gradcomp.payload import WIRE_ALIGN, Payload, wire_layout

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


def test_parts_start_on_16_byte_boundaries_with_zero_padding():
    payload = gradcomp.compress(randn(10), "int4", block=4)  # q: 5 bytes, scales: 3 x fp32
    buffer = payload.flatten()
    assert buffer.shape == (32,) and payload.nbytes == 32 and payload.parts_nbytes == 17
    assert torch.equal(buffer[:5], payload.parts["q"]) and not buffer[5:16].any()
    assert torch.equal(buffer[16:28].clone().view(torch.float32), payload.parts["scales"])
    assert not buffer[28:].any()


@given(sizes=st.lists(st.integers(0, 100), max_size=6))
@FAST
def test_wire_layout_aligns_every_part_and_the_row(sizes):
    offsets, row = wire_layout(sizes)
    ends = [o + s for o, s in zip(offsets, sizes)]
    assert all(o % WIRE_ALIGN == 0 for o in offsets) and row % WIRE_ALIGN == 0
    assert all(e <= o for e, o in zip(ends, offsets[1:] + [row]))  # in order, no overlap
    assert sum(sizes) <= row < sum(sizes) + WIRE_ALIGN * max(len(sizes), 1)


@pytest.mark.parametrize("bad", [-1, 2.0, None])
def test_wire_layout_refuses_a_bad_size(bad):
    with pytest.raises(ValueError, match="part sizes must be integers >= 0 bytes"):
        wire_layout([16, bad])


@pytest.mark.parametrize("method", gradcomp.METHODS)
@given(n=st.integers(0, 700), rows=st.integers(1, 5), seed=st.integers(0, 999),
       offset=st.sampled_from([0, 1, 3, 16]))
@FAST
def test_gathered_rows_round_trip_as_aligned_views(method, n, rows, seed, offset):
    """p payloads of odd sizes side by side as a collective gathers them: each row and each part
    in it starts on a 16-byte boundary, the parts are views of the buffer with the payloads'
    bits, the padding is zeros, and the rows decode as the payloads stacked do (bit for bit).
    A buffer lying at an odd offset (``offset``) still unflattens, by copies."""
    shape = (n // 20, 20) if method == "powersgd" and n >= 400 else (n,)
    payloads = [gradcomp.compress(randn(shape, seed + r), method) for r in range(rows)]
    template = payloads[0]
    sent = [p.flatten() for p in payloads]
    assert all(b.shape == (template.nbytes,) for b in sent) and template.nbytes % WIRE_ALIGN == 0
    storage = torch.full((offset + rows * template.nbytes,), 0xAB, dtype=torch.uint8)
    gathered = storage[offset:].view(rows, template.nbytes)
    gathered.copy_(torch.stack(sent))  # what all_gather_into writes
    assert torch.equal(Payload.stack(payloads).flatten(), gathered)
    received = template.unflatten(gathered)
    assert received.rows == rows and received.nbytes == gathered.numel()
    base = gathered.data_ptr()
    covered = torch.zeros(template.nbytes, dtype=torch.bool)
    for (name, part), size, start in zip(received.parts.items(), template._row_sizes(),
                                         wire_layout(template._row_sizes())[0]):
        assert torch.equal(part, torch.stack([p.parts[name] for p in payloads]))
        covered[start:start + size] = True
        if offset == 0 and size:  # a view at a 16-byte aligned offset and row stride
            assert base <= part.data_ptr() < base + gathered.numel()
            assert (part.data_ptr() - base) % WIRE_ALIGN == 0
            assert rows == 1 or part.stride(0) * part.element_size() == template.nbytes
    assert not gathered[:, ~covered].any()  # the padding: zeros
    method_ = gradcomp.get_method(method)
    assert torch.equal(method_.decode_sum(received), method_.decode_sum(Payload.stack(payloads)))


def test_unflatten_rejects_a_wrong_buffer():
    payload = gradcomp.compress(randn(10), "int8")
    with pytest.raises(ValueError, match=f"uint8\\[{payload.nbytes}\\]"):
        payload.unflatten(torch.zeros(payload.nbytes + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        payload.unflatten(torch.zeros(payload.nbytes, dtype=torch.int8))
    # a peer laying the parts end to end (no padding: 10 code bytes + 4 scale bytes) is refused
    assert payload.parts_nbytes == 14 and payload.nbytes == 32
    with pytest.raises(ValueError, match=f"uint8\\[{payload.nbytes}\\]"):
        payload.unflatten(torch.zeros(2, payload.parts_nbytes, dtype=torch.uint8))


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


def _check_with_wire_align(rank, world, align):
    import gradcomp.consistency as consistency
    consistency.WIRE_ALIGN = align if rank == 1 else consistency.WIRE_ALIGN  # rank 1: another layout
    try:
        consistency.check_consistent({"hook": "int8_hook"}, None, torch.device("cpu"), "the gradcomp hook")
    except consistency.ConfigMismatchError as exc:
        return str(exc)
    return None


def test_a_peer_with_another_wire_layout_is_refused_by_the_configuration_check():
    """Ranks whose payload rows are laid out differently (an older gradcomp: parts end to end)
    would gather rows of different sizes; the fronts' configuration check refuses it first."""
    assert run_ranks(_check_with_wire_align, 2, WIRE_ALIGN) == [None, None]
    for message in run_ranks(_check_with_wire_align, 2, 1):
        assert f"wire_align: rank 0 has {WIRE_ALIGN}, rank 1 has 1" in message
