"""Every script under benchmarks/, examples/ and scripts/ runs here, as a user would run it: each
``--help`` returns at once, each ``--smoke`` run (seconds: smallest sizes, the real code paths)
prints its table and writes the JSON asked for with the rows it promises, and no run writes into
the source tree. A renamed library function breaks one of these tests, not a user.

The runs are subprocesses with GRADCOMP_CPU_COMPILE=0: compiling the CPU fast path takes longer
than the runs themselves, and the compiled path has its own tests (tests/test_core_compiled.py).
"""
from __future__ import annotations

import copy
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import gradcomp
from gradcomp.emulate import KEEP_FREED_MEMORY

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_auto  # noqa: E402
import bench_hooks  # noqa: E402

ENV = {**os.environ, "GRADCOMP_CPU_COMPILE": "0", "PYTHONPATH": str(ROOT)}
WATCHED = ["benchmarks", "examples", "scripts", "docs", ":(glob)*"]
"""Where a script's default output would land in the tree (the last: files at the top level)."""
HELP_S = 10.0
"""Seconds one --help may take at most on a loaded 2-core machine: argument parsing, no work."""
IMPORTS_TORCH_FOR_HELP = {"examples/experiment.py", "examples/ddp_compressed.py"}
"""Scripts whose parser needs torch (experiment.py's choices and defaults come from the models),
or that import it first as users write them (ddp_compressed.py: a script to copy)."""


def python_scripts() -> list[str]:
    """Every file under benchmarks/ and examples/ that runs as a script."""
    return sorted(str(p.relative_to(ROOT)) for folder in ("benchmarks", "examples")
                  for p in (ROOT / folder).glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def tree_status() -> list[str]:
    """New files under WATCHED and changed files under a results/ folder (what a script's default
    output would be; edits to sources are not a script's, so a checkout being edited meanwhile
    does not fail the check)."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", *WATCHED], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    return sorted(line for line in status.splitlines() if line.startswith("??") or "/results/" in line)


def run_script(*argv, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python *argv`` from the repository root; fails the test with the output if it fails."""
    before = tree_status()
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert tree_status() == before, f"{argv} wrote into the source tree"
    return done


# ---------------------------------------------------------------------------------------- --help

HELP_RUNNER = """
import runpy, sys, time
start = time.perf_counter()
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
print(f"HELP torch={'torch' in sys.modules} seconds={time.perf_counter() - start:.3f}")
"""


@pytest.mark.parametrize("script", python_scripts())
def test_help_returns_at_once(script):
    """--help parses the arguments and exits: before torch is imported (but for the scripts whose
    parser needs it), and in seconds."""
    done = subprocess.run([sys.executable, "-c", HELP_RUNNER, script], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout and (script.startswith("examples/") or "--smoke" in done.stdout)
    fields = dict(field.split("=") for field in done.stdout.splitlines()[-1].split()[1:])
    assert fields["torch"] == str(script in IMPORTS_TORCH_FOR_HELP)
    assert float(fields["seconds"]) < HELP_S


def test_breakeven_validation_refuses_fewer_than_one_sweep():
    done = subprocess.run([sys.executable, "benchmarks/breakeven_validation.py", "--sweeps", "0"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--sweeps must be >= 1, got 0" in done.stderr


def test_every_script_has_a_smoke_test():
    """A new script fails here until it has a smoke run below."""
    assert set(python_scripts()) == set(SMOKE) | {"examples/experiment.py", "examples/optim_curves.py",
                                                  "examples/time_to_loss.py", "examples/ddp_compressed.py"}


@pytest.mark.parametrize("method", ["int8", "auto"])
def test_the_torchrun_example_trains_and_reports(method):
    """examples/ddp_compressed.py as its docstring runs it: torchrun, 2 CPU processes (Gloo)."""
    from gradcomp.emulate import free_port
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "examples/ddp_compressed.py",
                           "--method", method, "--steps", "6", "--width", "256"],
                          cwd=ROOT, env={**ENV, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith(f"method {method}:")]
    ratio = float(line.rsplit("ratio ", 1)[1].rstrip("x"))
    # int8: a code byte per fp32 element and a scale per 256; auto: uncompressed on a fast link
    assert ratio == pytest.approx(4 / (1 + 4 / 256), rel=0.02) if method == "int8" else ratio >= 1.0, line


@pytest.mark.slow
def test_the_prepared_gpu_call_runs_dry_without_a_gpu(tmp_path):
    """benchmarks/gpu_call.sh with DRY=1: every step's command runs up to its CUDA check (so a
    renamed option or a broken step shows here, not in a lent GPU's minutes), the CUDA tests are
    collected, a benchmark that wrote no JSON is reported instead of crashing the comparison,
    and at most 8 files land in $OUT (what the device tool brings back)."""
    env = {**ENV, "DRY": "1", "OUT": str(tmp_path / "out"), "BASELINE": str(tmp_path / "baseline")}
    (tmp_path / "out").mkdir()
    subprocess.run(["bash", "benchmarks/gpu_call.sh", "prepare"], cwd=ROOT, env=env, check=True, timeout=60,
                   capture_output=True)
    done = subprocess.run(["bash", "benchmarks/gpu_call.sh", "run"], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)
    out, tmp_path = done.stdout + done.stderr, tmp_path / "out"
    assert done.returncode == 0, out[-3000:]
    assert out.count("bench_gpu: no CUDA device found") == 3, out[-3000:]  # after, kernel times, before
    assert "error:" not in out and "Traceback" not in out, out[-3000:]
    assert "tests collected" in (tmp_path / "cuda_tests.txt").read_text()
    assert "no comparison: a benchmark wrote no JSON" in (tmp_path / "compare.txt").read_text()
    assert "ncu reads hardware counters: 0" in (tmp_path / "device.txt").read_text()
    assert len(list(tmp_path.iterdir())) <= 8


def test_shell_scripts_parse_and_install_extras_exist():
    for script in ("demo.sh", "install.sh", "test.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True)
    optional = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = {line.split("=")[0].strip() for line in optional.splitlines() if "=" in line}
    assert '".[dev,data,plots]"' in (ROOT / "scripts" / "install.sh").read_text()
    assert {"dev", "data", "plots"} <= extras, extras
    assert "gradcomp demo" in (ROOT / "scripts" / "demo.sh").read_text()  # the demo's parts: test_demo.py


# ---------------------------------------------------------------------------------------- --smoke

def check_bench_auto(out: str, report: dict) -> None:
    assert "targets met" in out and "mid-run: not run (--smoke)" in out
    assert [(r["link"], r["model"], r["auto"]) for r in report["rows"]] == [
        ("unshaped", "gpt", "auto"), ("unshaped", "gpt", "auto+opt-in"), ("unshaped", "gpt", "auto+opt-in, speed only")]
    from gradcomp.analysis.auto import allowed_labels
    for row in report["rows"]:
        assert set(row["step_s"]) == set(bench_auto.FIXED) | set(bench_auto.AUTO)
        # auto is held to the best of every hook it can choose (the library's policy less what
        # the measured table refuses, not the benchmark's list: a choice the benchmark does not
        # run would flatter auto)
        may_choose = allowed_labels(*bench_auto.AUTO[row["auto"]])
        assert set(may_choose) <= set(row["step_s"]), may_choose
        assert row["best_fixed_s"] == min(row["step_s"][label] for label in may_choose)
    by_variant = {row["auto"]: row for row in report["rows"]}
    assert "sign:allgather" in allowed_labels(*bench_auto.AUTO["auto+opt-in, speed only"])
    assert "sign:allgather" not in allowed_labels(*bench_auto.AUTO["auto+opt-in"])
    assert all(d["quality_budget"] is None for d in by_variant["auto+opt-in, speed only"]["decisions"])
    assert report["switch"] is None


def check_bench_fsdp(out: str, report: dict) -> None:
    runs = report["links"]["loopback"]["runs"]["2"]
    assert list(runs) == ["plain", "bf16", "int8", "int4", "sign"]
    plain = runs["plain"]["wire_bytes_per_step"]
    assert runs["bf16"]["wire_bytes_per_step"] == pytest.approx(plain / 2, rel=0.01)  # + per-unit headers
    assert runs["int8"]["wire_bytes_per_step"] < plain / 3.5 and runs["sign"]["wire_bytes_per_step"] < plain / 25
    assert "compress ms" in out and all(f" {m} " in out for m in runs)
    # the smoke launch calibrates (wire-free FSDP compute, collectives, row costs) and predicts
    predicted = report["links"]["loopback"]["predicted"]["2"]
    assert all(predicted[m]["step_s"] > 0 for m in runs) and "median |error|" in out
    assert predicted["int8"]["wire_bytes"] == pytest.approx(runs["int8"]["wire_bytes_per_step"], rel=0.01)
    calibration = report["launches"]["loopback"]["2"][0]
    assert all(calibration["compute"][k] > 0 for k in ("forward_s", "backward_s", "optimizer_s"))
    assert report["malloc"] == KEEP_FREED_MEMORY  # the ranks ran with these settings
    # --replay predicts the recorded launches again, without training: the same predictions
    with tempfile.TemporaryDirectory() as tmp:
        recorded, replayed = Path(tmp) / "run.json", Path(tmp) / "replayed.json"
        recorded.write_text(json.dumps(report))
        run_script("benchmarks/bench_fsdp.py", "--replay", str(recorded), "--json", str(replayed))
        again = json.loads(replayed.read_text())
    assert again["links"]["loopback"]["predicted"] == report["links"]["loopback"]["predicted"]
    assert again["replayed"] == str(recorded)


def check_bench_gpu(out: str, report: dict | None) -> None:
    for method in gradcomp.METHODS:  # PowerSGD's row is its hook's
        assert f"\n{method} {'(hook) ' if gradcomp.get_method(method).per_tensor else ''}" in out
    if torch.cuda.is_available():
        assert {(r["method"], r["op"]) for r in report["rows"]} >= {("int8", "decode-sum p=64"), ("powersgd", "hook")}
    else:
        assert report is None


def check_bench_hierarchical(out: str, report: dict) -> None:
    """The bytes the hooks count are the analyser's, exactly (integer byte counts)."""
    assert report["workload"] == "mlp-small"
    counted, predicted = report["counted"][0], report["predicted_bytes"]
    for label, bytes_ in counted.items():
        if label.startswith("hier:"):
            assert (bytes_["intra"], bytes_["inter"]) == (predicted[label]["exact"], predicted[label]["wire"]), label
        else:
            assert bytes_["wire"] == predicted[label]["wire"], label
    assert {(r["model"], r["world_size"]) for r in report["predictions"]} == {
        ("gpt2-1.5b", 8), ("gpt2-1.5b", 64), ("llama-7b", 8), ("llama-7b", 64)}


def check_bench_hooks(out: str, report: dict) -> None:
    variants = report["results"][0]["variants"]
    assert list(variants) == list(bench_hooks.VARIANTS) and report["results"][0]["model"] == "gpt"
    assert variants["ddp default"]["ratio"] == 1.0 and variants["fp16"]["ratio"] == pytest.approx(2.0)
    assert variants["topk 1%"]["ratio"] > 40 and variants["sign allgather"]["ratio"] > 25
    assert "hook ms/step" in out


def check_bench_kernels(out: str, report: dict) -> None:
    measured = [line.split("measured ", 1)[1].rsplit(" in ", 1)[0] for line in out.splitlines() if "measured " in line]
    assert [r["operation"] for r in report["results"]] == measured and len(measured) == 12
    for r in report["results"]:
        assert r["triton"]["launches"] >= 1 and r["torch"]["bytes_per_element"] > 0, r["operation"]
    assert report["n"] == 4096


INT8_WIRE = 1 + 4 / 256
"""int8 payload bytes per element: a code byte, and a 4-byte scale per 256-element block."""
TRAFFIC_MINIMUM = {
    # bytes per fp32 element, one step on 2 ranks, worked out by hand from the rule (docs/kernels.md):
    # every compression reads its input (and residual) and writes the residual and payload once;
    # every decode reads the payloads it sums and writes its result once
    "fp16": 4 + 2 + 2 + 4,  # read x, write fp16; the all-reduced fp16 read, fp32 written
    "int8": 4 + 8 + INT8_WIRE + 2 * INT8_WIRE + 4,  # x, residual r+w, payload | 2 payloads, out
    "exchange int8": 4 + 8 + INT8_WIRE + 2 * INT8_WIRE + 4,  # the optimizers' all-gather, as DDP's
    # n = 2 S: the other rank's row S compressed (x, residual, payload), its payload and the own
    # row read, the shard written: per element of n
    "fsdp int8": (4 + 8 + INT8_WIRE + INT8_WIRE + 4 + 4) / 2,
}


def check_bench_traffic(out: str, report: dict) -> None:
    assert report["counted_at"] == [8192, 16384, 24576] and report["fit_error"] < 0.01
    assert report["world"] == 2
    assert [r["n"] for r in report["rows"]] == [n for n in (1 << 20, 16 << 20, 100 << 20) for _ in range(4)]
    for r in report["rows"]:  # the minimum is the hand-derived one; the ratio its quotient
        assert r["minimum_per_element"] == TRAFFIC_MINIMUM[r["front"]], r
        assert r["ratio"] == pytest.approx(r["bytes_per_element"] / r["minimum_per_element"])
        assert f"{r['ratio']:.2f}" in out
    assert f"above {report['bound']}x the minimum:" in out


def check_noise_ratios(out: str, report: dict) -> None:
    """Every method's ratio at every measured step, ordered by the methods' errors (fp16 below
    int8 below int4, top-k and sign), and the table prints them."""
    assert [r["step"] for r in report["rows"]] == [0, 3, 6]
    for r in report["rows"]:  # the GPT trains with AdamW: its ratios in AdamW's coordinates too
        for space in ("", "adam:"):
            assert 0 < r[f"{space}fp16"] < r[f"{space}int8"] < r[f"{space}int4"] < min(r[f"{space}topk"],
                                                                                     r[f"{space}sign"]), r
            assert f"{r[space + 'int8']:.3g}" in out
    assert f"budget (auto's default): {report['budget']}" in out


def check_auto_quality(out: str, report: dict) -> None:
    """The tiny GPT's uncompressed run priced at the link run paired with auto's run, auto at its
    own run's steps: each meets its own quality (auto, uncompressed at the start, matches it), and
    the goals read them."""
    entry = report["models"]["gpt"]["none"]
    (none,) = entry["fixed"]
    assert none["config"] == "none" and none["meets"] and none["reached"] == 1 and none["seconds"] > 0
    assert [r["priced_at"] for r in none["per_seed"]] == ["paired"]
    assert entry["auto"]["meets"] and entry["auto"]["seconds"] > 0 and entry["auto"]["choices"]
    goals = entry["goals"]
    assert goals["best_fixed"] == "none"
    assert goals["auto_over_best"] == pytest.approx(entry["auto"]["seconds"] / none["seconds"])
    assert "gpt, link none Gbit/s" in out and "goals: quality met True" in out
    # the null: the smoke's copy of the uncompressed run (the tiny GPT fits one bucket either way)
    null = entry["null"]
    assert [r["heldout_loss"] for r in null["per_seed"]] == [r["heldout_loss"] for r in none["per_seed"]]
    assert null["reached"] == 1 and null["seconds"] == pytest.approx(none["seconds"])
    assert "null (uncompressed, buckets of 0.25 MB" in out and "per seed: 1.00" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| gpt | unshaped | 1 | ")]  # --markdown
    assert row.endswith(f" | none | {goals['auto_over_best']:.3f} / {goals['auto_over_none']:.3f} | "
                        f"{goals['step_over_best']:.3f} / {goals['step_over_none']:.3f} | +0.00%; reached 1 of 1 |"), row


def test_the_null_runs_are_uncompressed_in_other_buckets(tmp_path, monkeypatch):
    """``run --what null``: uncompressed with DDP buckets of 0.25 MB, each seed into QUALITY/null/<model>,
    on the plain loopback whatever --links says; a finished one is not run again."""
    import auto_quality

    ran = []
    monkeypatch.setattr(auto_quality, "experiment", ran.append)
    done = tmp_path / "null" / "gpt" / "seed1"
    done.mkdir(parents=True)
    (done / "summary.json").write_text("{}")
    auto_quality.main(["run", "--what", "null", "--models", "gpt", "--links", "0.1", "--seeds", "0", "1",
                       "--quality", str(tmp_path), "--extra", "--steps", "6"])
    assert ran == [["--model", "gpt", "--hook", "none", "--bucket-mb", "0.25", "--seed", "0",
                    "--out", str(tmp_path / "null" / "gpt" / "seed0"), "--checkpoint-every", "100", "--steps", "6"]]


def report_args(results: Path, **options):
    """auto_quality's ``report`` arguments as its parser gives them for ``--results results``,
    with ``options`` (attribute: value) set."""
    import argparse

    import auto_quality

    parsed = auto_quality.build_parser().parse_args(["report", "--results", str(results)])
    return argparse.Namespace(**{**vars(parsed), **options})


def test_paired_link_runs_are_made_right_before_each_auto_run_and_price_its_seed(tmp_path, monkeypatch):
    """``run --what auto --pair``: each seed's paired link runs (a stale one removed) right before
    its auto run, none for a seed already done; the report prices a seed at its paired run, the
    others at the link run, and says which."""
    import auto_quality

    ran = []
    monkeypatch.setattr(auto_quality, "experiment", ran.append)
    link = tmp_path / "resnet20" / "link-1"
    stale = auto_quality.paired_folder(link, 0, "int8") / "steps.csv"
    stale.parent.mkdir(parents=True)
    stale.write_text("step,step_s\n1,9\n")
    (link / "auto" / "seed2").mkdir(parents=True)
    (link / "auto" / "seed2" / "summary.json").write_text("{}")
    auto_quality.main(["run", "--what", "auto", "--models", "resnet20", "--links", "1", "--seeds", "0", "2", "1",
                       "--auto", "auto-upd", "--pair", "none", "int8", "--link-steps", "5", "--results", str(tmp_path)])
    assert not stale.exists()
    assert [(r[r.index("--out") + 1], r[r.index("--hook") + 1]) for r in ran] == [
        (str(link / "paired" / "seed0" / "none"), "none"), (str(link / "paired" / "seed0" / "int8"), "int8"),
        (str(link / "auto" / "seed0"), "auto"),
        (str(link / "paired" / "seed1" / "none"), "none"), (str(link / "paired" / "seed1" / "int8"), "int8"),
        (str(link / "auto" / "seed1"), "auto")]
    assert all(r[r.index("--stop-after") + 1] == "5" and r[r.index("--link-gbps") + 1] == "1"
               for r in ran if "--stop-after" in r)
    assert ran[2][ran[2].index("--quality-coordinates") + 1] == "update"
    with pytest.raises(SystemExit, match="--pair and --auto are for --what auto"):
        auto_quality.main(["run", "--what", "links", "--pair", "none", "--results", str(tmp_path)])
    with pytest.raises(SystemExit, match="an auto configuration"):
        auto_quality.main(["run", "--what", "auto", "--auto", "int8", "--results", str(tmp_path)])
    with pytest.raises(ValueError, match="bad configuration 'int9'"):
        auto_quality.main(["run", "--what", "auto", "--pair", "int9", "--results", str(tmp_path)])

    # the report: the shipped ResNet-20 runs at 1 Gbit/s, seed 1 of int8 priced at a paired run
    # twice as slow as its link run; the other seeds as they were
    shipped = ROOT / "docs" / "results" / "auto-upd"
    results = tmp_path / "results"
    shutil.copytree(shipped / "resnet20" / "link-1", results / "resnet20" / "link-1")
    link_run = (results / "resnet20" / "link-1" / "int8" / "steps.csv").read_text().splitlines()
    header = link_run[0].split(",")
    at = header.index("step_s")
    doubled = [link_run[0]] + [",".join(str(2 * float(v)) if i == at else v for i, v in enumerate(line.split(",")))
                               for line in link_run[1:]]
    paired = auto_quality.paired_folder(results / "resnet20" / "link-1", 1, "int8") / "steps.csv"
    paired.parent.mkdir(parents=True)
    paired.write_text("\n".join(doubled) + "\n")
    before, after = (auto_quality.report(report_args(folder, coordinates="update"))["models"]["resnet20"]["1"]
                     for folder in (shipped, results))
    int8 = {name: {r["seed"]: r for r in next(row for row in e["fixed"] if row["config"] == "int8")["per_seed"]}
            for name, e in (("before", before), ("after", after))}
    assert [int8["after"][k]["priced_at"] for k in (0, 1, 2)] == ["link run", "paired", "link run"]
    assert int8["after"][1]["seconds"] == pytest.approx(2 * int8["before"][1]["seconds"])
    assert all(int8["after"][k]["seconds"] == int8["before"][k]["seconds"] for k in (0, 2))
    assert auto_quality.priced_at(next(row for row in after["fixed"] if row["config"] == "int8")) == \
        "link run 2, paired 1"
    # --seeds: only those judged
    two = auto_quality.report(report_args(results, coordinates="update", seeds=[0, 1]))["models"]["resnet20"]["1"]
    assert [r["seed"] for r in two["auto"]["per_seed"]] == [0, 1]
    assert all([r["seed"] for r in row["per_seed"]] == [0, 1] for row in two["fixed"])


def test_an_auto_run_under_another_budget_counts_only_when_it_admitted_the_same_methods():
    import auto_quality

    def summary(*decisions):
        return {"hook_stats": {"decisions": [{"quality": q, "refused": refused} for q, refused in decisions]}}

    # int4 at 0.02 is within 0.1, not within 0.01: the runs admitted different methods, unless the
    # measured table refused it anyway
    ratios = {"0": {"int8": 0.003, "int4": 0.02, "sign": 0.5}, "1": {"int8": 0.001, "int4": 0.2}}
    assert not auto_quality.admits_as(summary((ratios, {})), 0.1, 0.01)
    assert auto_quality.admits_as(summary((ratios, {"int4": "not reached"})), 0.1, 0.01)
    assert auto_quality.admits_as(summary(({"0": {"int8": 0.003, "int4": 0.2}}, {})), 0.1, 0.01)
    assert not auto_quality.admits_as(summary(({"0": {"int8": 0.003}}, {}), (ratios, {})), 0.1, 0.01)  # any evaluation
    assert not auto_quality.admits_as(summary(({"0": {"sign": 0.5}}, {})), 0.1, None)  # None: speed alone admits all


def test_the_report_judges_auto_runs_in_the_coordinates_they_measured_in():
    """docs/results/auto-upd holds auto runs given their optimizer: judged in the gradient's
    coordinates (at 0.01), every run is set aside and named: the GPT's (AdamW) for their
    coordinates, ResNet-20's (SGD: the same coordinates either way) for their budget (0.04 admitted
    int4, 0.01 does not); judged in the update's coordinates, none is."""
    import auto_quality

    assert auto_quality.run_coordinates({"optimizer": "sgd", "quality_coordinates": "update"}) == "either"
    assert auto_quality.run_coordinates({"optimizer": "adamw"}) == "gradient"  # before the flag
    folder = ROOT / "docs" / "results" / "auto-upd"
    gradient = auto_quality.report(report_args(folder, coordinates="gradient"))
    assert gradient["models"] == {} and set(gradient["set_aside"]) == {"gpt", "resnet20"}
    assert {r["coordinates"] for links in gradient["set_aside"].values() for runs in links.values()
            for r in runs} == {"update", "either"}
    assert all(r["coordinates"] == "either" and r["budget"] == 0.04
               for runs in gradient["set_aside"]["resnet20"].values() for r in runs)
    update = auto_quality.report(report_args(folder, coordinates="update"))
    assert update["budget"] == 0.04 and set(update["models"]) == {"gpt", "resnet20"} and update["set_aside"] == {}
    assert all(not e["auto"]["set_aside"] and e["auto"]["seeds"] == 3
               for links in update["models"].values() for e in links.values())


def test_quality_on_the_mean_over_seeds_admits_a_fixed_hook_that_misses_on_one_seed():
    """``--meets mean`` on the shipped ResNet-20 runs at 0.1 Gbit/s: sign misses uncompressed's
    accuracy by more than 0.5 points on a seed, so on every seed it does not meet the quality
    and int4 is the best fixed hook meeting it; on the mean over seeds it does (by hand below)
    and, faster, becomes the best."""
    import auto_quality

    every, mean = (auto_quality.report(report_args(ROOT / "docs" / "results" / "auto-upd", coordinates="update",
                                                   meets=rule))["models"]["resnet20"]["0.1"]
                   for rule in ("every", "mean"))
    sign = next(r for r in mean["fixed"] if r["config"] == "sign")
    gaps = [r["heldout_accuracy"] - r["base"]["heldout_accuracy"] for r in sign["per_seed"]]
    assert min(gaps) < -0.005 <= sum(gaps) / len(gaps)  # one seed out, the mean in
    assert not next(r for r in every["fixed"] if r["config"] == "sign")["meets"] and sign["meets"]
    assert sign["meets_on"] == sum(g >= -0.005 for g in gaps) < sign["seeds"]
    assert (every["goals"]["best_fixed"], mean["goals"]["best_fixed"]) == ("int4", "sign")


def test_bench_auto_runs_under_the_former_budget_admitted_what_the_default_admits():
    """docs/auto.md's claim on benchmarks/results/bench_auto.json (run under budget 0.1): every
    recorded evaluation admitted the same methods per bucket as the default budget would."""
    import auto_quality

    from gradcomp.analysis.auto import DEFAULT_QUALITY_BUDGET

    def decisions(node):
        if isinstance(node, dict):
            if {"quality", "refused", "choices"} <= set(node):
                yield node
            for value in node.values():
                yield from decisions(value)
        elif isinstance(node, list):
            for value in node:
                yield from decisions(value)

    found = list(decisions(json.loads((ROOT / "benchmarks" / "results" / "bench_auto.json").read_text())))
    budgeted = [d for d in found if d.get("quality_budget") is not None]
    assert {d["quality_budget"] for d in budgeted} == {0.1}
    assert all(auto_quality.admits_as({"hook_stats": {"decisions": [d]}}, 0.1, DEFAULT_QUALITY_BUDGET)
               for d in budgeted)
    count = sum(len(d["quality"]) for d in budgeted)
    assert f"equal the default {DEFAULT_QUALITY_BUDGET:g}'s at all {count} bucket-evaluations" in \
        " ".join((ROOT / "docs" / "auto.md").read_text().split())


def check_bench_ops(out: str, report: dict) -> None:
    rows = {r["method"]: r for r in report["ops"]}
    assert set(rows) == set(gradcomp.METHODS)
    x = torch.randn(1 << 16)
    for name, row in rows.items():
        assert row["numel"] == 1 << 16 and row["ratio"] == pytest.approx(gradcomp.compress(x, name).ratio), name
    assert report["topk"]["kept_exact"] == report["topk"]["k"] == gradcomp.get_method("topk", ratio=0.01).k(1 << 16)
    assert "copy fraction" in out


def check_bench_powersgd(out: str, report: dict) -> None:
    (result,) = report["results"]
    assert result["model"] == "gpt" and set(result["step_s"]) == {"gradcomp", "torch", "allreduce"}
    wire = result["wire_bytes_per_step"]
    assert wire["gradcomp"] == pytest.approx(wire["torch"], rel=0.01) and wire["gradcomp"] < wire["allreduce"] / 10
    assert "vs torch" in out


def check_breakeven_validation(out: str, report: dict) -> None:
    assert report["rates_gbps"] == [None] and report["crossovers"] == []
    assert report["malloc"] == KEEP_FREED_MEMORY  # the ranks ran with these settings
    assert [p["method"] for p in report["points"]] == [
        "none", "fp16", "int8:allgather", "int8:twophase", "sign:allgather", "topk", "powersgd"]
    assert all(p["measured_s"] > 0 and p["predicted_s"] > 0 for p in report["points"])
    assert "median |error|" in out and "crossovers: not measured" in out
    # the hook's own compress + decompress seconds per step, beside the model's
    assert all(p["hook_measured_s"] > 0 and p["hook_predicted_s"] > 0 for p in report["points"][1:])
    # --replay predicts the recorded launches again, without training: the same points
    with tempfile.TemporaryDirectory() as tmp:
        recorded, replayed = Path(tmp) / "run.json", Path(tmp) / "replayed.json"
        recorded.write_text(json.dumps(report))
        run_script("benchmarks/breakeven_validation.py", "--replay", str(recorded), "--json", str(replayed))
        again = json.loads(replayed.read_text())
    assert again["points"] == report["points"] and again["replayed"] == str(recorded)
    assert again["malloc"] == KEEP_FREED_MEMORY
    # --sweeps: a rate's launches pooled, each point the median over them (of two: their mean)
    slower = copy.deepcopy(report["launches"][0])
    for rank in slower:
        rank["steps"]["powersgd"] = [[3 * t for t in times] for times in rank["steps"]["powersgd"]]
    with tempfile.TemporaryDirectory() as tmp:
        recorded, replayed = Path(tmp) / "run.json", Path(tmp) / "replayed.json"
        recorded.write_text(json.dumps({**report, "rates_gbps": [None, None],
                                        "launches": report["launches"] + [slower]}))
        run_script("benchmarks/breakeven_validation.py", "--replay", str(recorded), "--json", str(replayed))
        pooled = {p["method"]: p for p in json.loads(replayed.read_text())["points"]}
    for point in report["points"]:
        again = pooled[point["method"]]
        assert again["launches"] == 2 and again["predicted_s"] == pytest.approx(point["predicted_s"])
        factor = 2 if point["method"] == "powersgd" else 1
        assert again["measured_s"] == pytest.approx(factor * point["measured_s"])
    # two sweeps of 1 and 2 Gbit/s (the launch again, `none` made 100x / 50x slower at 1 and 100x
    # / 50x faster at 2): each sweep's crossover from its own speedups, log-log interpolated
    none_factors = [(100.0, 0.01), (50.0, 0.02)]
    launches = []
    for sweep in none_factors:
        for factor in sweep:
            launch = copy.deepcopy(report["launches"][0])
            for rank in launch:
                rank["steps"]["none"] = [[factor * t for t in times] for times in rank["steps"]["none"]]
            if factor > 1:  # the slower link's sweep: twice the seconds, and 1 ns a byte more (the smoke
                # run's own sweep on a busy machine can fit no per-byte cost at all: doubling 0 shows no shaping)
                network = launch[0]["network"]
                network.update({key: [2 * t + 1e-9 * size for t, size in zip(network[key], network["sizes"])]
                                for key in ("allreduce_s", "allgather_s", "reduce_scatter_s", "alltoall_s")})
            launches.append(launch)
    with tempfile.TemporaryDirectory() as tmp:
        recorded, replayed = Path(tmp) / "run.json", Path(tmp) / "replayed.json"
        recorded.write_text(json.dumps({**report, "rates_gbps": [1.0, 2.0, 1.0, 2.0], "launches": launches}))
        out = run_script("benchmarks/breakeven_validation.py", "--replay", str(recorded), "--json", str(replayed))
        crossovers = json.loads(replayed.read_text())["crossovers"]
    assert "measured in each sweep" in out.stdout
    steps = {p["method"]: p["measured_s"] for p in report["points"]}
    for crossover in crossovers:
        expected = []
        for at_1, at_2 in none_factors:
            s1, s2 = (f * steps["none"] / steps[crossover["method"]] for f in (at_1, at_2))
            expected.append(math.exp(math.log(2.0) * math.log(s1) / (math.log(s1) - math.log(s2))))
        assert crossover["measured_gbps_per_sweep"] == pytest.approx(expected), crossover
    # launches whose sweeps do not slow down at the lower rate: a clear error, no nonsense link
    flat = {**report, "rates_gbps": [1.0, 2.0], "launches": [report["launches"][0]] * 2}
    with tempfile.TemporaryDirectory() as tmp:
        recorded = Path(tmp) / "run.json"
        recorded.write_text(json.dumps(flat))
        done = subprocess.run([sys.executable, "benchmarks/breakeven_validation.py", "--replay", str(recorded)],
                              cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "no slower at lower rates" in done.stderr


def check_roofline(out: str, report: dict) -> None:
    """The H100 roofline of 532ad50's kernels, without a GPU: three rows within 25% of their
    measured times (bound by bytes, and by instructions)."""
    assert report["commit"] == "532ad50" and "3 of 3 rows within 25%" in out
    rows = {f"{r['method']} {r['op']}": r for r in report["rows"]}
    assert set(rows) == {"fp16 compress+EF", "int8 decode-sum p=8", "sign decode-sum p=64"}
    assert all(abs(r["ratio"] - 1) <= 0.25 for r in rows.values()), rows
    assert rows["fp16 compress+EF"]["bound"] == "bytes" and rows["sign decode-sum p=64"]["bound"] != "bytes"


def check_time_to_target_validation(out: str, report: dict) -> None:
    """The tiny GPT calibrated on 2 unshaped ranks (every configuration a step time > 0), priced
    on synthetic runs: the uncompressed run's measured seconds by hand, a calibration factor,
    "not reached" on both sides, a configuration without a calibration row counted unmeasured."""
    rows = {r["config"]: r for r in report["models"]["gpt"]["links"]["none"]["rows"]}
    assert list(rows) == ["none", "int8", "topk-1pct", "powersgd-r1"]
    assert all(r["predicted"]["step_s"] > 0 for r in rows.values())
    assert rows["none"]["measured"]["time_s"] == pytest.approx(40 * 0.1)  # 0.2, 0.1, 0.1, 0.1: the median
    assert rows["none"]["predicted"]["time_s"] == pytest.approx(rows["none"]["predicted"]["step_s"] * 40)
    assert rows["int8"]["predicted"]["steps_factor"] == pytest.approx(0.5)
    assert rows["topk-1pct"]["agreement"] == "both not reached"
    assert rows["powersgd-r1"]["agreement"] == "no prediction (quality unmeasured)"
    assert set(report["references"]) >= {"always uncompressed", "step time only"} and report["cannot_catch"]
    assert "pred./meas." in out and "what this check can catch" in out
    null = report["models"]["gpt"]["links"]["none"]["null"]  # synthetic: ends 1.5% above, never at the target
    assert null["agreement"] == "predicted reached, measured not reached" and null["over_uncompressed"] is None
    assert report["summary"]["null"] == {"settings": 1, "agree": 0, "reached": 0}
    assert "null (uncompressed, buckets of 0.25 MB: fp32 rounding alone): measured steps to target - (not reached)" in out
    score = report["models"]["gpt"]["links"]["none"]["score"]  # --markdown's row says the same
    assert f"| gpt | unshaped | {score['agree']} of 4 | {score['best']['predicted_best']} / " in out, out[-2000:]


SMOKE = {
    "benchmarks/auto_quality.py": check_auto_quality,
    "benchmarks/bench_auto.py": check_bench_auto,
    "benchmarks/bench_fsdp.py": check_bench_fsdp,
    "benchmarks/bench_gpu.py": check_bench_gpu,
    "benchmarks/bench_hierarchical.py": check_bench_hierarchical,
    "benchmarks/bench_hooks.py": check_bench_hooks,
    "benchmarks/bench_kernels.py": check_bench_kernels,
    "benchmarks/bench_ops.py": check_bench_ops,
    "benchmarks/bench_powersgd.py": check_bench_powersgd,
    "benchmarks/bench_traffic.py": check_bench_traffic,
    "benchmarks/breakeven_validation.py": check_breakeven_validation,
    "benchmarks/noise_ratios.py": check_noise_ratios,
    "benchmarks/roofline.py": check_roofline,
    "benchmarks/time_to_target_validation.py": check_time_to_target_validation,
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_smoke_run(script, tmp_path):
    path = tmp_path / "report.json"
    done = run_script(script, "--smoke", "--json", str(path))
    SMOKE[script](done.stdout, json.loads(path.read_text()) if path.exists() else None)


@pytest.mark.slow
def test_experiment_run_report_and_curves(tmp_path):
    """examples/experiment.py run (with --quiet: still its result line), report, and
    examples/optim_curves.py on that run."""
    run_dir = tmp_path / "sweep" / "resnet20" / "none" / "seed0"
    done = run_script("examples/experiment.py", "run", "--model", "resnet20", "--world-size", "1", "--steps", "2",
                      "--eval-every", "2", "--batch-size", "4", "--digits-side", "8", "--quiet", "--out", str(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    with open(run_dir / "steps.csv", newline="") as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["1", "2"]
    (line,) = done.stdout.splitlines()
    assert line.startswith(f"resnet20/none seed 0: held-out accuracy {summary['final_heldout_accuracy']:.2%}")
    assert f"{summary['wire_bytes'] / 1e6:.2f} MB sent per rank" in line and done.stderr.count("[#") == 0

    done = run_script("examples/experiment.py", "report", str(tmp_path / "sweep"))
    assert "## resnet20" in done.stdout and "none" in done.stdout
    assert (tmp_path / "sweep" / "resnet20_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    png = tmp_path / "curves.png"
    done = run_script("examples/optim_curves.py", "--out", str(png), f"none={run_dir.parent}")
    assert done.stdout.strip() == f"wrote {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the run as its own link run: its time to its own final loss is its two steps' seconds
    records = tmp_path / "time.json"
    with open(run_dir / "steps.csv", newline="") as f:
        seconds = [float(row["step_s"]) for row in csv.DictReader(f)]
    done = run_script("examples/time_to_loss.py", "--target", str(run_dir), "--json", str(records),
                      f"none={run_dir}@{run_dir}")
    (record,) = json.loads(records.read_text())
    assert record["reached"] and record["steps"] == 2 and record["seconds"] == sum(seconds)
    assert "none" in done.stdout
