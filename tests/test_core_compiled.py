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


def test_own_storage_is_the_same_memory_at_offset_zero():
    buffer = torch.arange(10.0)
    view = fast.own_storage(buffer[3:7].view(2, 2))
    assert view.storage_offset() == 0 and view.shape == (2, 2)
    view.fill_(-1.0)
    assert buffer.tolist() == [0, 1, 2, -1, -1, -1, -1, 7, 8, 9]
    assert fast.own_storage(buffer) is buffer
    with pytest.raises(ValueError, match="contiguous"):
        fast.own_storage(buffer[1::2])


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_decoding_into_views_anywhere_compiles_once_and_matches_eager(monkeypatch):
    """Fresh tensors, views at offset 0, at other offsets (4-byte but not 16-byte aligned ones
    too) and views of views, in any order and either grad mode: one graph for the int8 decode,
    and its values are eager's (one multiply of a code by its block's scale: exact)."""
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_MIN", "1000")
    method, n = gradcomp.get_method("int8"), 3000 + 7
    payload = method.compress(torch.randn(n, generator=torch.Generator().manual_seed(1)))
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE", "0")
    expected = method.decompress(payload)
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE", "1")
    method.decompress(payload, torch.empty(n))  # compiles the decode (or finds it compiled)
    buffer = torch.zeros(4 * n + 1)
    before, calls = _graphs(), quant._decode_int8.compiled_calls
    outs = (buffer[:n], torch.empty(n), buffer[n + 1:2 * n + 1], buffer[:2 * n][n:], buffer[3 * n:4 * n])
    for index, out in enumerate(outs):
        with torch.set_grad_enabled(index % 2 == 0):  # dynamo guards the grad mode too
            assert torch.equal(method.decompress(payload, out), expected)
    assert _graphs() == before and quant._decode_int8.compiled_calls == calls + 5


def _bucket_steps(rank, world_size):
    """The int8 all-gather hook with error feedback, called on buckets of several sizes (rows of
    the gathered payloads at as many offsets), compiled from 1000 elements: graphs compiled by
    the first step and by a second step on other sizes, and the dynamo warnings logged."""
    import logging
    import os

    from ddp_models import FakeBucket
    from gradcomp.hooks import Int8State, int8_hook

    os.environ["GRADCOMP_CPU_COMPILE_MIN"] = "1000"
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("torch._dynamo").addHandler(handler)
    state = Int8State(None)
    counts = []
    for sizes in ((3000 + 7, 5000 + 300, 2048 + 100), (4000 + 1, 7000 + 513, 1500 + 3)):
        before = _graphs()
        gen = torch.Generator().manual_seed(rank)
        futures = [int8_hook(state, FakeBucket(torch.randn(n, generator=gen), index, index == len(sizes) - 1))
                   for index, n in enumerate(sizes)]
        for future in futures:
            future.wait()
        counts.append(_graphs() - before)
    return {"graphs": counts, "warnings": warned,
            "calls": [f.compiled_calls for f in (quant._encode_int8, quant._decode_int8, finite_residual)]}


@pytest.mark.slow
def test_multi_bucket_steps_compile_each_function_once():
    """Views at new storage offsets (payload rows of an all-gather, buckets of other sizes) reuse
    the graphs: one each for the int8 encode (full rows + short row), decode and the residual
    update, none in the second step, and no dynamo warning (recompile limit)."""
    from dist_utils import run_ranks

    for rank, out in enumerate(run_ranks(_bucket_steps, 2, timeout_s=120)):
        assert out["graphs"] == [3, 0], (rank, out)
        assert out["warnings"] == [], (rank, out)
        assert all(calls >= 6 for calls in out["calls"]), (rank, out)  # 6 buckets, compiled


@pytest.mark.slow
def test_the_first_compilation_is_announced_once(monkeypatch, caplog):
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_MIN", "1000")
    monkeypatch.setattr(fast, "_announced", False)

    @fast.cpu_fast
    def doubled_into(x, out):
        out.copy_(2 * x)

    x, out = torch.arange(3000.0), torch.empty(3000)
    with caplog.at_level("WARNING", logger="gradcomp"):
        doubled_into(x, out)
        doubled_into(x[1000:], out[:2000])
    said = [r.getMessage() for r in caplog.records if r.name == "gradcomp"]
    assert len(said) == 1 and "GRADCOMP_CPU_COMPILE=0 turns it off" in said[0], said
    assert doubled_into.compiled_calls == 2
    assert torch.equal(out, torch.cat([2 * x[1000:], 2 * x[2000:]]))  # doubling is exact


CAST_CHECK = """
import torch, gradcomp
x = torch.arange(3000.0) / 7
print(torch.equal(gradcomp.decompress(gradcomp.compress(x, "fp16")), x.half().float()))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs an AVX-512 CPU")
def test_one_inductor_cache_serves_avx512_and_avx2_processes_correctly(tmp_path):
    """A graph cached by an AVX-512 process, then loaded by an AVX2 one (ATEN_CPU_CAPABILITY),
    computed wrong values from element 8 on (loops built for the other width) until the vector
    width entered the cache key (fast._vector_width): the fp16 cast, exact by construction."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "GRADCOMP_CPU_COMPILE_MIN": "1000"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    for capability in ("default", "avx2", "default"):
        run_env = env if capability == "default" else {**env, "ATEN_CPU_CAPABILITY": capability}
        done = subprocess.run([sys.executable, "-c", CAST_CHECK], env=run_env, capture_output=True,
                              text=True, timeout=300)
        assert done.stdout.strip() == "True", (capability, done.stdout, done.stderr[-2000:])
