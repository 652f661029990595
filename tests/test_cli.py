"""The gradcomp command: breakeven output (table, JSON schema, sweep), errors, calibrate round trip."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from gradcomp.cli import main, parse_options
from gradcomp.numfmt import plain

FAST = ["--model", "resnet50", "--world-size", "8", "--device", "a100", "--link", "10gbe"]
RECORD_TYPES = {"method": str, "scheme": str, "comm_s": float, "exposed_comm_s": float, "compress_s": float,
                "step_s": float, "speedup": float, "pays": bool, "wire_bytes": int, "verdict": str}


def run(capsys, *argv):
    status = main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


def test_breakeven_json_schema(capsys):
    status, out, _ = run(capsys, "breakeven", *FAST, "--json")
    assert status == 0
    records = json.loads(out)
    assert records[0]["method"] == "none" and records[0]["speedup"] == 1.0
    for record in records:
        for key, kind in RECORD_TYPES.items():
            assert isinstance(record[key], kind), (key, record[key])
        assert record["breakeven_gbps"] is None or record["breakeven_gbps"] > 0
        assert record["breakeven_world_size"] is None or record["breakeven_world_size"] >= 3
        # the verdict is on time to target (step time x steps factor), never on step time alone
        assert record["judged_on"] == "time to target"
        assert record["pays"] == (record["time_to_target"] is not None and record["time_to_target"] >= record["margin"]
                                  and record["method"] != "none")
    # ResNet-50 on 10 GbE at 8 ranks: PowerSGD cuts the traffic ~100x and is faster per step, but its
    # ResNet-20 runs (SGD, the nearest setting) did not reach the uncompressed loss: it does not pay
    powersgd = next(r for r in records if r["method"] == "powersgd")
    assert powersgd["speedup"] > 5 and not powersgd["pays"] and powersgd["steps_factor_reached"] is False
    assert re.match(r"does not pay \(target not reached within [0-9.]+x steps\)", powersgd["verdict"]), powersgd["verdict"]
    assert powersgd["quality"]["row"]["workload"] == "resnet20" and powersgd["breakeven_gbps"] is None


def test_breakeven_table_and_options(capsys):
    status, out, _ = run(capsys, "breakeven", *FAST, "--methods", "fp16,topk,int8:twophase",
                         "--set", "topk.ratio=0.001")
    assert status == 0
    table, _, auto = out.partition("\nwhat the auto hook would choose")
    lines = table.split("\n\n")[0].splitlines()
    assert "resnet50" in lines[0] and "10 Gbit/s" in lines[0]
    assert lines[1].startswith("links: inter a preset guess: 10gbe")  # not measured: the output says so
    assert [line.split()[0] for line in lines[4:]] == ["none", "fp16", "topk", "int8:twophase"]
    # then the auto hook's plan under its default policy, bucket runs by choice
    plan = auto.splitlines()
    assert plan[1].startswith("auto (none,fp16,bf16,int8): ") and plan[2].strip().startswith("buckets 0-")
    # and what it weighs given the optimizer: the hook's own refusals for the model's family (ResNet: SGD)
    import torch

    from gradcomp.hooks.auto import AutoState

    refused = AutoState(None, optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)).refused
    given = next(line for line in plan if line.startswith("  given the optimizer"))
    assert f"refuse {', '.join(m for m in ('int4', 'sign', 'topk', 'powersgd') if m in refused)} under sgd" in given
    assert "int4 is taken only while the noise ratio" in given and "int4" not in refused


def test_custom_link_numbers(capsys):
    _, out, _ = run(capsys, "breakeven", "--model", "gpt2-124m", "--bandwidth-gbps", "3", "--latency-us", "40",
                    "--methods", "fp16", "--json")
    slow = json.loads(out)
    _, out, _ = run(capsys, "breakeven", "--model", "gpt2-124m", "--bandwidth-gbps", "300", "--latency-us", "40",
                    "--methods", "fp16", "--json")
    fast = json.loads(out)
    assert slow[0]["comm_s"] > 50 * fast[0]["comm_s"]


def test_sweep_json_and_plot(capsys, tmp_path):
    status, out, _ = run(capsys, "breakeven", *FAST, "--methods", "fp16,int8:twophase", "--sweep", "bandwidth",
                         "--sweep-gbps", "1,100", "--json")
    assert status == 0
    sweep = json.loads(out)
    grid = sweep["bandwidth_gbps"]
    assert grid[0] == pytest.approx(1) and grid[-1] == pytest.approx(100)
    for label in ("none", "fp16", "int8:twophase"):
        steps = sweep["step_s"][label]
        assert all(a >= b for a, b in zip(steps, steps[1:]))  # faster links never slow a step
    assert set(sweep["breakeven_gbps"]) == {"fp16", "int8:twophase"}
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    status, out, _ = run(capsys, "breakeven", *FAST, "--methods", "fp16", "--sweep", "bandwidth",
                         "--plot", str(png))
    assert status == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "pays below Gbit/s" in out


EXPONENT = re.compile(r"\d(\.\d*)?[eE][+-]?\d")


@pytest.mark.parametrize("argv", [
    # the README's model: times in seconds (ms in the thousands), crossovers past 1000 Gbit/s
    ["--model", "gpt2-1.5b", "--world-size", "64", "--device", "h100", "--link", "100gbe"],
    # a 7B model on 10 GbE, the default sweep 0.1-1000 Gbit/s: step times up to ~1.3e6 ms
    ["--model", "llama-7b", "--world-size", "64", "--link", "10gbe", "--sweep", "bandwidth", "--plot", os.devnull],
    # crossovers at the top of the search range (1e5 Gbit/s: it pays at every bandwidth)
    [*FAST, "--sweep", "bandwidth", "--plot", os.devnull],
])
def test_tables_print_plain_numbers(capsys, argv):
    """What the user reads is fixed point: no 1.96295e+06 ms, no 1.51e+03 Gbit/s."""
    status, out, _ = run(capsys, "breakeven", *argv)
    assert status == 0
    assert not EXPONENT.search(out), EXPONENT.search(out).group(0)
    if "--sweep" in argv:
        rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
        assert [row[0] for row in rows[:3]] == ["0.1", "0.147", "0.215"] and rows[-1][0] == "1000"
        assert max(float(v) for row in rows for v in row[1:]) > 1e4  # the case is realistic: big numbers
    if argv[0] == "--model" and argv[1] == "gpt2-1.5b":
        fp16 = next(line for line in out.splitlines() if line.startswith("fp16 "))
        assert " 1510 " in fp16  # pays below 1510 Gbit/s, was 1.51e+03


def test_plain():
    assert [plain(x) for x in (0.1, 0.147, 1, 14.7, 1000, 1360, 1e5, 1.96295e6, 0.00012345, 9.996)] == [
        "0.1", "0.147", "1", "14.7", "1000", "1360", "100000", "1960000", "0.000123", "10"]
    assert plain(1.96295e6, 6) == "1962950" and plain(0, 3) == "0"


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--model", "resnet50", "--device", "tpu"], "unknown device 'tpu'"),
    (["--model", "resnet50", "--link", "wifi"], "unknown link 'wifi'"),
    (["--model", "resnet50", "--methods", "zip"], "unknown method 'zip'"),
    (["--model", "resnet50", "--methods", "topk:twophase"], "no scheme 'twophase'"),
    (["--model", "resnet50", "--set", "topk.ratio"], "method.option=value"),
    (["--model", "resnet50", "--set", "topk.ratio=5"], "ratio"),
    (["--model", "resnet50", "--methods", "fp16", "--set", "topk.ratio=0.1"], "not analysed"),
    (["--model", "resnet50", "--algorithm", "butterfly"], "algorithm"),
    (["--model", "resnet50", "--sweep", "bandwidth", "--sweep-gbps", "10,1"], "0 < lo < hi"),
    ([], "--model is required"),
])
def test_breakeven_errors(capsys, argv, message):
    status, out, err = run(capsys, "breakeven", *argv)
    assert status == 2 and out == ""
    assert message in err and err.startswith("gradcomp breakeven: error:")


@pytest.mark.parametrize("argv", [["--world-size", "0"], ["--bandwidth-gbps", "0"], ["--latency-us", "-1"],
                                  ["--world-size", "many"]])
def test_impossible_numbers_are_refused_by_the_parser(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(["breakeven", "--model", "resnet50", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("gradcomp breakeven: error: argument") and err.count("\n") == 1, err  # no usage block


def test_malformed_profile(capsys, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": 1, "device": "x", "methods": {"int8": {"compress": {}}}}))
    status, _, err = run(capsys, "breakeven", "--model", "resnet50", "--profile", str(path))
    assert status == 2 and "malformed profile" in err


def test_parse_options():
    assert parse_options(["topk.ratio=0.001", "powersgd.rank=8", "topk.selector=threshold"]) == {
        "topk": {"ratio": 0.001, "selector": "threshold"}, "powersgd": {"rank": 8}}


def test_subcommand_is_required(capsys):
    with pytest.raises(SystemExit):
        main([])


@pytest.mark.slow
def test_calibrate_then_breakeven(tmp_path):
    """The console script end to end: a small calibration (no network), read back by breakeven."""
    profile = tmp_path / "profile.json"
    env = {**os.environ, "GRADCOMP_CPU_COMPILE": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "gradcomp.cli", "calibrate", "--out", str(profile),
                           "--methods", "fp16,int8,powersgd", "--sizes", "4096,16384", "--repeats", "2",
                           "--world-size", "0", "--model", "mlp-small", "--batch-size", "4"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(profile.read_text())
    assert set(data["methods"]) == {"fp16", "int8", "powersgd"} and data["compute"]["model"] == "mlp-small"
    # with --model, PowerSGD's hook is timed on the model's buckets: a cost per parameter element
    assert data["methods"]["powersgd"]["compress"]["fixed_s"] == 0
    assert data["methods"]["powersgd"]["compress"]["per_element_s"] > 0
    assert data["network"] is None
    done = subprocess.run([sys.executable, "-m", "gradcomp.cli", "breakeven", "--profile", str(profile),
                           "--methods", "fp16,int8", "--bandwidth-gbps", "1", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    records = json.loads(done.stdout)
    assert [r["method"] for r in records] == ["none", "fp16", "int8:allgather"]
    assert records[0]["step_s"] >= data["compute"]["forward_s"] + data["compute"]["backward_s"]


def calibrate_in_group(rank, world_size, config):
    """Inside a launched 2-rank group, as under torchrun: every rank calibrates, rank 0 writes."""
    return main(["calibrate", "--out", config["out"], "--methods", "sign", "--sizes", "2048,8192",
                 "--repeats", "1", "--network-sizes", "1024,16384"])


@pytest.mark.slow
def test_calibrate_in_a_live_process_group(tmp_path):
    from gradcomp.emulate import launch_ranks

    out = tmp_path / "group.json"
    statuses = launch_ranks("test_cli:calibrate_in_group", 2, {"out": str(out)}, timeout_s=120,
                            env={"PYTHONPATH": os.path.dirname(__file__), "GRADCOMP_CPU_COMPILE": "0"})
    assert statuses == [0, 0]
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and set(data["network"]) == {"allreduce", "allgather", "reduce_scatter", "alltoall"}
    assert data["network"]["allreduce"]["bandwidth_gbps"] > 0 and list(data["methods"]) == ["sign"]


def test_sweep_marks_crossovers_outside_its_range_and_labels_the_lines_inside(capsys):
    """The "pays below" column says when a crossover lies past the swept range; the plot draws
    each crossover inside the range as a line named in the legend."""
    from gradcomp.analysis import breakeven_gbps
    from gradcomp.analysis.breakeven import GBPS_RANGE
    from gradcomp.cli import _scenario_from_args, _sweep_figure, _sweep_grid, build_parser, parse_choices

    argv = ["breakeven", *FAST, "--methods", "fp16,int8:twophase", "--sweep", "bandwidth"]
    scenario = _scenario_from_args(build_parser().parse_args(argv))
    crossovers = {c.label: breakeven_gbps(scenario, c) for c in parse_choices("fp16,int8:twophase", {})
                  if c.method != "none"}
    assert all(g is not None and 100 < g < 1000 for g in crossovers.values()), crossovers
    # the sweep's crossovers are on time to target: where the step speedup reaches the steps factor
    status, out, _ = run(capsys, *argv, "--sweep-gbps", "1,100", "--json")
    sweep = json.loads(out)
    for c in parse_choices("fp16,int8:twophase", {})[1:]:
        factor = sweep["steps_factor"][c.label]
        assert sweep["crossover_on"][c.label] == "time to target" and factor is not None
        assert sweep["breakeven_gbps"][c.label] == breakeven_gbps(scenario, c, threshold=factor)
        assert sweep["time_to_target_s"][c.label] == [s * factor for s in sweep["step_s"][c.label]]
    status, out, _ = run(capsys, *argv, "--sweep-gbps", "1,100", "--plot", os.devnull)
    assert status == 0
    table = {line.split()[0]: line for line in out.splitlines()[-3:]}
    for label in crossovers:
        g = sweep["breakeven_gbps"][label]
        # past the sweep, or (steps factor < 1: fewer steps to target) at the top of the search range
        expected = "every bandwidth" if g >= GBPS_RANGE[1] else f"{plain(g)} (beyond the sweep's 100)"
        assert expected in table[label], table
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for grid, inside in ((_sweep_grid("1,100"), []), (_sweep_grid("0.1,1000"), list(crossovers))):
        steps = {label: [1.0] * len(grid) for label in ("none", *crossovers)}
        fig = _sweep_figure(plt, grid, steps, crossovers, "title")
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        plt.close(fig)
        assert legend == ["none", *crossovers] + [f"{label} pays below {crossovers[label]:.3g} Gbit/s"
                                                  for label in inside]


def test_sweep_plot_marks_the_users_link(capsys, tmp_path, monkeypatch):
    """--plot draws the user's own link (the bandwidth the command was given, at its achieved
    fraction) as a labelled vertical line, and writes the PNG."""
    pytest.importorskip("matplotlib")
    import gradcomp.cli as cli

    drawn = {}

    def figure(plt, grid, steps, crossovers, title, notes=None, link=None):
        fig = real(plt, grid, steps, crossovers, title, notes, link)
        ax = fig.axes[0]
        drawn["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
        drawn["vertical"] = {line.get_label(): line.get_xdata()[0] for line in ax.get_lines()
                             if len(set(line.get_xdata())) == 1}
        return fig

    real = cli._sweep_figure
    monkeypatch.setattr(cli, "_sweep_figure", figure)
    png = tmp_path / "sweep.png"
    for argv, label, gbps in (
            (FAST, "your link: 10gbe 10 Gbit/s, x0.5 achieved", 10.0),  # a preset: nominal, its fraction
            (["--model", "resnet50", "--bandwidth-gbps", "3"], "your link: custom 3 Gbit/s", 3.0)):  # as given
        status, out, _ = run(capsys, "breakeven", *argv, "--methods", "fp16", "--sweep", "bandwidth",
                             "--sweep-gbps", "1,100", "--plot", str(png))
        assert status == 0 and f"plot written to {png}" in out
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert label in drawn["legend"], drawn["legend"]
        assert drawn["vertical"][label] == pytest.approx(gbps)
        png.unlink()
