"""Every code block of README.md runs as written.

Python blocks run on 2 Gloo ranks, each with a fresh ``net`` (the text's "your module"; every
block that names it says so) and nothing else given: a block must import what it uses. After a
block, every DDP model and FSDP module it made trains one step, and every optimizer it made
steps, so a hook or optimizer that is registered but broken fails here too. Every line of a
bash block is either run here or mapped below to the test or CI step that runs it; a new README
command that nothing runs fails ``test_every_bash_line_is_run_somewhere``.

Every number of the README's results table and of "Does it pay?" is re-derived here from the
result file it comes from (or, for the printed verdict, from the command's own output), and the
doc each row links is checked to give the command that prints it: a number and its file that
part fail a test.
"""
from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import run_ranks

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

RUN_HERE = ("gradcomp breakeven --model", "gradcomp calibrate", "gradcomp breakeven --profile")
"""Bash lines this module runs itself (in a temporary folder)."""

RUN_ELSEWHERE = {
    "bash scripts/demo.sh": "tests/test_demo.py (the demo's parts; the whole demo is minutes) and "
                            "tests/test_scripts.py (the script parses, its install extras exist)",
    "bash scripts/test.sh": ".ci/run (the whole suite from a clean clone)",
    "python -m pip install --no-deps --no-build-isolation -e .": "GPU machines only (no network there)",
    "python -m pytest -m cuda": "GPU machines only: the CUDA tests (skipped without CUDA)",
    "python benchmarks/bench_gpu.py --json bench_gpu.json": "GPU machines only; its --smoke run (no GPU) "
                                                            "in tests/test_scripts.py",
}
"""Bash lines run by something other than this module, and what runs them."""


def readme_blocks(language: str) -> list[str]:
    """The fenced code blocks of README.md in ``language``, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def bash_lines() -> list[str]:
    """Every command of the README's bash blocks, comments stripped."""
    lines = []
    for block in readme_blocks("bash"):
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                lines.extend(part.strip() for part in command.split("&&"))
    return lines


def test_readme_has_the_blocks_this_module_runs():
    assert len(readme_blocks("python")) >= 4
    assert any(line.startswith("gradcomp breakeven --profile") for line in bash_lines())


def test_every_bash_line_is_run_somewhere():
    orphans = [line for line in bash_lines()
               if not line.startswith(RUN_HERE) and line not in RUN_ELSEWHERE]
    assert not orphans, f"README commands no test runs: {orphans}"
    # the scripts named there exist, and what maps them is still in the README
    for line in RUN_ELSEWHERE:
        assert line in bash_lines(), f"{line!r} left the README: drop it from RUN_ELSEWHERE"
        script = next((word for word in line.split() if word.endswith((".sh", ".py"))), None)
        if script:
            assert (ROOT / script).is_file(), script


def _command(line: str) -> list[str]:
    words = line.split()
    return [sys.executable, "-m", "gradcomp.cli", *words[1:]] if words[0] == "gradcomp" else words


def _run(line: str, cwd: Path, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a README bash line run in ``cwd``. ``gradcomp breakeven``
    runs in this process, through gradcomp.cli.main (what the console script and ``python -m
    gradcomp.cli`` call: argument parsing, analysis, printing and the plot are the same; 0.1-1.4 s
    instead of 2-5 s, most of them a fresh interpreter importing torch); the rest (``gradcomp
    calibrate`` starts Gloo ranks and sets environment variables) in a subprocess."""
    words = line.split()
    if words[:2] != ["gradcomp", "breakeven"]:
        done = subprocess.run(_command(line), cwd=cwd, capture_output=True, text=True, timeout=300)
        return done.returncode, done.stdout, done.stderr
    from gradcomp.cli import main

    capsys.readouterr()
    previous = os.getcwd()
    os.chdir(cwd)  # its files (--profile, --plot) are relative to where it runs
    try:
        status = main(words[1:])
    finally:
        os.chdir(previous)
    out = capsys.readouterr()
    return status, out.out, out.err


def _verdict_command() -> str:
    """The README's first breakeven command: test_does_it_pay_shows_what_its_command_prints runs it."""
    return next(line for line in bash_lines() if line.startswith("gradcomp breakeven --model") and "--sweep" not in line)


def test_bash_lines_run_here(tmp_path, capsys):
    """The analyser's commands, in the README's order (calibrate writes what breakeven reads), but
    the first verdict's, which test_does_it_pay_shows_what_its_command_prints runs and compares."""
    for line in bash_lines():
        if line.startswith(RUN_HERE) and line != _verdict_command():
            status, out, err = _run(line, tmp_path, capsys)
            assert status == 0, f"{line}\n{out}\n{err}"
            assert "verdict" in out or "profile written" in out or "plot written" in out, line
            if "--plot" in line:
                png = tmp_path / line.split("--plot")[1].split()[0]
                assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", line


def test_the_picture_is_what_its_command_draws():
    """The README shows the bandwidth sweep's PNG (committed under docs/, small) and the command
    that draws it under the same name; the command itself runs in test_bash_lines_run_here."""
    sweeps = [line for line in bash_lines() if "--sweep bandwidth" in line and "--plot" in line]
    assert len(sweeps) == 1, sweeps
    name = sweeps[0].split("--plot")[1].split()[0]
    assert f"](docs/{name})" in README.read_text()
    picture = ROOT / "docs" / name
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size < 200_000


def test_the_distorted_resnet_auto_row_is_its_result_file():
    """auto on ResNet-20 with 2,872 held-out images: settings met, auto over the best fixed hook
    per link, over uncompressed where int4 was best, and the null's largest accuracy move,
    re-derived from auto_quality_distort8.json; the doc gives the command."""
    import json

    links = json.loads((ROOT / "benchmarks" / "results" / "auto_quality_distort8.json").read_text())["models"]["resnet20"]
    row = _results_row("`auto` on ResNet-20, 2,872 held-out images")
    met = sum(e["auto"]["meets"] for e in links.values())
    assert f"within 0.5 points of uncompressed's in {met} of {len(links)} settings" in row, row
    for link, name in (("none", "unshaped"), ("1", "1 Gbit/s")):
        assert f"{links[link]['goals']['auto_over_best']:.3f}x ({name})" in row, (link, row)
    slow = links["0.1"]
    assert slow["goals"]["best_fixed"] == "int4" and f"{slow['goals']['auto_over_best']:.3f}x at 0.1 Gbit/s" in row
    assert f"{slow['goals']['auto_over_none']:.3f}x uncompressed's time" in row, row
    none = {r["seed"]: r for r in slow["fixed"][0]["per_seed"]}
    moved = max(abs(r["heldout_accuracy"] - none[r["seed"]]["heldout_accuracy"]) for r in slow["null"]["per_seed"])
    assert f"by up to {moved * 100:.2f} points" in row, row
    _doc_gives("auto.md", "--results docs/results/distort8/auto --json benchmarks/results/auto_quality_distort8.json")
    wider = json.loads((ROOT / "benchmarks" / "results" / "auto_quality_distort8_q0.04.json").read_text())
    assert wider["budget"] == 0.04
    wider = wider["models"]["resnet20"]
    assert wider["0.1"]["auto"]["choices"] and all(c == {"int4:twophase": 1.0} for c in wider["0.1"]["auto"]["choices"].values())
    met = sum(e["auto"]["meets"] for e in wider.values())
    assert (f"at `quality_budget=0.04` auto takes int4 there and reaches the quality in "
            f"{wider['0.1']['goals']['auto_over_best']:.3f}x the best fixed hook's time (quality met in {met} of "
            f"{len(wider)} settings; {wider['1']['goals']['auto_over_best']:.3f}x and "
            f"{wider['none']['goals']['auto_over_best']:.3f}x at 1 Gbit/s and unshaped") in row, row
    _doc_gives("auto.md", "--results docs/results/distort8/auto-q0.04 --json benchmarks/results/auto_quality_distort8_q0.04.json")


# ---- python blocks, on 2 Gloo ranks ---------------------------------------------------------
def _fresh_net():
    import torch

    torch.manual_seed(0)  # the same initial weights on every rank, as a user's script has
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _train_step(objects, rank):
    """One forward/backward through every model in ``objects``, then a step of every optimizer;
    what each reports afterwards."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel as DDP

    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    models = [m for m in objects if isinstance(m, (DDP, FSDPModule))]
    inner = {id(child) for m in models for child in m.modules() if child is not m}
    trained = 0
    for model in models:
        if id(model) not in inner:  # roots only (a block's loop variable may hold a sharded layer)
            loss = model(batch).square().mean()
            loss.backward()
            trained += 1
            for p in model.parameters():
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                assert grad is not None and torch.isfinite(grad).all()
    for optimizer in objects:
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer.step()
            trained += 1
    return trained


def _run_blocks(rank, world_size, blocks):
    trained = []
    for i, block in enumerate(blocks):
        namespace = {"net": _fresh_net()}
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)
        trained.append(_train_step(list(namespace.values()), rank))
    return trained


def test_python_blocks_run_on_two_ranks():
    blocks = readme_blocks("python")
    trained = run_ranks(_run_blocks, 2, blocks, timeout_s=120)
    assert trained[0] == trained[1]
    names = ["DDP", "FSDP", "optimizer"]
    for name, pattern in zip(names, (r"DDP\(net\)", r"fully_shard\(net\)", r"optim\.\w+\(net")):
        using = [i for i, block in enumerate(blocks) if re.search(pattern, block)]
        assert using, f"no README block uses {name}"
        assert all(trained[0][i] > 0 for i in using), (name, trained[0])


def test_import_gradcomp_alone_reaches_every_subpackage():
    """The README writes gradcomp.hooks / .fsdp / .optim after a plain ``import gradcomp``; the
    import itself stays light (no subpackage loaded until first use)."""
    code = ("import sys, gradcomp\n"
            "assert not any(m in sys.modules for m in ('gradcomp.hooks', 'gradcomp.optim', 'gradcomp.fsdp'))\n"
            "print(gradcomp.hooks.register.__name__, gradcomp.optim.local_gradients.__name__,\n"
            "      gradcomp.fsdp.compress.__name__, gradcomp.integrations.__name__, gradcomp.analysis.__name__)\n"
            "try:\n    gradcomp.no_such_thing\nexcept AttributeError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:3] == ["register", "local_gradients", "compress"]
    assert "no attribute 'no_such_thing'" in done.stdout


@pytest.mark.parametrize("block", readme_blocks("python")[:1])
def test_first_block_needs_no_process_group(block):
    """The first snippet (compress a tensor) runs in a plain process, its numbers as printed."""
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["p"].nbytes == 4_259_840


def _results_row(prefix: str) -> str:
    """The README results table's row that starts with ``| prefix``."""
    rows = [line for line in README.read_text().splitlines() if line.startswith(f"| {prefix}")]
    assert len(rows) == 1, f"one README results row starting with {prefix!r}, found {len(rows)}"
    return rows[0]


def _span(values) -> str:
    values = sorted(values)
    return f"{values[0]:.2f}-{values[-1]:.2f}"


def test_the_gpu_rows_are_their_result_files():
    """The H200 kernels row: every fraction of a copy and PowerSGD's ratios, re-derived from the
    run's JSON files (100M elements)."""
    import json

    results = ROOT / "benchmarks" / "results"
    run = json.loads((results / "bench_gpu_h200_d75eb4b.json").read_text())
    sign = json.loads((results / "gpu_h200_d75eb4b" / "bench_sign_rank_by_rank.json").read_text())
    at_100m = {(r["method"], r["op"]): r for r in run["rows"] if r["n"] == 100_000_000}
    sign_100m = {r["op"]: r for r in sign["rows"] if r["n"] == 100_000_000}
    fraction = {key: r["copy_fraction"] for key, r in at_100m.items()}
    decodes = [f"decode-sum p={p}" for p in (2, 8, 64)]
    expected = [
        _span(fraction[(m, "compress+EF")] for m in ("fp16", "bf16", "int8", "int4", "sign")),
        _span(fraction[(m, "decode-sum p=2")] for m in ("fp16", "bf16", "int8")),
        f"int4 ({_span(fraction[('int4', op)] for op in decodes)})",
        f"sign ({_span(sign_100m[op]['copy_fraction'] for op in decodes)})",
        f"compress {fraction[('topk', 'compress+EF')]:.2f}",
        f"64 payloads {fraction[('topk', 'decode-sum p=64')]:.2f}",
    ]
    powersgd = {r["op"]: r["kernel_ms"] / r["baseline_ms"] for r in sorted(run["rows"], key=lambda r: r["n"])
                if r["method"] == "powersgd"}  # the largest bucket's hook last
    expected += [f"{powersgd['hook']:.2f}x", f"({powersgd['hook gpt2-small block']:.2f}x on a GPT-2 block)"]
    row = _results_row("Triton kernels, one H200")
    for text in expected:
        assert text in row, (text, row)


def test_the_auto_row_is_its_result_file():
    """The auto row: the budgeted variants' worst ratio to the best fixed hook they may choose and
    their span against no compression where compression pays, and every variant's span against
    DDP's all-reduce on the unshaped loopback, re-derived from bench_auto.json."""
    import json

    rows = json.loads((ROOT / "benchmarks" / "results" / "bench_auto.json").read_text())["rows"]
    budgeted = [r for r in rows if r["link"] != "unshaped" and r["auto"] in ("auto", "auto+opt-in")]
    unshaped = [r for r in rows if r["link"] == "unshaped"]
    row = _results_row("`auto` hook")
    assert f"at most {max(r['vs_best'] for r in budgeted):.3f}x" in row, row
    assert f"{_span(r['vs_none'] for r in budgeted)}x that of no compression" in row, row
    assert f"{_span(r['vs_none'] for r in unshaped)}x DDP's all-reduce" in row, row
    assert all(not {"sign:allgather", "sign:twophase", "topk"} & set(r["auto_choice"]) for r in budgeted)


def test_the_auto_quality_row_is_its_result_file():
    """auto trained to the end: the settings whose quality it met, and its time to quality (and
    step) against the best fixed hook, split by whether a fixed hook beat uncompressed there,
    re-derived from auto_quality.json; the doc gives the command."""
    import json

    models = json.loads((ROOT / "benchmarks" / "results" / "auto_quality.json").read_text())["models"]
    entries = [entry for links in models.values() for entry in links.values()]
    pays = [e["goals"] for e in entries if e["goals"]["best_fixed"] != "none"]
    not_pays = [e["goals"] for e in entries if e["goals"]["best_fixed"] == "none"]
    row = _results_row("`auto` trained to the end")
    met = sum(e["auto"]["meets"] for e in entries)
    assert f"quality within tolerance of uncompressed's in {met} of {len(entries)} settings" in row, row
    assert f"{_span(g['auto_over_best'] for g in pays)}x the best such hook's" in row, row
    assert f"{_span(g['auto_over_none'] for g in not_pays)}x uncompressed's" in row, row
    assert f"per step {_span(g['step_over_none'] for g in not_pays)}x" in row, row
    for model, links in models.items():  # a setting whose quality was missed: the seeds that missed it
        for entry in (e for e in links.values() if not e["auto"]["meets"]):
            assert entry["fixed"][0]["config"] == "none"
            base = {r["seed"]: r for r in entry["fixed"][0]["per_seed"]}  # none's row
            for r in (r for r in entry["auto"]["per_seed"] if not r["meets"]):
                if model == "gpt":
                    gap = f"{(r['heldout_loss'] / base[r['seed']]['heldout_loss'] - 1) * 100:+.1f}% loss"
                else:  # ResNet-20: accuracy, in test images
                    gap = f"{round((base[r['seed']]['heldout_accuracy'] - r['heldout_accuracy']) * 359)} images under"
                assert gap in row, (model, gap, row)
    assert all(r["meets"] for e in entries for r in e["null"]["per_seed"]) and \
        "meets the quality on every seed in every setting" in row, row
    for model, name in (("resnet20", "ResNet-20"), ("gpt", "the GPT")):  # the null's time over uncompressed's
        ratios = [r["seconds"] / base["seconds"] for e in models[model].values()
                  for r, base in zip(e["null"]["per_seed"], e["fixed"][0]["per_seed"])]
        assert f"{_span(ratios)}x uncompressed's per seed on {name}" in row or \
            f"and {_span(ratios)}x on {name}" in row, (model, _span(ratios), row)
    taken = {label.split(":")[0] for e in entries for shares in e["auto"]["choices"].values() for label in shares}
    assert not taken & {"sign", "topk", "powersgd"} and "sign, top-k and PowerSGD never taken" in row, (taken, row)
    _doc_gives("auto.md", "python benchmarks/auto_quality.py report --markdown --json benchmarks/results/auto_quality.json")


def test_the_time_to_target_row_is_its_result_file():
    """The analyser's time to target against the training runs: the rows that agree, the trivial
    predictor's and the step-time side's, and the settings where the goal is met, from the
    report's JSON; the doc gives the command."""
    summary = _load(ROOT / "docs" / "results" / "time-to-target" / "report.json")["summary"]
    a, refs = summary["analyser"], summary["references"]
    row = _results_row("analyser's time to target vs training")
    assert f"{a['agree']} of {a['rows']} rows agree" in row, row
    assert f"always-uncompressed predictor: {refs['always uncompressed']['agree']}" in row, row
    assert f"step-time side alone: {refs['predicted step x measured factor']['agree']}" in row, row
    assert f"in {a['settings_met']} of {a['settings']} settings" in row, row
    null = summary["null"]  # uncompressed against itself, measured as the rows are
    assert f"the null reaches the target in {null['reached']} of {null['settings']} settings" in row, row
    models = _load(ROOT / "docs" / "results" / "time-to-target" / "report.json")["models"]
    for model, name in (("gpt", "the GPT"), ("resnet20", "ResNet-20")):  # each calibration's target
        assert f"+ {round(100 * models[model]['target_tolerance'])}% on {name}" in row, (model, row)
    _doc_gives("breakeven.md", "python benchmarks/time_to_target_validation.py report --markdown --json "
                               "docs/results/time-to-target/report.json")


# ---- every other number of the results table and of "Does it pay?", from its file -------------
RESULTS = ROOT / "benchmarks" / "results"


def _load(path: Path):
    import json

    return json.loads(path.read_text())


def test_the_ten_seeds_row_is_its_result_file():
    """auto on ResNet-20 over ten seeds, quality on the mean, each seed priced in auto's own window:
    every figure of the row re-derived from auto_quality_paired10.json (the best fixed hook, auto's
    time over it and over uncompressed, the null's seeds), auto_quality_paired.json (seeds 0-2 on
    every seed) and, for the unpaired figure, auto_quality_seeds10.json; the doc gives the commands."""
    result = _load(RESULTS / "auto_quality_paired10.json")
    assert (result["meets"], result["coordinates"], result["budget"]) == ("mean", "update", 0.04)
    links = result["models"]["resnet20"]
    row = _results_row("`auto` on ResNet-20, ten seeds")
    assert all(r["priced_at"] == "paired" for e in links.values() for config in e["fixed"] for r in config["per_seed"])
    assert all(e["auto"]["meets"] and e["auto"]["seeds"] == 10 for e in links.values()) and "met at every link" in row
    nulls = {(e["null"]["seeds"] - e["null"]["meets_on"], e["null"]["seeds"]) for e in links.values()}
    assert nulls == {(1, 10)} and "misses it: 1 of 10" in row, nulls
    g = {rate: e["goals"] for rate, e in links.items()}
    assert (g["1"]["best_fixed"], g["0.1"]["best_fixed"], g["none"]["best_fixed"]) == ("fp16", "powersgd-r4", "none")
    assert f"{g['1']['auto_over_best']:.3f}x the best fixed hook's (fp16) at 1 Gbit/s" in row, row
    assert f"{g['1']['auto_over_none']:.3f}x uncompressed's" in row
    assert f"at 0.1 Gbit/s {g['0.1']['auto_over_best']:.3f}x PowerSGD rank 4's" in row
    assert f"unshaped {g['none']['auto_over_none']:.3f}x uncompressed's" in row
    unpaired = _load(RESULTS / "auto_quality_seeds10.json")["models"]["resnet20"]["none"]["goals"]
    assert f"one earlier link run: {unpaired['auto_over_none']:.3f}x" in row
    fixed = {r["config"]: r for r in links["0.1"]["fixed"]}
    assert f"auto: {links['0.1']['auto']['seconds'] / fixed['int4']['seconds']:.2f}x int4's" in row
    gap = (fixed["powersgd-r4"]["heldout_accuracy"] - fixed["none"]["heldout_accuracy"]) * 100
    assert f"on the mean ({gap:.2f} points)" in row, gap
    three = _load(RESULTS / "auto_quality_paired.json")
    assert three["meets"] == "every"
    entries = [three["models"]["resnet20"][rate] for rate in ("0.1", "1", "none")]
    assert all(e["auto"]["meets"] and e["auto"]["seeds"] == 3 and e["goals"]["within_10pct_of_best"] for e in entries)
    slow, mid, fast = (f"{e['goals']['auto_over_best']:.3f}x" for e in entries)
    assert f"time {slow}, {mid} and {fast} the best fixed" in row, row
    _doc_gives("auto.md", "--results docs/results/paired/auto --json benchmarks/results/auto_quality_paired10.json")
    _doc_gives("auto.md", "--results docs/results/paired/auto --json benchmarks/results/auto_quality_paired.json")


def test_the_auto_given_its_optimizer_row_is_its_result_file():
    """auto given the optimizer (the update's coordinates, budget 0.04), trained to the end: the
    settings whose quality it met, its time to quality and per step against the best fixed hook
    where one beats uncompressed, and how much int4 the GPT took at 0.1 Gbit/s, re-derived from
    auto_quality_update.json; the doc gives the command."""
    import json

    result = json.loads((ROOT / "benchmarks" / "results" / "auto_quality_update.json").read_text())
    assert (result["coordinates"], result["budget"]) == ("update", 0.04)
    entries = [entry for links in result["models"].values() for entry in links.values()]
    pays = [e["goals"] for e in entries if e["goals"]["best_fixed"] not in (None, "none")]
    row = _results_row("`auto` given the optimizer")
    met = sum(e["auto"]["meets"] for e in entries)
    assert f"quality within tolerance of uncompressed's in {met} of {len(entries)} settings" in row, row
    assert f"{_span(g['auto_over_best'] for g in pays)}x the best such hook's" in row, row
    within = sum(g["within_10pct_of_best"] for g in pays)
    assert f"within 10% in {within} of {len(pays)}" in row, row
    assert f"per step {_span(g['step_over_best'] for g in pays)}x" in row, row
    ahead = sum(bool(g.get("ahead_of_none")) for g in pays)
    assert f"ahead of uncompressed in {ahead} of {len(pays)}" in row, row
    choices = result["models"]["gpt"]["0.1"]["auto"]["choices"].values()
    int4 = _mean(sum(v for label, v in c.items() if label.startswith("int4")) for c in choices)
    assert f"int4 in {int4 * 100:.0f}% of its bucket-evaluations" in row, row
    _doc_gives("auto.md", "--results docs/results/auto-upd --json benchmarks/results/auto_quality_update.json")


def _doc_gives(doc: str, command: str) -> None:
    """``docs/<doc>`` quotes ``command`` (continuation lines joined), and the README's row links it."""
    text = " ".join((ROOT / "docs" / doc).read_text().replace("\\\n", " ").split())
    assert command in text, f"docs/{doc} does not give {command!r}"


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _runs(folder: str) -> list[dict]:
    """The summary.json of every seed of one configuration under docs/results."""
    runs = [_load(p) for p in sorted((ROOT / "docs" / "results" / folder).glob("seed*/summary.json"))]
    assert runs, folder
    return runs


def test_the_cpu_methods_row_is_its_result_file():
    """Copy fractions (wall) of bench_ops.json, every size: the five element-wise methods' span,
    PowerSGD's and top-k's."""
    ops = _load(RESULTS / "bench_ops.json")["ops"]
    assert {r["numel"] for r in ops} == {1_000_000, 25_000_000, 100_000_000}

    def span(methods):
        return _span(r["copy_fraction"] for r in ops if r["method"] in methods)

    row = _results_row("methods on CPU")
    assert f"at {span({'fp16', 'bf16', 'int8', 'int4', 'sign'})} of a memory copy's speed for fp16, bf16, int8, " \
           "int4 and sign" in row, row
    assert f"PowerSGD {span({'powersgd'})}, top-k {span({'topk'})} (1M-100M elements, 2 cores)" in row, row
    assert "[methods.md](docs/methods.md)" in row
    _doc_gives("methods.md", "python benchmarks/bench_ops.py --repeats 7 --json benchmarks/results/bench_ops.json")


@pytest.mark.slow
def test_the_powersgd_hook_row_is_its_result_file():
    gpt = next(r for r in _load(RESULTS / "bench_powersgd.json")["results"] if r["model"] == "gpt")
    row = _results_row("PowerSGD hook")
    assert f"{gpt['step_s']['gradcomp'] / gpt['step_s']['torch']:.2f}x the step time of torch's" in row, row
    assert gpt["wire_bytes_per_step"]["gradcomp"] == gpt["wire_bytes_per_step"]["torch"] and "same wire bytes" in row
    assert "[hooks.md](docs/hooks.md)" in row
    _doc_gives("hooks.md", "python benchmarks/bench_powersgd.py --rounds 16 --json benchmarks/results/bench_powersgd.json")


FSDP_RUN = "benchmarks/results/bench_fsdp_validation_5ff8bfc.json"


def test_the_fsdp_row_is_its_result_file():
    """int8's step over plain FSDP2's at 1 Gbit/s, per world size (the "vs plain" column that
    bench_fsdp.py --replay prints)."""
    runs = _load(ROOT / FSDP_RUN)["links"]["1"]["runs"]
    ratio = {int(p): t["int8"]["step_s"] / t["plain"]["step_s"] for p, t in runs.items()}
    row = _results_row("FSDP2, emulated 1 Gbit/s")
    assert f"int8: {ratio[2]:.2f}x (2 ranks) and {ratio[4]:.2f}x (4 ranks) the step time of plain FSDP2" in row, row
    assert "[breakeven.md](docs/breakeven.md)" in row
    _doc_gives("breakeven.md", f"python benchmarks/bench_fsdp.py --replay {FSDP_RUN}")


def _relative(runs, baseline) -> float:
    """The held-out loss of ``runs`` over ``baseline``'s, means over seeds, in percent."""
    return 100 * (_mean(r["final_heldout_loss"] for r in runs) / _mean(r["final_heldout_loss"] for r in baseline) - 1)


def test_the_convergence_rows_are_their_result_files():
    """ZeroOneAdam, DiLoCo and DGC: the mean compression ratio and the mean held-out loss (GPT) or
    test accuracy (ResNet-20) against the uncompressed runs of the same length, as
    ``examples/experiment.py report`` computes them from the committed summary.json files."""
    gpt_none = _runs("optim/gpt/none")
    zeroone = _runs("optim/gpt/zeroone-w32-r16-int8")
    own = _runs("optim/gpt/zeroone-w24-r64-h3-g8-ag-int4-own")
    row = _results_row("ZeroOneAdam, byte-level GPT, 4 ranks")
    assert (f"{_mean(r['compression_ratio'] for r in zeroone):.2f}x less traffic at "
            f"{_relative(zeroone, gpt_none):+.1f}% held-out loss; {_mean(r['compression_ratio'] for r in own):.1f}x "
            f"at {_relative(own, gpt_none):+.1f}% ({len(own)} seeds)") in row, row
    assert len(zeroone) == len(own) == len(gpt_none) == 3

    diloco_none = _runs("diloco/gpt1500/none")
    diloco = _runs("diloco/gpt1500/diloco-h10-sign-olr1-om0.5-lr4e-3")
    assert {r["steps"] for r in diloco + diloco_none} == {1500}
    row = _results_row("DiLoCo, same GPT")
    assert (f"{_mean(r['compression_ratio'] for r in diloco):.0f}x less traffic at "
            f"{_relative(diloco, diloco_none):+.1f}% held-out loss ({diloco[0]['steps']} steps, "
            f"{len(diloco)} seeds)") in row, row

    resnet_none = _runs("resnet20/none")
    dgc = _runs("optim/resnet20/dgc-0.45pct-w0")
    points = 100 * (_mean(r["final_heldout_accuracy"] for r in dgc) - _mean(r["final_heldout_accuracy"] for r in resnet_none))
    row = _results_row("DGC, ResNet-20")
    assert (f"{_mean(r['compression_ratio'] for r in dgc):.0f}x less traffic at {points:.2f} points of accuracy "
            f"({len(dgc)} seeds)") in row, row
    for folder in ("optim/gpt", "diloco/gpt1500", "optim/resnet20", "resnet20"):
        _doc_gives("convergence.md", f"python examples/experiment.py report docs/results/{folder}")


VALIDATION = {"2 ranks": "breakeven_validation_sweeps3_5ff8bfc.json",
              "two nodes of 2 ranks": "breakeven_validation_nodes_5ff8bfc.json"}


def test_the_emulated_link_row_is_its_result_files():
    """Each grid's median |error| over its points and its crossovers within 1.25x, from the files
    the validation wrote; the doc gives the commands that print them."""
    import statistics

    row = _results_row("analyser vs emulated links")
    crossovers = []
    for label, name in VALIDATION.items():
        run = _load(RESULTS / name)
        errors = [p["abs_error_pct"] for p in run["points"]]
        assert run["median_abs_error_pct"] == statistics.median(errors)
        assert f"{run['median_abs_error_pct']:.1f}% ({label}, {len(errors)} points)" in row, row
        crossovers += [c["within_tolerance"] for c in run["crossovers"]]
        _doc_gives("breakeven.md", f"--json benchmarks/results/{name}")
    fsdp = _load(ROOT / FSDP_RUN)
    errors = [abs(link["predicted"][p][m]["step_s"] / t["step_s"] - 1) * 100
              for link in fsdp["links"].values() for p, table in link["runs"].items() for m, t in table.items()]
    assert fsdp["median_abs_error_pct"] == statistics.median(errors)
    assert f"{fsdp['median_abs_error_pct']:.1f}% (FSDP2 on 2 and 4 ranks, {len(errors)} points)" in row, row
    assert f"{sum(crossovers)} of {len(crossovers)} crossovers within 1.25x" in row, row
    _doc_gives("breakeven.md", f"python benchmarks/breakeven_validation.py --replay benchmarks/results/{VALIDATION['2 ranks']}")


@functools.cache
def _script_main(script: str):
    """The ``main(argv)`` of a script under benchmarks/ (its module run under its file's name, not
    as ``__main__``: what ``python SCRIPT`` runs after parsing its arguments)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"readme_{Path(script).stem}", ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("name", [*VALIDATION.values(), "fsdp"])
def test_a_replay_prints_the_median_its_file_holds(name, capsys, monkeypatch):
    """``--replay`` predicts a file's points again with today's analyser: what it prints is what
    the README states (a change to the analyser that moves it must update the row). Run by the
    script's ``main`` in this process, from the repository root as the docs give it (a fresh
    interpreter importing torch was most of the 2-4 s; the scripts' ``python SCRIPT`` wiring is
    what tests/test_scripts.py runs)."""
    if name == "fsdp":
        script, argv = "benchmarks/bench_fsdp.py", ["--replay", FSDP_RUN]
        recorded = _load(ROOT / FSDP_RUN)["median_abs_error_pct"]
    else:
        script, argv = "benchmarks/breakeven_validation.py", ["--replay", f"benchmarks/results/{name}"]
        recorded = _load(RESULTS / name)["median_abs_error_pct"]
    monkeypatch.chdir(ROOT)
    assert _script_main(script)(argv) in (0, None)
    out = capsys.readouterr().out
    assert re.search(rf"median \|error\|.* {recorded:.1f}% ", out), out[-500:]
    if name != "fsdp":
        assert "within 1.25x" in out and not re.search(r"^\S+\s+[\d.]+\s+[\d.]+\s+no\b", out, re.M)


def test_the_published_row_and_paragraph_are_their_result_file():
    """The check against published measurements, from breakeven_published.json (what
    ``breakeven_validation.py --published --json`` writes)."""
    run = _load(RESULTS / "breakeven_published.json")
    a, b = run["summary_presets"], run["summary_measured_link"]
    paid, unpaid = a["agree_by_outcome"]["pays"], a["agree_by_outcome"]["does not pay"]
    published = [r["published"] for r in run["rows"]
                 if r.get("predicted") is not None and r.get("published") is not None and r["published"] <= 1 / 1.05]
    assert len(published) == unpaid[1]  # the rows where it did not pay: published at or under 1 / margin
    row = _results_row("analyser vs published runs, from presets")
    assert (f"{a['verdicts_agree']} of {a['rows']} verdicts agree ({paid[0]} of {paid[1]} paying rows, {unpaid[0]} of "
            f"the {unpaid[1]} that did not pay); a prediction is typically {a['median_factor']:.2f}x off "
            f"({b['median_factor']:.2f}x with one paper's measured link)") in row, row
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
    text = " ".join(README.read_text().split())
    assert (f"{a['rows']} published measurements of {words[len(a['implementations'])]} implementations") in text
    assert (f"{a['verdicts_agree']} of {a['rows']} verdicts agree ({paid[0]} of the {paid[1]} rows where compression "
            f"paid, {unpaid[0]} of the {unpaid[1]} where it did not: {_span(published)}x) and a typical "
            f"prediction is {a['median_factor']:.2f}x off; with the measured link one paper gives ({b['rows']} rows), "
            f"{b['verdicts_agree']} agree and a typical prediction is {b['median_factor']:.2f}x off") in text, text
    _doc_gives("breakeven.md", "python benchmarks/breakeven_validation.py --published")


def _does_it_pay_output() -> str:
    shown = [b for b in readme_blocks(r"\w*") if b.startswith("gpt2-1.5b (")]
    assert len(shown) == 1
    return shown[0]


def _table(output: str) -> dict[str, dict[str, str]]:
    """The verdict table's rows by method, cut at the columns its dashed line marks."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("method "))
    spans = [m.span() for m in re.finditer(r"-+", lines[start + 1])]
    spans[-1] = (spans[-1][0], None)  # the verdict runs to the end of its line

    def cells(line):
        return [line[a:b].strip() for a, b in spans]

    header, rows = cells(lines[start]), {}
    for line in lines[start + 2:]:
        if not line.strip():
            break
        row = dict(zip(header, cells(line)))
        rows[row["method"]] = row
    return rows


def test_does_it_pay_shows_what_its_command_prints(capsys):
    """The README's printed verdict is what its first command prints now, character for character,
    and every number the prose around it quotes is that output's."""
    status, out, err = _run(_verdict_command(), ROOT, capsys)
    assert status == 0, err
    shown = _does_it_pay_output()
    assert out == shown, "the README's verdict differs from what the command prints:\n" + out
    rows = _table(shown)
    text = " ".join(README.read_text().split())
    step_x = {m: float(rows[m]["step x"]) for m in ("sign:twophase", "powersgd")}
    assert f"sign and PowerSGD are {step_x['sign:twophase']:.1f}x and {step_x['powersgd']:.1f}x faster than fp32" in text
    final = {m: float(re.search(rf"^  {re.escape(m)}\b.*final held-out loss ([+-][\d.]+)%", shown, re.M).group(1))
             for m in ("fp16", "int8:allgather", "sign:allgather", "topk", "powersgd")}
    assert f"they ended {final['sign:allgather']:.0f}% and {final['powersgd']:.0f}% above the uncompressed" in text
    assert f"fp16 ended {final['fp16']:+.2f}% and int8 {final['int8:allgather']:+.2f}% from it" in text
    for m in ("fp16", "int8:twophase"):
        assert rows[m]["steps x"] == "1.00" and rows[m]["verdict"] == "pays"
    assert all("not reached within 1.15x" in rows[m]["verdict"] for m in ("sign:twophase", "powersgd"))
    # the picture's paragraph: crossovers and step times at the user's link
    assert (f"int8:twophase at {rows['int8:twophase']['pays below Gbit/s']} Gbit/s; fp16 pays up to "
            f"{rows['fp16']['pays below Gbit/s']}") in text
    steps = {m: float(rows[m]["step ms"]) for m in ("none", "fp16", "int8:twophase")}
    assert (f"fp32 {steps['none']:.0f} ms, fp16 {steps['fp16']:.0f} ms, int8:twophase "
            f"{steps['int8:twophase']:.0f} ms") in text


def test_the_traffic_table_is_its_result_file():
    """docs/kernels.md's traffic table, row for row, is benchmarks/results/bench_traffic.json (the
    command the doc gives writes it): bytes per element at 1M / 16M / 100M, the minimum, the ratios."""
    rows = _load(RESULTS / "bench_traffic.json")["rows"]
    fronts = list(dict.fromkeys(r["front"] for r in rows))
    text = (ROOT / "docs" / "kernels.md").read_text()
    table = text[text.index("**The table** (2 ranks"):].split("\n\n")[1].splitlines()[2:]  # below its header
    assert len(table) == len(fronts), (len(table), len(fronts))
    for line, front in zip(table, fronts):
        sizes = [r for r in rows if r["front"] == front]
        first = sizes[0]
        bound = "-" if first["minimum_per_element"] is None else f"{sizes[-1]['minimum_per_element']:.2f}"
        ratios = "-" if first["ratio"] is None else " / ".join(f"{r['ratio']:.2f}" for r in sizes)
        per_element = " / ".join(f"{r['bytes_per_element']:.2f}" for r in sizes)
        expected = f"| {front} | {first['method']} | {first['scheme']} | {per_element} | {bound} | {ratios} |"
        assert line == expected, (line, expected)
    _doc_gives("kernels.md", "python benchmarks/bench_traffic.py --json benchmarks/results/bench_traffic.json")
