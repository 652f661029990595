"""benchmarks/bench_gpu.py without a GPU: its byte accounting, tables and targets, and its exit."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_gpu  # noqa: E402

N = bench_gpu.SIZES["100M"]


@pytest.mark.parametrize("method, per_element", [("fp16", 14.0), ("bf16", 14.0), ("int8", 13.02),
                                                 ("int4", 12.52), ("sign", 12.13), ("topk", 12.6),
                                                 ("powersgd", 24.8)])
def test_encode_bytes_per_element(method, per_element):
    """docs/kernels.md's bytes per element; PowerSGD's P and Q re-reads weigh 0.8 on 4096 x 4096."""
    n = sum(r * c for r, c in bench_gpu.powersgd_shapes(N)) if method == "powersgd" else N
    assert bench_gpu.declared_bytes(method, "encode", n) / n == pytest.approx(per_element, rel=0.01)


@pytest.mark.parametrize("world", bench_gpu.WORLDS)
def test_decode_bytes_grow_with_the_payloads(world):
    for method in ("fp16", "int8", "int4", "sign", "topk"):
        one = bench_gpu.declared_bytes(method, "decode", N, 1)
        assert bench_gpu.declared_bytes(method, "decode", N, world) - 4 * N == pytest.approx(
            world * (one - 4 * N), rel=1e-9), method
    assert bench_gpu.declared_bytes("int8", "decode", N, 8) == 8 * (N + 4 * -(-N // 256)) + 4 * N


def test_powersgd_buckets_are_square_matrices():
    assert bench_gpu.powersgd_shapes(1 << 20) == [(1024, 1024)]
    assert bench_gpu.powersgd_shapes(N) == [(4096, 4096)] * 6


def test_targets_pass_and_fail_by_ratio():
    copy = 3000.0
    rows = [bench_gpu.Row("int8", "decode-sum p=8", N, 0.5, int(0.5e-3 * 0.9 * copy * 1e9), "eager", 10.0),
            bench_gpu.Row("fp16", "compress+EF", N, 1.0, int(1e-3 * 0.8 * copy * 1e9), "eager", 5.0),
            bench_gpu.Row("topk", "compress+EF", N, 1.0, 10**9, "torch.topk", 12.0),
            bench_gpu.Row("powersgd", "compress+EF", 6 * 4096**2, 2.0, 10**9, "torch hook", 3.0)]
    results = {t["target"]: t for t in bench_gpu.targets(rows, copy, {"int8": 12.0})}
    assert results["int8 decode-sum of 8 payloads: of copy bandwidth"]["pass"]
    assert not results["fp16 compress+EF at 100M: of copy bandwidth"]["pass"]
    assert results["top-k 1%: torch.topk / kernels"]["ratio"] == pytest.approx(1.2)
    assert not results["PowerSGD rank 4 compress+EF / torch powerSGD_hook"]["pass"]
    assert results["int8 hook kernels, cold start (s)"]["ratio"] == pytest.approx(2.5)
    assert "FAIL" in bench_gpu.targets_table(list(results.values()))
    assert "20.0x" in bench_gpu.table(rows[:1], copy)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_exits_with_a_clear_message_without_cuda(capsys):
    assert bench_gpu.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
