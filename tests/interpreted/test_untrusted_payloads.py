"""Bytes from another process are untrusted: corrupted payloads of every method, through
``decompress`` and ``decode_sum``, on the torch path and the Triton path (the kernels under the
interpreter, which checks every access's bounds: an out-of-bounds access fails this process).

Content corruption (any bytes in any part) decodes without reading or writing out of bounds:
top-k entries whose index lies outside the tensor are dropped and counted (or, without a
counter, raise naming the part), and both paths agree on the result. Structural corruption
(a part of the wrong size or dtype, rows that disagree, a missing part) raises a ValueError
naming the part before anything is read."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcomp
from gradcomp import Payload
from gradcomp.methods import get_method
from kernel_utils import backend

CASES = [("fp16", {}, (300,)), ("bf16", {}, (300,)), ("int8", {"block": 64}, (300,)),
         ("int4", {"block": 64}, (301,)), ("sign", {"chunk": 64}, (300,)),
         ("topk", {"ratio": 0.1}, (300,)), ("powersgd", {"rank": 2}, (24, 20)),
         ("powersgd", {"rank": 2}, (7,))]
IDS = [f"{name}{list(shape)}" for name, _, shape in CASES]
ROWS = 3


def payloads(name, options, shape, seed):
    """ROWS real payloads of random gradients, stacked, and their flat wire bytes [ROWS, B]."""
    gen = torch.Generator().manual_seed(seed)
    made = [gradcomp.compress(torch.randn(shape, generator=gen), name, **options) for _ in range(ROWS)]
    return made[0], torch.stack([p.flatten() for p in made])


def decode_both(method, stacked):
    """decode_sum on each backend with a counter: (sums, dropped counts), torch first."""
    results = []
    for path in ("torch", "triton"):
        dropped = torch.zeros(stacked.rows, dtype=torch.int64) if method.indexed else None
        with backend(path):
            out = method.decode_sum(stacked, dropped=dropped)
        results.append((out, dropped))
    return results


corruptions = st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=40)


@pytest.mark.parametrize("name, options, shape", CASES, ids=IDS)
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), flips=corruptions)
def test_corrupted_bytes_decode_in_bounds_and_alike_on_both_paths(name, options, shape, seed, flips):
    template, wire = payloads(name, options, shape, seed)
    for where, value in flips:  # any bytes anywhere, as a faulty or hostile peer sends them
        wire.view(-1)[where % wire.numel()] = value
    stacked = template.unflatten(wire)
    method = get_method(name, **options)
    (reference, ref_dropped), (got, dropped) = decode_both(method, stacked)
    outside = None
    if method.indexed:
        indices = stacked.parts["indices"].reshape(ROWS, -1).long()
        outside = (indices < 0) | (indices >= template.numel)
        assert ref_dropped.tolist() == dropped.tolist() == outside.sum(dim=1).tolist()
        expected = torch.zeros(template.numel).index_add_(
            0, indices[~outside], stacked.parts["values"].reshape(ROWS, -1)[~outside].float())
        torch.testing.assert_close(reference.reshape(-1).float(), expected, equal_nan=True)
        if outside.any():
            with pytest.raises(ValueError, match=r"part 'indices' holds entries outside \[0, 300\)"):
                method.decode_sum(stacked)
    assert_alike(got, reference)
    single, decoded = stacked.row(0), []  # gradcomp.decompress of one corrupted payload
    refused = method.indexed and bool(outside[0].any())
    for path in ("torch", "triton"):
        with backend(path):
            if refused:
                with pytest.raises(ValueError, match=r"row 0: \d+"):
                    gradcomp.decompress(single)
            else:
                decoded.append(gradcomp.decompress(single))
    if decoded:
        assert_alike(decoded[1], decoded[0])


def assert_alike(got, reference):
    """The same finite pattern, and the finite values equal to fp32 summation order."""
    finite = torch.isfinite(reference)
    assert torch.equal(finite, torch.isfinite(got)), "the paths disagree on which values are finite"
    scale = reference[finite].abs().max().item() if finite.any() else 0.0
    torch.testing.assert_close(got[finite], reference[finite], rtol=1e-5, atol=1e-5 * scale + 1e-30)


def _shrunk(part):
    return part[..., :-1]


def _grown(part):
    return torch.cat([part, part[..., :1]], dim=-1)


def _retyped(part):
    return part.view(torch.uint8) if part.dtype != torch.uint8 else part.view(torch.int8)


STRUCTURAL = {"shorter": _shrunk, "longer": _grown, "another dtype": _retyped,
              "fewer rows": lambda part: part[:-1]}


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("damage", STRUCTURAL)
@pytest.mark.parametrize("name, options, shape", CASES, ids=IDS)
def test_a_part_of_the_wrong_size_dtype_or_rows_is_refused_by_name(name, options, shape, damage, path):
    template, wire = payloads(name, options, shape, 0)
    stacked = template.unflatten(wire)
    method = get_method(name, **options)
    for part in stacked.parts:
        parts = dict(stacked.parts)
        parts[part] = STRUCTURAL[damage](parts[part])
        if damage == "longer" and parts[part].dim() > 2:  # a 2-D part grows a row of its matrix
            parts[part] = torch.cat([stacked.parts[part], stacked.parts[part][:, :1]], dim=1)
        broken = Payload(name, template.shape, template.dtype, parts, template.options, ROWS)
        with backend(path), pytest.raises(ValueError, match=f"part '{part}'"):
            method.decode_sum(broken)


@pytest.mark.parametrize("name, options, shape", CASES, ids=IDS)
def test_missing_or_foreign_parts_are_refused(name, options, shape):
    template, wire = payloads(name, options, shape, 0)
    stacked = template.unflatten(wire)
    method = get_method(name, **options)
    first = next(iter(stacked.parts))
    missing = {k: v for k, v in stacked.parts.items() if k != first}
    for parts in (missing, {**stacked.parts, "extra": stacked.parts[first]}):
        with pytest.raises(ValueError, match="parts .* expected"):
            method.decode_sum(Payload(name, template.shape, template.dtype, parts, template.options, ROWS))


def test_the_reported_case_is_an_error_not_a_crash():
    """A top-k payload whose indices hold 10,000,000 and -5 for a tensor of 4096 elements:
    gradcomp.decompress raises on both paths (it segfaulted on the Triton path)."""
    payload = gradcomp.compress(torch.randn(4096), "topk", ratio=0.01)
    payload.parts["indices"][:2] = torch.tensor([10_000_000, -5], dtype=torch.int32)
    for path in ("torch", "triton"):
        with backend(path), pytest.raises(ValueError, match=r"row 0: 2"):
            gradcomp.decompress(payload)


def test_a_payload_corrupted_on_the_wire_never_crashes_a_rank_on_the_kernels(monkeypatch):
    """tests/test_peer_failure.py's corrupted wire on 2 Gloo ranks, with GRADCOMP_BACKEND=triton:
    rank 1 corrupts what it sends under each all-gather hook; every rank decodes it on the kernels
    (the interpreter checks every access's bounds), drops exactly the top-k entries sent out of
    range and keeps finite parameters."""
    from dist_utils import run_ranks
    from test_peer_failure import assert_corruption_survived, corrupted_on_the_wire

    monkeypatch.setenv("GRADCOMP_BACKEND", "triton")
    assert_corruption_survived(run_ranks(corrupted_on_the_wire, 2, 3))
