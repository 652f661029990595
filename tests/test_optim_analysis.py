"""gradcomp.analysis.optim: the optimizers' bytes over a run, and `gradcomp breakeven --optimizers`."""
from __future__ import annotations

import json

import pytest
import torch

from gradcomp.analysis import make_scenario
from gradcomp.analysis.optim import estimate_optimizer, run_wire_bytes
from gradcomp.cli import main
from gradcomp.methods import get_method
from gradcomp.optim import DGC, DiLoCo, ZeroOneAdam

RUNS = [
    ("zeroone", ZeroOneAdam, dict(warmup_steps=3, var_refresh_interval=2, sync_every=2, method_options={"chunk": 64})),
    ("zeroone", ZeroOneAdam, dict(warmup_steps=2, warmup_method="int4", scheme="allgather")),
    ("dgc", DGC, dict(density=0.01, warmup_steps=4, initial_density=0.5)),
    ("diloco", DiLoCo, dict(sync_every=5, method="sign", method_options={"chunk": 64}, scheme="twophase")),
    ("diloco", DiLoCo, dict(sync_every=4, method=None)),
    ("diloco", DiLoCo, dict(sync_every=4, fragments=3, method="int4")),  # streaming: a third at a time
]


@pytest.mark.parametrize("name, cls, options", RUNS)
def test_run_bytes_equal_what_the_optimizer_counts(name, cls, options):
    torch.manual_seed(0)
    net = torch.nn.Linear(300, 7)
    opt = cls(net.parameters(), net, **options)
    for _ in range(12):
        opt.zero_grad()
        net(torch.randn(5, 300)).square().mean().backward()
        opt.step()
    numel = sum(p.numel() for p in net.parameters())
    assert opt.stats()["wire_bytes"] == run_wire_bytes(name, numel, 1, 12, **options)
    assert opt.stats()["raw_bytes"] == 12 * 4 * numel


def test_warm_up_is_amortised_over_the_run():
    scenario = make_scenario("gpt2-1.5b", 64, "h100", "100gbe")
    short, long = (estimate_optimizer(scenario, "zeroone", steps, warmup_steps=100) for steps in (200, 10_000))
    assert short.ratio < long.ratio < 32
    assert long.wire_bytes_per_step < short.wire_bytes_per_step
    with pytest.raises(ValueError, match="unknown option"):
        estimate_optimizer(scenario, "dgc", 10, ratio=0.1)


def test_diloco_sends_one_pseudo_gradient_every_h_steps_and_is_faster_on_a_slow_link():
    scenario = make_scenario("gpt2-1.5b", 16, "h100", bandwidth_gbps=0.1)
    n, int4 = scenario.model.numel, get_method("int4")
    estimates = {h: estimate_optimizer(scenario, "diloco", 1000, sync_every=h, method="int4") for h in (1, 10, 64)}
    for h, estimate in estimates.items():
        assert estimate.wire_bytes == (1000 // h) * int4.wire_bytes(n)  # the all-gather payload, counted once
        assert estimate.ratio == 1000 * 4 * n / estimate.wire_bytes
    assert estimates[1].step_s > estimates[10].step_s > estimates[64].step_s
    zeroone = estimate_optimizer(scenario, "zeroone", 1000)
    assert estimates[64].step_s < zeroone.step_s and estimates[64].ratio > 256 > zeroone.ratio


def test_breakeven_lists_the_optimizers(capsys):
    argv = ["breakeven", "--model", "gpt2-1.5b", "--world-size", "16", "--methods", "sign", "--optimizers",
            "zeroone,dgc,diloco", "--run-steps", "500", "--optimizer-set", "zeroone.warmup_steps=25",
            "--optimizer-set", "diloco.sync_every=50"]
    assert main(argv) == 0
    assert "warmup_steps=25" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert [o["optimizer"] for o in record["optimizers"]] == ["zeroone", "dgc", "diloco"]
    numel = make_scenario("gpt2-1.5b", 16).model.numel
    assert record["optimizers"][2]["wire_bytes"] == 10 * get_method("int8").wire_bytes(numel)  # 500 / 50 exchanges
    assert record["optimizers"][0]["run_steps"] == 500 and record["methods"][0]["method"] == "none"
    assert main(["breakeven", "--model", "gpt2-1.5b", "--optimizers", "zeroone", "--optimizer-set", "dgc.density=0.1"]) == 2
