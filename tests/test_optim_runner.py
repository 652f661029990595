"""examples/experiment.py with gradcomp.optim's optimizers: names, bytes and exact resume."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples import experiment  # noqa: E402
from gradcomp.analysis.optim import run_wire_bytes  # noqa: E402


@pytest.mark.parametrize("name", ["zeroone-w16", "zeroone-w8-r64-h2-int8", "zeroone-w40-topk0.4pct-int4",
                                  "zeroone-w24-r64-h4-int4-own", "zeroone-w24-r64-h8-g48-int4-own",
                                  "zeroone-w24-r64-h4-fp16sync-int4-own", "zeroone-w24-r64-h3-ag-int4-own",
                                  "dgc-0.1pct-w10", "dgc-5pct-w0",
                                  "dgc-0.2pct-w11-i5pct", "diloco-h32-sign", "diloco-h100-int8",
                                  "diloco-h16-topk1pct-olr0.5", "diloco-h50-fp32-om0.8", "diloco-h8-int4-olr1-om0",
                                  "diloco-h12-int4-f4"])
def test_optimizer_config_names_round_trip(name):
    args = experiment.build_parser().parse_args(["run", "--model", "gpt", "--out", "x",
                                                 *experiment.parse_config(name)])
    assert experiment.resolve_defaults(args).config == name


@pytest.mark.parametrize("bad", ["zeroone", "dgc-w3", "zeroone-1pct-w3", "dgc-1pct-w3-h2", "zeroone-w3-int2",
                                 "zeroone-w3-i5pct", "dgc-1pct-w3-topk1pct", "dgc-1pct-w3-own",
                                 "dgc-1pct-w3-g8", "zeroone-w3-topk1pct-ag", "diloco-h32", "diloco-32-sign",
                                 "diloco-h32-int2", "diloco-h32-topk", "diloco-h8-sign-own", "diloco-h8-w3-sign",
                                 "diloco-h8-sign-f"])
def test_bad_optimizer_config_names(bad):
    with pytest.raises(ValueError, match="bad configuration"):
        experiment.parse_config(bad)


def test_optimizer_configs_sort_after_hooks():
    names = ["zeroone-w16", "none", "dgc-0.1pct-w10", "topk-1pct"]
    assert sorted(names, key=experiment.config_order) == ["none", "topk-1pct", "dgc-0.1pct-w10", "zeroone-w16"]


def test_a_sweep_runs_the_optimizer_its_configuration_names(tmp_path):
    sweep = experiment.build_parser().parse_args(["sweep", "--model", "resnet20", "--out", str(tmp_path),
                                                  "--configs", "dgc-0.2pct-w11-i5pct", "--lr", "0.05"])
    base = {k: v for k, v in vars(sweep).items() if k not in ("configs", "seeds", "command")}
    args = experiment.resolve_defaults(experiment.sweep_run_args(sweep, base, "dgc-0.2pct-w11-i5pct", 1, tmp_path))
    assert (args.optimizer, args.density, args.exchange_warmup, args.initial_density) == ("dgc", 0.002, 11, 0.05)
    assert (args.config, args.lr, args.seed) == ("dgc-0.2pct-w11-i5pct", 0.05, 1)


def test_an_exchange_optimizer_refuses_a_hook():
    args = experiment.build_parser().parse_args(["run", "--model", "gpt", "--out", "x", "--hook", "sign",
                                                 "--optimizer", "zeroone"])
    with pytest.raises(ValueError, match="--hook none"):
        experiment.resolve_defaults(args)


def test_diloco_fragments_must_fit_in_a_period():
    args = experiment.build_parser().parse_args(["run", "--model", "gpt", "--out", "x",
                                                 *experiment.parse_config("diloco-h4-int8-f5")])
    with pytest.raises(ValueError, match=r"--fragments must lie in \[1, --sync-every = 4\], got 5"):
        experiment.resolve_defaults(args)


def test_the_sign_scheme_needs_sign_momentum():
    args = experiment.build_parser().parse_args(["run", "--model", "gpt", "--out", "x", "--optimizer", "zeroone",
                                                 "--momentum-method", "topk", "--sign-scheme", "allgather"])
    with pytest.raises(ValueError, match="--sign-scheme applies to --momentum-method sign, not topk"):
        experiment.resolve_defaults(args)


TINY_GPT = ["--model", "gpt", "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--corpus-mb", "0.1",
            "--eval-windows", "8", "--eval-every", "3", "--world-size", "2", "--quiet"]


@pytest.mark.slow
def test_zeroone_run_resumes_exactly_and_counts_bytes(tmp_path):
    common = ["run", *TINY_GPT, "--steps", "6", "--optimizer", "zeroone", "--exchange-warmup", "2",
              "--refresh-interval", "2", "--sync-every", "2"]
    whole = experiment.main([*common, "--out", str(tmp_path / "whole")])
    experiment.main([*common, "--out", str(tmp_path / "split"), "--stop-after", "3"])
    split = experiment.main([*common, "--out", str(tmp_path / "split"), "--resume"])
    rows = [experiment.read_csv(tmp_path / d / "steps.csv") for d in ("whole", "split")]
    for key in ("loss", "wire_bytes", "raw_bytes"):
        assert [r[key] for r in rows[0]] == [r[key] for r in rows[1]]
    assert whole["final_heldout_loss"] == split["final_heldout_loss"]
    assert whole["config"] == "zeroone-w2-r2-h2"
    # 3 full fp32 steps (0, 1 and the refresh at 4), 1 compressed sync (step 3), 2 local steps
    stats = whole["hook_stats"]
    assert stats["raw_bytes"] == 6 * 4 * whole["parameters"] and stats["skipped_steps"] == 0
    assert 3 * 4 * whole["parameters"] < stats["wire_bytes"] < 3.1 * 4 * whole["parameters"]
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["optimizer"] == "zeroone"


@pytest.mark.slow
def test_diloco_run_resumes_exactly_from_between_outer_steps_and_counts_bytes(tmp_path):
    common = ["run", *TINY_GPT, "--steps", "6", *experiment.parse_config("diloco-h2-sign")]
    whole = experiment.main([*common, "--out", str(tmp_path / "whole")])
    experiment.main([*common, "--out", str(tmp_path / "split"), "--stop-after", "3"])  # replicas apart here
    split = experiment.main([*common, "--out", str(tmp_path / "split"), "--resume"])
    rows = [experiment.read_csv(tmp_path / d / "steps.csv") for d in ("whole", "split")]
    for key in ("loss", "wire_bytes", "raw_bytes"):
        assert [r[key] for r in rows[0]] == [r[key] for r in rows[1]]
    assert whole["final_heldout_loss"] == split["final_heldout_loss"]
    assert whole["config"] == "diloco-h2-sign"
    # outer steps after steps 2, 4 and 6: the wire bytes grow there only
    wire = [0.0] + [r["wire_bytes"] for r in rows[0]]
    assert [after > before for before, after in zip(wire, wire[1:])] == [False, True] * 3
    stats = whole["hook_stats"]
    assert stats["outer_steps"] == 3 and stats["skipped_steps"] == 0
    assert stats["wire_bytes"] == run_wire_bytes("diloco", whole["parameters"], 2, 6, sync_every=2, method="sign")
    assert stats["raw_bytes"] == 6 * 4 * whole["parameters"]
