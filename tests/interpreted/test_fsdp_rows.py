"""gradcomp.fsdp's row encoding on the kernels: int8, int4 and sign compress the rows of a
reduce-scatter input before the own row and those after it in one launch each (at most two,
whatever p; the own row is not read), the same bytes and residuals as the torch path (sign: its
scales to a few ulps, docs/kernels.md); other methods (or rows that are not whole blocks) one
launch per sent row."""
import pytest
import torch
from kernel_utils import assert_same_bits, backend, counted_launches, gradient

import gradcomp
from gradcomp import fsdp


def _encode(method, rows, rank, residuals):
    with counted_launches() as launches:
        payloads = fsdp.encode_rows(method, rows, rank, rows.shape[0], residuals,
                                    [{} for _ in range(rows.shape[0])])
    return torch.cat([method.decompress(p) for p in payloads]), sum(launches.values())


@pytest.mark.parametrize("name, options, shard_numel, whole", [
    ("int8", {"block": 64}, 256, True), ("int4", {"block": 64}, 192, True), ("sign", {"chunk": 64}, 128, True),
    ("int8", {"block": 64}, 200, False), ("fp16", {}, 128, False)])
@pytest.mark.parametrize("world", [2, 4])
def test_rows_compress_in_one_launch_when_whole_blocks(name, options, shard_numel, whole, world):
    method = gradcomp.get_method(name, **options)
    assert fsdp.encodes_whole(method, shard_numel) == whole
    rows = gradient(world * shard_numel, seed=world).view(world, shard_numel)
    start = torch.randn(world, shard_numel) if name != "fp16" else None
    results = {}
    for kind in ("torch", "triton"):
        residuals = None if start is None else start.clone()
        with backend(kind):
            sent, launches = _encode(method, rows, 1, residuals)
        results[kind] = sent, residuals, launches
    # rank 1: one run before it, one after it unless it is the last rank
    assert results["triton"][2] == ((1 if world == 2 else 2) if whole else world - 1)
    same = torch.testing.assert_close if name == "sign" else assert_same_bits
    same(results["triton"][0], results["torch"][0])
    if start is not None:
        same(results["triton"][1], results["torch"][1])
        assert torch.equal(results["triton"][1][1], start[1])  # the own row's residual: untouched
