"""Global-memory bytes: what each kernel actually loads and stores in the interpreter equals its
declaration, and the whole operation stays within 10% of the minimum the operation needs
(read the gradient once, read and write the residual once, write the payload once; for decodes,
read every payload once and write the output once). Minimums come from the methods' parts_bytes
(a kernel reads and writes the parts, never the wire layout's padding)."""
import pytest
import torch
from kernel_utils import backend, gradient, rank_payloads, residual_like

import gradcomp
from gradcomp.kernels import cast, declared, powersgd, quant, sign, topk
from gradcomp.kernels.common import kernel_view
from gradcomp.kernels.traffic import count_bytes
from gradcomp.methods.topk import kernel_sample, sample_rank

N = 3 * 32768 + 1001  # several CPU-config programs and a tail
SLACK = 1.10


def ef_minimum(method, n, x_itemsize=4, feedback=True):
    return n * (x_itemsize + (8 if feedback else 0)) + method.parts_bytes(n)


def decode_minimum(method, n, world, out_itemsize=4):
    return world * method.parts_bytes(n) + n * out_itemsize


@pytest.mark.parametrize("feedback", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# a subset by intent: the streaming encoders (top-k's and PowerSGD's passes have their own tests)
@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "int4", "sign"])
def test_streaming_encoders(name, dtype, feedback):
    method = gradcomp.get_method(name)
    x, itemsize = gradient(N, 1, dtype), torch.empty((), dtype=dtype).element_size()
    residual = residual_like(N, 1) if feedback else None
    with count_bytes() as traffic:
        if name in ("fp16", "bf16"):
            cast.ef_cast(x, residual, 1.0, method.wire_dtype)
            expected = declared.ef_cast_bytes(N, itemsize, feedback)
        elif name == "sign":
            sign.ef_sign(x, residual, method.chunk)
            expected = declared.ef_sign_bytes(N, method.chunk, itemsize, feedback)
        else:
            quant.ef_quantize(x, residual, method.block, method.levels)
            expected = declared.ef_quantize_bytes(N, method.block, method.levels, itemsize, feedback)
    assert traffic.kernel_bytes == expected and traffic.torch_bytes == 0
    # bit-plane layouts launch once for the full chunks / blocks and once for the short last one
    assert len(traffic.launches) == (2 if name in ("int4", "sign") else 1)
    assert ef_minimum(method, N, itemsize, feedback) <= traffic.total <= SLACK * ef_minimum(
        method, N, itemsize, feedback)


@pytest.mark.parametrize("world", [1, 3])
# a subset by intent: the methods with a decode-sum kernel (PowerSGD decodes with torch matmuls)
@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "int4", "sign", "topk"])
def test_decoders(name, world):
    method = gradcomp.get_method(name)
    _, _, stacked = rank_payloads(method, [gradient(N, w) for w in range(world)])
    with count_bytes() as traffic:
        if name in ("fp16", "bf16"):
            cast.cast_decode_sum(stacked["values"], 1.0)
            expected = declared.cast_decode_sum_bytes(N, world, 4)
        elif name == "sign":
            sign.sign_decode_sum(stacked["bits"], stacked["scales"], N, method.chunk)
            expected = declared.sign_decode_sum_bytes(N, method.chunk, world, 4)
        elif name == "topk":
            topk.scatter_add_sum(stacked["values"], stacked["indices"], N)
            expected = declared.scatter_add_sum_bytes(N, method.k(N), world, 4, 4)
        else:
            quant.dequantize_sum(stacked["q"], stacked["scales"], N, method.block)
            expected = declared.dequantize_sum_bytes(N, method.block, method.levels, world, 4)
    assert traffic.total == expected
    minimum = decode_minimum(method, N, world)
    assert minimum <= traffic.total <= SLACK * minimum


@pytest.mark.parametrize("addend_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [0, 1, 3])
@pytest.mark.parametrize("name", ["fp16", "int8", "int4", "sign", "topk"])
def test_decoders_with_an_addend(name, world, addend_dtype):
    """A decode-sum with an addend (FSDP's own row) reads it once more, nothing else: its
    declared bytes, within 10% of the minimum plus the addend's bytes."""
    method = gradcomp.get_method(name)
    _, _, stacked = rank_payloads(method, [gradient(N, w) for w in range(max(world, 1))])
    stacked = {k: v[:world] for k, v in stacked.items()}
    addend = gradient(N, 9, addend_dtype)
    itemsize = addend.element_size()
    with count_bytes() as traffic:
        if name == "fp16":
            cast.cast_decode_sum(stacked["values"], 1.0, addend=addend, addend_scale=0.5)
            expected = declared.cast_decode_sum_bytes(N, world, 4, itemsize)
        elif name == "topk":
            topk.scatter_add_sum(stacked["values"], stacked["indices"], N, addend=addend,
                                 addend_scale=0.5)
            expected = declared.scatter_add_sum_bytes(N, method.k(N), world, 4, 4, itemsize)
        elif name == "sign":
            sign.sign_decode_sum(stacked["bits"], stacked["scales"], N, method.chunk,
                                 addend=addend, addend_scale=0.5)
            expected = declared.sign_decode_sum_bytes(N, method.chunk, world, 4, itemsize)
        else:
            quant.dequantize_sum(stacked["q"], stacked["scales"], N, method.block,
                                 addend=addend, addend_scale=0.5)
            expected = declared.dequantize_sum_bytes(N, method.block, method.levels, world, 4,
                                                  itemsize)
    assert traffic.total == expected and len(traffic.launches) >= 1
    minimum = decode_minimum(method, N, world) + N * itemsize
    assert minimum <= traffic.total <= SLACK * minimum


def sampled_threshold_key(x, residual, sample, rank, seed):
    """The threshold key topk.ef_topk's sample kernel writes for these arguments."""
    key = torch.empty(1, dtype=torch.int32)
    x_arg, x_bf16 = kernel_view(x)
    topk.topk_sample_kernel[(1,)](x_arg, x_arg if residual is None else residual, key,
                                  torch.empty(topk.COUNTER, dtype=torch.int32),
                                  torch.empty(2 * declared.HIGH_BUCKETS, dtype=torch.int32), x.numel(),
                                  1, sample, topk.sample_stride(x.numel(), sample), rank, seed,
                                  1.0, HAS_RESIDUAL=residual is not None,
                                  X_BF16=x_bf16, SAMPLE=topk.sample_tile(sample))
    return int(key)


@pytest.mark.parametrize("feedback, dtype, ratio, sampled", [
    (True, torch.float32, 0.01, True), (False, torch.float32, 0.001, True),
    (False, torch.bfloat16, 0.01, True), (True, torch.float32, 0.01, False)])
def test_topk_compress(feedback, dtype, ratio, sampled):
    """ef_topk moves its declared bytes where the sampled threshold's candidates hold the top k
    (the select kernels read the candidates: with error feedback within SLACK of the one-pass
    minimum; at 1% without it, 1.25x for fp32; the O(k) selection weighs more against bf16's
    2-byte stream) and without a sample (they read c four times, and count each element into
    the rest of the top histogram by an atomic); plus the radix select's fixed histogram
    traffic."""
    method = gradcomp.get_method("topk", ratio=ratio)
    n = 1 << (20 if sampled else 16)
    k = method.k(n)
    itemsize = torch.empty((), dtype=dtype).element_size()
    x = gradient(n, 3, dtype)
    residual = residual_like(n, 3) if feedback else None
    sample = kernel_sample(n, k, method.sample) if sampled else 0
    rank = sample_rank(n, k, sample)
    keys = (x.float() + (residual if feedback else 0)).view(torch.int32) & 0x7FFFFFFF
    passing = keys >= min(sampled_threshold_key(x, residual, sample, rank, 7), 0x7F800000)
    candidates = int(passing.sum())
    read = keys[passing] if k <= candidates <= declared.candidate_capacity(n, k) else keys
    boundary = keys.sort(descending=True).values[k - 1] >> 16
    in_bucket = int(((read >> 16) == boundary).sum())
    with count_bytes() as traffic:
        values, _ = topk.ef_topk(x, residual, k, 1.0, sample, rank, 7)
    assert values.numel() == k
    block = topk.CPU_CONFIG.kwargs["BLOCK"]
    assert traffic.total == declared.ef_topk_bytes(n, k, candidates, itemsize, feedback, block,
                                                   sample, in_bucket)
    minimum = ef_minimum(method, n, itemsize, feedback)
    # zeroed and scanned (the top histogram's two parts, the low one; each scan's boundary chunk
    # read again): 1.1 MB
    histograms = 8 * (2 * declared.HIGH_BUCKETS + declared.LOW_BUCKETS) + 12 * declared.SCAN_CHUNK
    if not sampled:
        assert traffic.total <= SLACK * (minimum + (4 * 4 + 8) * n) + histograms
    elif dtype == torch.float32:
        assert traffic.total <= (SLACK if feedback else 1.25) * minimum + histograms


WARM_Q_PASSES = 18


@pytest.mark.parametrize("feedback", [True, False])
def test_powersgd_step(feedback):
    """Three dependent passes over M are the minimum: read x (+ read r, leave M), read M for
    Q = M^T P, read M and write the residual; plus P and Q on the wire. The method's step on
    the kernels moves its declared bytes, plus O((n + m) r): the warm-start Q drawn, copied,
    scaled to unit columns and kept where finite (torch's isfinite is four ops): at most
    WARM_Q_PASSES passes over m r fp32, and P copied into the caller's buffer (two over n r)."""
    n, m, rank = 600, 2000, 4
    method = gradcomp.get_method("powersgd", rank=rank)
    x = gradient(n * m, 4).view(n, m)
    residual = residual_like(n * m, 4) if feedback else None
    with backend("triton"), count_bytes() as traffic:
        method.compress(x, residual, {})
    config = powersgd.MATMUL_CPU_CONFIG.kwargs
    bn, bm = config["BLOCK_N"], config["BLOCK_M"]
    splits = declared.matmul_splits(n, m, bn)
    launched = dict(traffic.launches)
    assert launched["ef_matmul_kernel"] == declared.ef_matmul_bytes(n, m, rank, 4, feedback, bn, splits)
    assert launched["orthonormalize_kernel"] == declared.orthonormalize_bytes([(n, rank)])
    if feedback:
        assert launched["residual_update_kernel"] == declared.residual_update_bytes(n, m, rank, bn, bm)
    expected = declared.power_step_bytes(n, m, rank, 4, feedback, bn, bm)
    assert expected <= traffic.total <= expected + 4 * rank * (WARM_Q_PASSES * m + 2 * n) + 64
    passes = (4 + 4 + 4) + 4 + (4 + 4) if feedback else 4 + 4
    minimum = n * m * passes + method.parts_bytes(n * m, (n, m))
    assert minimum <= traffic.total <= SLACK * minimum


def test_a_reshape_that_copies_moves_its_bytes_once():
    """reshape of a non-contiguous tensor is a clone plus ``_unsafe_view``, a view that is not
    tagged as one: the copy reads and writes the elements once, the view moves nothing."""
    x = torch.randn(64, 128)[:, :64]
    with count_bytes() as traffic:
        flat = x.reshape(-1)
    assert flat.data_ptr() != x.data_ptr()  # a copy was made
    assert traffic.total == 2 * 4 * 64 * 64
    assert [name for name, moved in traffic.torch_ops if moved] == ["clone"]
