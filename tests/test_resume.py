"""Checkpoint and resume written the way a user writes it: ``model.register_comm_hook(state, hook)``
(no bind, no gradcomp.hooks.register), N steps, save model, optimizer and ``state.state_dict()``;
in new processes build the state, register it, ``load_state_dict``, N more steps: the same as 2N
uninterrupted steps, bit for bit. And a state dict belongs to its rank and world size."""
from __future__ import annotations

import pytest
import torch

from ddp_models import build_model, flat_params, make_ddp, train_steps
from dist_utils import run_ranks
from gradcomp.hooks import Int8State, PowerSGDState, SignState, TopKState, int8_hook, powersgd_hook, sign_hook, topk_hook

pytestmark = pytest.mark.slow

STEPS = 2
CONFIGS = {
    "powersgd": (PowerSGDState, powersgd_hook, {"matrix_rank": 2, "start_iter": 1}),
    "topk": (TopKState, topk_hook, {"ratio": 0.1, "selector": "threshold", "sample": 64}),
    "sign": (SignState, sign_hook, {"chunk": 64}),
    "int8": (Int8State, int8_hook, {}),
    "int8_twophase": (Int8State, int8_hook, {"scheme": "twophase", "stochastic": True}),
}


def _run(rank, world, folder, phase):
    """phase "first": STEPS steps, then save; "full": 2 STEPS uninterrupted; "resume": load, STEPS."""
    out = {}
    for label, (state_class, hook, options) in CONFIGS.items():
        model = make_ddp(build_model())
        state = state_class(None, **options)
        model.register_comm_hook(state, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        file = f"{folder}/{label}-rank{rank}.pt"
        start = 0
        if phase == "resume":
            saved = torch.load(file, weights_only=False)
            model.module.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            state.load_state_dict(saved["hook"])
            start = STEPS
        train_steps(model, optimizer, 2 * STEPS if phase == "full" else STEPS, rank, start=start)
        if phase == "first":
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "hook": state.state_dict()}, file)
        out[label] = (flat_params(model.module), state.step)
    if phase == "resume":
        out["errors"] = _load_errors(rank, folder)
    return out


def _load_errors(rank, folder):
    """Loading the other rank's state dict, and one saved with another world size."""
    errors = []
    other = torch.load(f"{folder}/int8-rank{1 - rank}.pt", weights_only=False)["hook"]
    wider = {**other, "rank": rank, "world_size": 4}
    for saved in (other, wider):
        try:
            Int8State(None).load_state_dict(saved)
        except ValueError as exc:
            errors.append(str(exc))
        else:
            errors.append(None)
    return errors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("resume"))
    first = run_ranks(_both, 2, folder)
    resumed = run_ranks(_run, 2, folder, "resume")
    return first, resumed


def _both(rank, world, folder):
    return {"full": _run(rank, world, folder, "full"), "first": _run(rank, world, folder, "first")}


def test_plain_registration_resumes_bit_exact(runs):
    first, resumed = runs
    for rank in range(2):
        for label in CONFIGS:
            uninterrupted, steps = first[rank]["full"][label]
            assert not torch.equal(first[rank]["first"][label][0], uninterrupted), label
            assert resumed[rank][label][1] == steps == 2 * STEPS, label
            assert torch.equal(resumed[rank][label][0], uninterrupted), f"{label}: rank {rank} resumed differently"


def test_state_dict_of_another_rank_or_world_size_is_refused(runs):
    _, resumed = runs
    for rank in range(2):
        other_rank, other_world = resumed[rank]["errors"]
        assert f"holds rank {1 - rank}'s error-feedback residuals, this process is rank {rank}" in other_rank
        assert "saved with world size 4, this run has 2" in other_world


def test_state_dict_says_whose_it_is():
    state = Int8State(None).state_dict()
    assert state["rank"] is None and state["world_size"] is None  # no process group yet
