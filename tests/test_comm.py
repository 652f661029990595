"""Communication schemes: decode-and-sum, chunking, and the collectives on 3 Gloo ranks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcomp
from gradcomp import comm
from dist_utils import run_ranks


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([("int8", {"block": 16}), ("sign", {"chunk": 8}), ("topk", {"ratio": 0.3}),
                        ("fp16", {})]),
       st.integers(1, 200), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_decode_sum_is_the_sum_of_the_decoded_payloads(method_options, numel, count, seed):
    method, options = method_options
    gen = torch.Generator().manual_seed(seed)
    payloads = [gradcomp.compress(torch.randn(numel, generator=gen), method, **options) for _ in range(count)]
    expected = sum(gradcomp.decompress(p).float() for p in payloads)
    torch.testing.assert_close(comm.decode_sum(payloads), expected, rtol=1e-6, atol=1e-6)


@given(st.integers(0, 10_000), st.integers(1, 16), st.integers(1, 300))
def test_chunk_bounds_are_equal_whole_granules_and_cover_the_tensor(numel, world, granule):
    bounds = comm.chunk_bounds(numel, world, granule)
    sizes = {b - a for a, b in bounds}
    assert len(bounds) == world and len(sizes) == 1 and sizes.pop() % granule == 0
    assert bounds[0][0] == 0 and bounds[-1][1] >= numel and bounds[-1][1] - numel < world * granule
    assert all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([("int8", {"block": 16}), ("int4", {"block": 6}), ("sign", {"chunk": 8}),
                        ("fp16", {}), ("bf16", {})]),
       st.integers(1, 300), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_a_payload_of_whole_granules_cuts_into_the_chunks_payloads(method_options, numel, world, seed):
    """The two-phase scheme's premise: compressing the padded tensor once and cutting the payload
    into p rows gives each chunk's own payload, and joining the rows gives the whole back."""
    method = gradcomp.get_method(method_options[0], **method_options[1])
    end = comm.chunk_bounds(numel, world, method.granule)[-1][1]
    x = torch.randn(end, generator=torch.Generator().manual_seed(seed))
    rows = method.compress(x).as_rows(world)
    for r, (a, b) in enumerate(comm.chunk_bounds(numel, world, method.granule)):
        own = method.compress(x[a:b])
        assert all(torch.equal(rows.parts[k][r], v) for k, v in own.parts.items())
    assert torch.equal(method.decompress(rows.joined()), method.decompress(method.compress(x)))


def test_allreduce_payload_refuses_payloads_that_cannot_be_summed():
    with pytest.raises(ValueError, match="int8 payloads cannot be summed on the wire"):
        comm.allreduce_payload(gradcomp.compress(torch.ones(4), "int8"))


def _collectives(rank, world):
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(1001, generator=gen)
    out = {"x": x}
    # all-gather: every rank's payload arrives bit-exact
    payload = gradcomp.compress(x, "sign", chunk=64)
    gathered = comm.allgather_payloads(payload).wait()
    out["gathered"] = [gradcomp.decompress(gathered.row(i)) for i in range(gathered.rows)]
    out["mine"] = gradcomp.decompress(payload)
    # summable payload all-reduce
    out["fp16_sum"] = gradcomp.decompress(comm.allreduce_payload(gradcomp.compress(x, "fp16")).wait())
    # two two-phase all-reduces in flight at once, launched in the same order on every rank
    deferred = comm.Deferred()
    method = gradcomp.get_method("int8", block=32)
    bounds = comm.chunk_bounds(x.numel(), world, method.granule)
    padded = torch.nn.functional.pad(x, (0, bounds[-1][1] - x.numel()))
    futures = []
    for scale in (1.0, -2.0):
        chunks = gradcomp.Payload.stack([method.compress(padded[a:b] * scale) for a, b in bounds])
        futures.append(comm.two_phase_allreduce(chunks, method.compress, deferred, None))
    assert len(deferred) == 2
    deferred.flush()
    # chunks of whole blocks: the p summed chunk payloads joined are the padded tensor's payload
    out["twophase"] = [method.decompress(f.wait().joined())[:x.numel()] for f in futures]
    return out


def test_collectives_on_three_ranks():
    results = run_ranks(_collectives, 3)
    total = sum(r["x"] for r in results)
    for rank, r in enumerate(results):
        for source, decoded in enumerate(r["gathered"]):
            assert torch.equal(decoded, results[source]["mine"])
        torch.testing.assert_close(r["fp16_sum"].float(), total, rtol=2e-3, atol=2e-3)
        for scale, summed in zip((1.0, -2.0), r["twophase"]):
            assert torch.equal(summed, results[0]["twophase"][(1.0, -2.0).index(scale)])
            # two int8 roundings of a block's absmax / 127 each
            bound = 3 * 2 * abs(scale) * max(x.abs().max() for x in (q["x"] for q in results)) / 127
            assert (summed - scale * total).abs().max() <= bound
