"""The DDP hooks when a run goes wrong (2 Gloo ranks, each case under a wall limit: a hang fails
the test): a resume into a model whose layer changed size, and an error raised inside any of the
hooks' Future callbacks. Each ends in one clear error on every rank, never in a wait.

Controls: the same resume into an unchanged model trains with identical replicas, and a hook with
nothing injected completes: what the cases see is the fault, not the harness."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ddp_models import flat_params, make_ddp
from dist_utils import run_ranks
import gradcomp
from gradcomp.hooks import Int8State, PowerSGDState, int8_hook, powersgd_hook

pytestmark = pytest.mark.slow

TIMEOUT_S = 15  # each collective's bound: a rank that waited on a never-completed future would hit the wall
METHODS = {"int8": {}, "sign": {"chunk": 64}, "topk": {"ratio": 0.1}, "powersgd": {"matrix_rank": 2}}


class Net(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(16, hidden)
        self.fc2 = nn.Linear(hidden, 8)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _net(hidden: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return Net(hidden)


def _step(model, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(torch.randn(4, 16, generator=gen)), torch.randn(4, 8, generator=gen)).backward()


def _outcome(fn):
    """"ok" or the first line of the error (every case returns in the test's wall limit or fails)."""
    try:
        fn()
        return "ok"
    except Exception as exc:  # DDP re-raises a hook's error as a RuntimeError
        return f"{type(exc).__name__}: {exc}"


def _resize_cases(rank, world, folder):
    out = {}
    for method, options in METHODS.items():
        model = make_ddp(_net(), bucket_cap_mb=0.001)
        state = gradcomp.hooks.register(model, method, **options)
        for step in range(2):
            _step(model, rank, step)
        saved = state.state_dict()
        same = make_ddp(_net(), bucket_cap_mb=0.001)
        gradcomp.hooks.register(same, method, **options).load_state_dict(saved)
        out[f"{method} same size"] = _outcome(lambda: _step(same, rank, 2))
        out[f"{method} same size params"] = flat_params(same.module)
        resized = make_ddp(_net(hidden=24), bucket_cap_mb=0.001)
        loaded = gradcomp.hooks.register(resized, method, **options)
        out[f"{method} bound"] = _outcome(lambda: loaded.load_state_dict(saved))
    # a state the user registers without binding it to the model: checked at the first step
    for label, state_class, hook, options in (("int8", Int8State, int8_hook, {}),
                                              ("powersgd", PowerSGDState, powersgd_hook, {"matrix_rank": 2})):
        model = make_ddp(_net(), bucket_cap_mb=0.001)
        state = state_class(None, **options)
        model.register_comm_hook(state, hook)
        for step in range(2):
            _step(model, rank, step)
        saved = state.state_dict()
        resized = make_ddp(_net(hidden=24), bucket_cap_mb=0.001)
        fresh = state_class(None, **options)
        resized.register_comm_hook(fresh, hook)
        fresh.load_state_dict(saved)
        out[f"{label} unbound"] = _outcome(lambda: _step(resized, rank, 2))
    return out


@pytest.fixture(scope="module")
def resized(tmp_path_factory):
    return run_ranks(_resize_cases, 2, str(tmp_path_factory.mktemp("resize")), timeout_s=TIMEOUT_S,
                     wall_s=120)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_state_for_a_resized_layer_is_refused_when_loaded(resized, method):
    for outcome in resized:
        message = outcome[f"{method} bound"]
        assert message.startswith("ValueError"), message
        assert "fc1.weight: 512 elements in the checkpoint, 384 in the model" in message, message


def test_an_unbound_state_for_a_resized_layer_fails_the_first_backward(resized):
    for outcome in resized:
        for label in ("int8", "powersgd"):
            message = outcome[f"{label} unbound"]
            assert message.startswith("RuntimeError") and "elements in the checkpoint" in message, message


def test_control_the_same_resume_into_an_unchanged_model_trains(resized):
    for method in METHODS:
        assert [o[f"{method} same size"] for o in resized] == ["ok", "ok"]
        assert torch.equal(resized[0][f"{method} same size params"], resized[1][f"{method} same size params"])


# ---- an error inside a Future callback --------------------------------------------------------

class Injected(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise Injected("injected fault")


INJECTIONS = {
    # (method, options), the attribute replaced by a function that raises, and where it runs
    "allreduce, the sum's callback": ("fp16", {}, "gradcomp.comm._first_value"),
    "allgather, the decode callback": ("int8", {}, "gradcomp.methods.quant.Int8.decode_sum"),
    "twophase, the chunk's reduce callback": ("int8", {"scheme": "twophase"}, "gradcomp.methods.quant.Int8.decode_sum"),
    "twophase, the deferred all-gather": ("int8", {"scheme": "twophase"}, "gradcomp.comm.allgather_payloads"),
    "powersgd, the deferred Q launch": ("powersgd", {"matrix_rank": 2}, "gradcomp.hooks.powersgd.orthonormalize_runs_"),
    "powersgd, the decode callback": ("powersgd", {"matrix_rank": 2}, "gradcomp.hooks.powersgd.decode_into"),
    "hierarchical, the inter-node decode": ("int8", {"hierarchical": True, "node_size": 1},
                                            "gradcomp.methods.quant.Int8.decode_sum"),
    "hierarchical, the deferred intra-node all-gather": ("int8", {"hierarchical": True, "node_size": 2},
                                                         "gradcomp.comm.all_gather_into"),
    "auto, its timing callback after the all-reduce's": ("auto", {}, "gradcomp.comm._first_value"),
    "control: nothing injected": ("int8", {}, None),
}


def _callback_cases(rank, world):
    out = {}
    # an option written at its default on one rank only is the same configuration
    model = make_ddp(_net(), bucket_cap_mb=0.001)
    gradcomp.hooks.register(model, "int8", **({"block": 256} if rank == 0 else {}))
    out["default written on one rank"] = _outcome(lambda: [_step(model, rank, step) for step in range(2)])
    out["default written on one rank params"] = flat_params(model.module)
    model = make_ddp(_net(), bucket_cap_mb=0.001)  # the control: another value is another configuration
    gradcomp.hooks.register(model, "int8", **({"block": 128} if rank == 0 else {}))
    out["another block on one rank"] = _outcome(lambda: _step(model, rank, 0))
    for label, (method, options, target) in INJECTIONS.items():
        model = make_ddp(_net(), bucket_cap_mb=0.001)
        gradcomp.hooks.register(model, method, **options)
        _step(model, rank, 0)  # the first step: consistency check, DDP's bucket rebuild
        with pytest.MonkeyPatch.context() as patch:
            if target:
                patch.setattr(target, _raise)
            out[label] = _outcome(lambda: _step(model, rank, 1))
    return out


@pytest.fixture(scope="module")
def callbacks():
    return run_ranks(_callback_cases, 2, timeout_s=TIMEOUT_S, wall_s=120)


@pytest.mark.parametrize("case", [c for c in INJECTIONS if not c.startswith("control")])
def test_an_error_in_a_hooks_callback_reaches_backward(callbacks, case):
    for outcome in callbacks:
        assert "injected fault" in outcome[case], outcome[case]


def test_control_a_hook_with_nothing_injected_completes(callbacks):
    assert [o["control: nothing injected"] for o in callbacks] == ["ok", "ok"]


def test_an_option_written_at_its_default_is_no_mismatch(callbacks):
    assert [o["default written on one rank"] for o in callbacks] == ["ok", "ok"]
    assert torch.equal(callbacks[0]["default written on one rank params"],
                       callbacks[1]["default written on one rank params"])
    for outcome in callbacks:  # the control: a real difference is named
        message = outcome["another block on one rank"]
        assert "ConfigMismatchError" in message and "block: rank 0 has 128, rank 1 has 256" in message, message


def test_a_garbage_per_rank_entry_is_refused_in_one_line(monkeypatch):
    from gradcomp.integrations.dcp import PerRank

    monkeypatch.setattr(PerRank, "_key", lambda self: "rank0")
    with pytest.raises(ValueError, match=r"^PerRank: the checkpoint's rank0 entry \(9 bytes\) is not a state "
                                         r"PerRank saved \(\w+\); load") as raised:
        PerRank(Int8State(None)).load_state_dict({"rank0": b"not a zip"})
    assert "weights_only" not in str(raised.value)
