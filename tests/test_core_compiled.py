"""The compiled CPU fast path computes what the eager math computes (one small tensor per method),
and compiles only when the rule says so (ski rental: after as many eager seconds as a compilation
costs; GRADCOMP_CPU_COMPILE_AFTER_S=0 compiles at the first call, as most tests here need).

Each method's functions compile once per process (~2-5 s with a warm inductor cache), so these
tests are marked slow and use the smallest tensor that still covers full rows and a short row.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


COMPILES_IN_PROCESS = pytest.mark.xdist_group("compiles_in_process")
"""The tests that compile in the pytest process, on one xdist worker: a process's first
compilation pays for dynamo's and inductor's set-up (5 s here, 15 s on 2 busy cores), each later
one about a second (with test_methods.py's compiled magnitude_at_least)."""


def run(method, options, x, steps=2):
    """Payload bytes, fp32 decode and residual after ``steps`` error-feedback steps."""
    ef = gradcomp.ErrorFeedback()
    for step in range(steps):
        payload = ef.compress("w", x * (step + 1), method, **options)
    return payload, gradcomp.decompress(payload, torch.empty(x.shape)), ef.residual("w").clone()


@COMPILES_IN_PROCESS
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
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_AFTER_S", "0")
    counted = functions + [finite_residual]
    before = [f.compiled_calls for f in counted]
    payload_c, decoded_c, residual_c = run(method, options, x)
    assert all(f.compiled_calls > b for f, b in zip(counted, before))
    # the same payload decodes to the same bits either way: ranks may switch at different steps
    torch.testing.assert_close(gradcomp.decompress(payload_e, torch.empty(x.shape)), decoded_e,
                               rtol=0, atol=0, equal_nan=True)
    for name, part in payload_e.parts.items():
        exact = not (name == "scales" and method == "sign")  # a sum, added in another order
        torch.testing.assert_close(payload_c.parts[name], part, rtol=0 if exact else 1e-6, atol=0,
                                   equal_nan=True)
    torch.testing.assert_close(decoded_c, decoded_e, rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(residual_c, residual_e, rtol=1e-5, atol=1e-6)


def test_small_tensors_and_switch_off_stay_eager(monkeypatch):
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_MIN", "1000")
    assert fast.eligible([(torch.empty(1000),)]) and not fast.eligible([(torch.empty(999),)])
    assert fast.eligible([(torch.empty(500),), (torch.empty(500),)])  # the rows of one tensor add up
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE", "off")
    assert not fast.eligible([(torch.empty(10**6),)])
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE", "1")
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_MIN", "lots")
    with pytest.raises(ValueError, match="GRADCOMP_CPU_COMPILE_MIN must be an integer"):
        fast.eligible([(torch.empty(10),)])
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("GRADCOMP_CPU_COMPILE_AFTER_S", bad)
        with pytest.raises(ValueError, match="GRADCOMP_CPU_COMPILE_AFTER_S must be"):
            fast.compile_after_s()


def test_a_short_process_never_compiles(monkeypatch):
    """By default a function stays eager until its eligible calls have run for as long as a
    compilation is expected to cost: a few calls on a big tensor compile nothing."""
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_MIN", "1000")
    monkeypatch.delenv("GRADCOMP_CPU_COMPILE_AFTER_S", raising=False)
    monkeypatch.setattr(fast, "_compile_seconds", [])
    assert fast.compile_after_s() == fast.EXPECTED_COMPILE_S

    @fast.cpu_fast
    def halved_into(x, out):
        out.copy_(x / 2)

    x, out = torch.arange(4096.0), torch.empty(4096)
    for _ in range(20):
        halved_into(x, out)
    assert halved_into.compiled_calls == 0 and 0 < halved_into.eager_seconds < fast.EXPECTED_COMPILE_S
    assert torch.equal(out, x / 2)
    halved_into(x[:999], out[:999])  # below the size rule: eager and not counted
    assert halved_into.compiled_calls == 0


README_FIRST_BLOCK = """
import sys
{block}
from gradcomp.methods import base, quant, sign
print(sum(f.compiled_calls for f in (quant._encode_int8, quant._decode_int8, sign._encode_rows,
                                     sign._decode_rows, base.finite_residual)),
      "torch._dynamo" in sys.modules)
"""


def test_the_readme_first_block_runs_without_the_compiler(tmp_path):
    """The README's first block (a 4M-element tensor through int8 and sign) in a fresh process
    with an empty inductor cache: no compiled call, torch._dynamo not even imported (a compiled
    first call took 19-29 s there on 2 cores, the eager block ~0.3 s)."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert "torch.randn(4096, 1024)" in block and "gradcomp.compress" in block
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADCOMP_CPU_COMPILE")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", README_FIRST_BLOCK.format(block=block)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "False"], (done.stdout, done.stderr)
    assert "compiling the CPU fast path" not in done.stderr


@COMPILES_IN_PROCESS
@pytest.mark.slow
def test_a_function_compiles_once_its_eager_time_reaches_the_budget(monkeypatch):
    """The rule itself: eager while the eager seconds of eligible calls are below
    GRADCOMP_CPU_COMPILE_AFTER_S, compiled from the first call after; its measured compile time
    is then the budget of the functions that have not compiled yet."""
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_MIN", "1000")
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_AFTER_S", "0.05")
    monkeypatch.setattr(fast, "_compile_seconds", [])

    @fast.cpu_fast
    def tripled_into(x, out):
        out.copy_(3 * x)

    x, out = torch.randn(200_000), torch.empty(200_000)
    eager_calls = 0
    while tripled_into.eager_seconds < 0.05:
        tripled_into(x, out)
        eager_calls += 1
        assert tripled_into.compiled_calls == 0
    assert eager_calls >= 2  # a call here takes well under 50 ms
    spent = tripled_into.eager_seconds
    tripled_into(x, out)
    tripled_into(x[1:], out[1:])
    assert tripled_into.compiled_calls == 2 and tripled_into.eager_seconds == spent
    assert torch.equal(out, torch.cat([3 * x[:1], 3 * x[1:]]))  # tripling is exact
    assert len(fast._compile_seconds) == 1 and fast._compile_seconds[0] > 0
    monkeypatch.delenv("GRADCOMP_CPU_COMPILE_AFTER_S")
    assert fast.compile_after_s() == fast._compile_seconds[0]


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


@COMPILES_IN_PROCESS
@pytest.mark.slow
def test_decoding_into_views_anywhere_compiles_once_and_matches_eager(monkeypatch):
    """Fresh tensors, views at offset 0, at other offsets (4-byte but not 16-byte aligned ones
    too) and views of views, in any order and either grad mode: one graph for the int8 decode,
    and its values are eager's (one multiply of a code by its block's scale: exact)."""
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_MIN", "1000")
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_AFTER_S", "0")
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

    from ddp_models import FakeBucket
    from gradcomp.hooks import Int8State, int8_hook

    os.environ["GRADCOMP_CPU_COMPILE_MIN"], os.environ["GRADCOMP_CPU_COMPILE_AFTER_S"] = "1000", "0"
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


@COMPILES_IN_PROCESS
@pytest.mark.slow
def test_the_first_compilation_is_announced_once(monkeypatch, caplog):
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_MIN", "1000")
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE_AFTER_S", "0")
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
    width entered the cache key (fast._vector_width): the fp16 cast, exact by construction.

    TORCHINDUCTOR_VEC_ISA_OK=1: inductor takes the vector ISAs this CPU reports (AVX-512 here, the
    skip condition) as usable instead of compiling a probe program per ISA into the empty cache
    (three of the cold process's eight compilations, ~7 s); the ISA each process picks, and so the
    cache keys and the loops, are the same (with fast._vector_width replaced by ``{}`` the AVX2
    process still prints False)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "GRADCOMP_CPU_COMPILE_MIN": "1000",
           "GRADCOMP_CPU_COMPILE_AFTER_S": "0", "TORCHINDUCTOR_VEC_ISA_OK": "1"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    for capability in ("default", "avx2", "default"):
        run_env = env if capability == "default" else {**env, "ATEN_CPU_CAPABILITY": capability}
        done = subprocess.run([sys.executable, "-c", CAST_CHECK], env=run_env, capture_output=True,
                              text=True, timeout=300)
        assert done.stdout.strip() == "True", (capability, done.stdout, done.stderr[-2000:])
