"""gradcomp hooks under torch.compile on 2 Gloo ranks: a compiled DDP model (DDP's C++ reducer
calls the hooks per bucket) and compiled autograd (``optimize_ddp="python_reducer"``: DDP calls
each hook once per parameter as ``hook(state, (grad, param))``). aot_eager keeps compiling fast.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ddp_models import batch, build_model, flat_params, make_ddp
from dist_utils import run_ranks
from gradcomp.hooks import PowerSGDState, fp16_hook, powersgd_hook, register
from gradcomp.hooks.base import resumable

pytestmark = pytest.mark.slow

STEPS = 3
AUTO_COST_CACHE = str(Path(tempfile.gettempdir()) / "gradcomp-test-compiled-costs.json")
CONFIGS = [("default", None, {}), ("allreduce", "none", {}), ("fp16_stateless", "fp16_stateless", {}),
           ("int8", "int8", {}), ("int8_twophase", "int8", {"scheme": "twophase", "stochastic": True}),
           ("sign", "sign", {"chunk": 64}), ("topk", "topk", {"ratio": 0.1}),
           ("powersgd", "powersgd", {"matrix_rank": 2}),
           ("hierarchical", "int8", {"hierarchical": True, "node_size": 1}),
           ("auto", "auto", {"methods": ("none", "int8"), "warmup_steps": 2, "evaluate_every": 1, "window_steps": 1,
                             "cache": AUTO_COST_CACHE})]


def _attach(ddp, method, options):
    if method is None:
        return None
    if method == "fp16_stateless":
        ddp.register_comm_hook(None, fp16_hook)
        return None
    if method == "powersgd":  # resumable() serves the per-parameter form (a no-op wrap if already)
        state = PowerSGDState(None, **options)
        ddp.register_comm_hook(state, resumable(powersgd_hook))
        return state
    return register(ddp, method, **options)


def _train(rank, configs, **ddp_options):
    out = {}
    for label, method, options in configs:
        ddp = make_ddp(build_model(), **ddp_options)
        state = _attach(ddp, method, options)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

        @torch.compile(backend="aot_eager")
        def step(x, y):
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            return loss

        params = []
        for index in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            step(*batch(index, rank))
            optimizer.step()
            params.append(flat_params(ddp.module))
        out[label] = {"params": params, "stats": state.stats() if state else None}
    return out


def _suite(rank, world):
    # DDP's default bucket size: dynamo's DDPOptimizer refuses a first bucket larger than the others
    compiled_model = _train(rank, [c for c in CONFIGS if c[0] in ("default", "allreduce", "int8")],
                            bucket_cap_mb=25)
    with torch._dynamo.config.patch(compiled_autograd=True, optimize_ddp="python_reducer"):
        compiled_autograd = _train(rank, CONFIGS)
    return {"compiled_model": compiled_model, "compiled_autograd": compiled_autograd}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_suite, 2, timeout_s=120)


@pytest.mark.parametrize("mode", ["compiled_model", "compiled_autograd"])
def test_every_hook_trains_with_identical_replicas(runs, mode):
    ranks = [r[mode] for r in runs]
    default = ranks[0]["default"]["params"]
    for label, result in ranks[0].items():
        for step, params in enumerate(result["params"]):
            assert torch.equal(params, ranks[1][label]["params"][step]), f"{label}: replicas differ at step {step}"
        assert torch.isfinite(result["params"][-1]).all(), label
        moved, reference = result["params"][-1] - _initial_params(), default[-1] - _initial_params()
        assert torch.dot(moved, reference) > 0, label
        if result["stats"] is not None:
            assert result["stats"]["steps"] == STEPS, label
    # the uncompressed hook reproduces DDP's own reduction bit for bit
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["allreduce"]["params"], default))


def test_compiled_autograd_compresses_each_parameter(runs):
    stats = runs[0]["compiled_autograd"]
    parameters = sum(1 for p in build_model().parameters() if p.requires_grad)
    for label in ("int8", "sign", "topk", "powersgd", "hierarchical"):
        assert stats[label]["stats"]["buckets"] == STEPS * parameters, label
        assert stats[label]["stats"]["ratio"] > 1.5, label


def _initial_params():
    return flat_params(build_model())
