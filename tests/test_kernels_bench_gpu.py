"""benchmarks/bench_gpu.py without a GPU: its byte accounting, tables and targets, and its exit."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_gpu  # noqa: E402

import gradcomp  # noqa: E402

N = bench_gpu.SIZES["100M"]
FLAT = [m for m in bench_gpu.METHODS if not gradcomp.get_method(m).per_tensor]
"""Every method with a decode-sum kernel (PowerSGD decodes with matmuls)."""


@pytest.mark.parametrize("method, per_element", [("fp16", 14.0), ("bf16", 14.0), ("int8", 13.02),
                                                 ("int4", 12.52), ("sign", 12.13), ("topk", 12.52),
                                                 ("powersgd", 25.2)])
def test_encode_bytes_per_element(method, per_element):
    """docs/kernels.md's bytes per element; PowerSGD's P and Q re-reads weigh 1.2 on 4096 x 4096."""
    n = sum(r * c for r, c in bench_gpu.powersgd_shapes(N)) if method == "powersgd" else N
    assert bench_gpu.declared_bytes(method, "encode", n) / n == pytest.approx(per_element, rel=0.01)


@pytest.mark.parametrize("world", bench_gpu.WORLDS)
def test_decode_bytes_grow_with_the_payloads(world):
    for method in FLAT:
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
            bench_gpu.Row("topk", "compress+EF", N, 1.0, int(1e-3 * 0.6 * copy * 1e9), "torch.topk", 12.0),
            bench_gpu.Row("topk", "decode-sum p=64", N, 1.0, int(1e-3 * 0.55 * copy * 1e9), "eager", 9.0),
            bench_gpu.Row("powersgd", "hook", 6 * 4096**2, 2.0, 10**9, "torch hook", 3.0),
            bench_gpu.Row("powersgd", bench_gpu.GPT2_OP, 7 * 10**6, 0.4, 10**8, "torch hook", 1.0)]
    results = {t["target"]: t for t in bench_gpu.targets(rows, copy, {"int8": 12.0})}
    assert results["int8 decode-sum of 8 payloads: of copy bandwidth"]["pass"]
    assert not results["fp16 compress+EF at 100M: of copy bandwidth"]["pass"]
    assert results["top-k 1% compress+EF at 100M: of copy bandwidth"]["ratio"] == pytest.approx(0.6 / 0.8, rel=1e-6)
    assert results["top-k decode-sum p=64 at 100M: of copy bandwidth"]["ratio"] == pytest.approx(0.55 / 0.5, rel=1e-6)
    assert not results["PowerSGD rank 4 hook / torch powerSGD_hook, 101M of 4096^2 (both whole hook)"]["pass"]
    gpt2 = results["PowerSGD rank 4 hook / torch powerSGD_hook, a GPT-2-small block (both whole hook)"]
    assert gpt2["pass"] and gpt2["row"] == {"method": "powersgd", "op": bench_gpu.GPT2_OP, "n": 7 * 10**6}
    assert results["int8 hook kernels, cold start (s)"]["ratio"] == pytest.approx(2.5)
    assert results["int8 hook kernels, cold start (s)"]["row"] is None
    assert "FAIL" in bench_gpu.targets_table(list(results.values()))
    assert "20.0x" in bench_gpu.table(rows[:1], copy)


def run_json(tmp_path, name, device, rows, copy=3000.0):
    path = tmp_path / name
    path.write_text(json.dumps({"device": device, "copy_gbps": copy, "rows": [
        {"method": m, "op": op, "n": n, "kernel_ms": ms, "declared_bytes": int(fraction * ms * 1e-3 * copy * 1e9),
         "baseline": "eager", "baseline_ms": 1.0, "copy_fraction": fraction} for m, op, n, ms, fraction in rows]}))
    return str(path)


def test_below_target_lists_the_failing_rows_worst_first(tmp_path):
    """What gpu_call.sh hands to ncu: --profile specs recomputed from the rows alone."""
    path = run_json(tmp_path, "run.json", "H100", [
        ("sign", "decode-sum p=64", N, 1.0, 0.3), ("sign", "decode-sum p=8", N, 1.0, 0.7),
        ("fp16", "compress+EF", N, 1.0, 1.0), ("topk", "decode-sum p=64", N, 1.0, 0.1)])
    assert bench_gpu.below_target(path) == [f"topk/decode-sum p=64/{N}", f"sign/decode-sum p=64/{N}",
                                            f"sign/decode-sum p=8/{N}"]


def test_compare_puts_shared_rows_side_by_side(tmp_path, capsys):
    before = run_json(tmp_path, "before.json", "H100", [("sign", "decode-sum p=64", N, 1.2, 0.3),
                                                        ("int8", "compress+EF", N, 0.5, 0.9)])
    after = run_json(tmp_path, "after.json", "H200", [("sign", "decode-sum p=64", N, 0.4, 0.9),
                                                      ("topk", "compress+EF", N, 1.0, 0.4)])
    assert bench_gpu.main(["--compare", before, after]) == 0
    out = capsys.readouterr().out
    assert "different cards" in out
    (line,) = [line for line in out.splitlines() if line.startswith("sign")]
    assert line.split()[-5:] == ["1.200", "0.400", "30%", "90%", "3.00x"]
    assert "int8" not in out and "topk" not in out


def test_unknown_methods_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench_gpu.main(["--methods", "sign,nope"])
    assert "unknown ['nope']" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_exits_with_a_clear_message_without_cuda(capsys):
    assert bench_gpu.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("method", FLAT)
def test_stacked_payloads_are_distinct_rows_each_its_own_compressed_tensor(method):
    """p rows of p different payloads (copies of one would time top-k's atomics on one set of
    addresses), row i the compressed tensor of seed i, in one layout."""
    n, world = 4096, 4
    stacked = bench_gpu.stacked_payloads(method, n, world, device="cpu")
    assert stacked.rows == world
    chosen = bench_gpu.method_of(method)
    for row in range(world):
        x = torch.randn(n, generator=torch.Generator().manual_seed(row))
        with bench_gpu.forced_backend("torch"):
            expected = chosen.compress(x)
        for name, part in expected.parts.items():
            assert torch.equal(stacked.parts[name][row], part), (method, row, name)
    key = "indices" if method == "topk" else next(iter(stacked.parts))
    rows = stacked.parts[key]
    assert all(not torch.equal(rows[0], rows[i]) for i in range(1, world))


def test_json_report_holds_every_row_measured_before_a_failure(tmp_path):
    path = tmp_path / "out" / "bench_gpu.json"
    report = bench_gpu.JsonReport(str(path), {"device": "test"})
    assert json.loads(path.read_text()) == {"device": "test", "rows": []}

    def rows():
        yield bench_gpu.Row("int8", "compress+EF", N, 1.0, 10**9, "eager method", 2.0)
        yield bench_gpu.Row("int8", "decode-sum p=2", N, 0.5, 10**9, "eager method", 1.0)
        raise RuntimeError("CUDA out of memory")  # a late failure

    with pytest.raises(RuntimeError, match="out of memory"):
        for row in rows():
            report.add_row(row, copy_gbps=3000.0)
    saved = json.loads(path.read_text())
    assert [(r["op"], r["kernel_ms"]) for r in saved["rows"]] == [("compress+EF", 1.0), ("decode-sum p=2", 0.5)]
    assert saved["rows"][0]["gbps"] == pytest.approx(1000.0)  # 1e9 bytes in 1 ms
    assert not list(path.parent.glob("*.partial"))
    bench_gpu.JsonReport(None, {}).add_row(bench_gpu.Row("fp16", "x", 1, 1.0, 1, "", None), 1.0)  # no path: no file


def _whole_hooks_on_one_rank(rank, world_size):
    """Each side's hook over one bucket: (all-reduces it issued, decoded gradients)."""
    import torch.distributed as dist

    shapes = [(64, 48), (32, 32)]
    original = torch.randn(sum(r * c for r, c in shapes), generator=torch.Generator().manual_seed(0))
    out = {}
    for side in ("ours", "theirs"):
        bucket = bench_gpu.FakeBucket(original.clone(), shapes)
        hooks = dict(zip(("ours", "theirs"), bench_gpu.powersgd_hooks(bucket)))
        bucket.buffer().copy_(original)  # torch's warm-up all-reduces ran on it
        calls, real = [], dist.all_reduce
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dist, "all_reduce", lambda t, *a, **k: calls.append(t.numel()) or real(t, *a, **k))
            hooks[side]()
        out[side] = (calls, [g.clone() for g in bucket.gradients()])
    return original, out


def test_powersgd_hooks_are_like_for_like_whole_hooks():
    """Ours and torch's powerSGD_hook each compress, all-reduce P and Q and decode a rank-4
    approximation into the bucket (a 1-rank Gloo group in a rank process, never in the test
    process: a Gloo group whose last reference goes on one of its own threads aborts the process;
    NCCL on the GPU)."""
    from dist_utils import run_ranks

    (original, decoded), = run_ranks(_whole_hooks_on_one_rank, 1, timeout_s=60)
    for side, (calls, grads) in decoded.items():
        assert len(calls) >= 2, side  # P and Q (torch adds one for uncompressed tensors)
        for g in grads:
            assert int(torch.linalg.matrix_rank(g)) == bench_gpu.RANK, side
        error = (torch.cat([g.reshape(-1) for g in grads]) - original).norm() / original.norm()
        assert 0 < error < 1, side


def test_gpu_call_prepares_the_before_package_and_names_the_changed_methods(tmp_path):
    """benchmarks/gpu_call.sh prepare: an older commit's gradcomp with its kernels where the
    installed package has them (importable from PYTHONPATH alone); `changed`: the methods whose
    kernel or method module differs from it, which the GPU call benchmarks before and after."""
    import subprocess

    repo = Path(bench_gpu.__file__).resolve().parent.parent
    script, env = repo / "benchmarks" / "gpu_call.sh", {**os.environ, "BASELINE": str(tmp_path / "before")}
    subprocess.run(["bash", str(script), "prepare", "HEAD"], env=env, check=True, capture_output=True)
    assert (tmp_path / "before" / "gradcomp" / "kernels" / "sign.py").is_file()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout
    assert (tmp_path / "before" / "COMMIT").read_text() == head
    done = subprocess.run([sys.executable, "-P", "-c", "import gradcomp.kernels.sign as s; print(s.__file__)"],
                          env={**env, "PYTHONPATH": str(tmp_path / "before")}, cwd=tmp_path,
                          capture_output=True, text=True, check=True)
    assert done.stdout.startswith(str(tmp_path / "before"))
    families = {"sign": "sign", "topk": "topk", "quant": "int8,int4", "powersgd": "powersgd"}
    dirty = [methods for family, methods in families.items()
             if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", f"kernels/{family}.py",
                                f"gradcomp/methods/{family}.py"], cwd=repo).returncode]
    changed = subprocess.run(["bash", str(script), "changed"], env=env, capture_output=True, text=True)
    assert changed.stdout.strip() == ",".join(dirty)
    (tmp_path / "before" / "gradcomp" / "kernels" / "topk.py").write_text("# another design\n")
    changed = subprocess.run(["bash", str(script), "changed"], env=env, capture_output=True, text=True)
    assert "topk" in changed.stdout.strip().split(",")



def test_bench_gpu_runs_on_the_gpu_calls_before_package(tmp_path):
    """Step 3 of gpu_call.sh runs this tree's bench_gpu.py on the package of its BEFORE commit:
    the script must import there and count every row's bytes with that package's own account
    (a name the old package lacks would cost the lent GPU its before/after comparison)."""
    import re
    import subprocess

    repo = Path(bench_gpu.__file__).resolve().parent.parent
    script = repo / "benchmarks" / "gpu_call.sh"
    before = re.search(r"^BEFORE=(\w+)", script.read_text(), re.M).group(1)
    if subprocess.run(["git", "cat-file", "-e", f"{before}^{{commit}}"], cwd=repo).returncode:
        pytest.skip(f"{before} is not in this clone's history")
    env = {**os.environ, "BASELINE": str(tmp_path / "before")}
    subprocess.run(["bash", str(script), "prepare"], env=env, check=True, capture_output=True)
    count = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_gpu, gradcomp\n"
             "assert gradcomp.__file__.startswith(sys.argv[2]), gradcomp.__file__\n"
             "for m in bench_gpu.METHODS:\n"
             "    ops = ['hook'] if m == 'powersgd' else ['encode', 'decode']\n"
             "    print(m, [bench_gpu.declared_bytes(m, op, 1 << 20, 8) for op in ops])\n")
    done = subprocess.run([sys.executable, "-P", "-c", count, str(repo / "benchmarks"),
                           str(tmp_path / "before")],
                          env={**env, "PYTHONPATH": str(tmp_path / "before")}, cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(done.stdout.splitlines()) == len(bench_gpu.METHODS)
