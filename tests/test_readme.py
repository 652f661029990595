"""Every code block of README.md runs as written.

Python blocks run on 2 Gloo ranks, each with a fresh ``net`` (the text's "your module"; every
block that names it says so) and nothing else given: a block must import what it uses. After a
block, every DDP model and FSDP module it made trains one step, and every optimizer it made
steps, so a hook or optimizer that is registered but broken fails here too. Every line of a
bash block is either run here or mapped below to the test or CI step that runs it; a new README
command that nothing runs fails ``test_every_bash_line_is_run_somewhere``.
"""
from __future__ import annotations

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


def test_bash_lines_run_here(tmp_path):
    """The analyser's commands, in the README's order (calibrate writes what breakeven reads)."""
    for line in bash_lines():
        if line.startswith(RUN_HERE):
            done = subprocess.run(_command(line), cwd=tmp_path, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
            assert "verdict" in done.stdout or "profile written" in done.stdout or "plot written" in done.stdout, line
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
