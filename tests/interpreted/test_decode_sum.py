"""Method.decode_sum on the kernels: the payloads of p ranks as an all-gather leaves them (one
[p, nbytes] buffer; each part a row-strided view, no copy) decode and sum in one launch, bit for
bit as the torch path; and a hook launches one compress and one decode-sum kernel per bucket."""
import os

import pytest
import torch
from ddp_models import build_model, make_ddp, train_steps
from dist_utils import run_ranks
from hypothesis import given, settings, strategies as st
from kernel_utils import assert_same_bits, backend, counted_launches, gradient

import gradcomp
from gradcomp.hooks import register

CASES = [("fp16", {}), ("bf16", {}), ("int8", {"block": 64}), ("int4", {"block": 64}),
         ("sign", {"chunk": 64}), ("topk", {"ratio": 0.05})]


@settings(max_examples=12, deadline=None)
@given(case=st.sampled_from(CASES), n=st.integers(1, 3000), world=st.integers(1, 4),
       seed=st.integers(0, 2**16), out_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_decode_sum_of_a_gathered_buffer_matches_the_torch_path(case, n, world, seed, out_dtype):
    name, options = case
    method = gradcomp.get_method(name, **options)
    payloads = [method.compress(gradient(n, seed + r)) for r in range(world)]
    gathered = torch.stack([p.flatten() for p in payloads])  # what the all-gather receives
    stacked = payloads[0].unflatten(gathered)
    with backend("torch"):
        expected = method.decode_sum(stacked, torch.empty(n, dtype=out_dtype))
    with backend("triton"):
        got = method.decode_sum(stacked, torch.empty(n, dtype=out_dtype))
    assert_same_bits(got, expected)


def _count_launches(rank, world, method, scheme):
    """Kernel launches by kernel name over 3 DDP steps, and the hook's bucket count."""
    os.environ["GRADCOMP_BACKEND"], os.environ["GRADCOMP_CPU_COMPILE"] = "triton", "0"
    with counted_launches() as launches:
        ddp = make_ddp(build_model(), bucket_cap_mb=0.001)
        state = register(ddp, method, scheme=scheme)
        train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), 3, rank)
    return dict(launches), state.stats()["buckets"]


@pytest.mark.parametrize("world", [2, 3])
def test_int8_allgather_hook_launches_one_quantize_and_one_decode_sum_per_bucket(world):
    launches, buckets = run_ranks(_count_launches, world, "int8", "allgather", timeout_s=300)[0]
    assert buckets >= 3
    assert launches == {"ef_quantize_kernel": buckets, "dequantize_sum_kernel": buckets}


def test_int8_twophase_hook_launches_two_quantize_and_two_decodes_per_bucket():
    """Compress the bucket, decode-sum the p chunk rows, re-compress the chunk, decode the
    joined summed chunks: four launches per bucket, whatever p."""
    launches, buckets = run_ranks(_count_launches, 2, "int8", "twophase", timeout_s=300)[0]
    assert launches == {"ef_quantize_kernel": 2 * buckets, "dequantize_sum_kernel": 2 * buckets}
