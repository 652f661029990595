"""torch.distributed.checkpoint: every gradcomp state as a DCP ``Stateful`` (PerRank) beside the
model and optimizer (get_state_dict / set_state_dict), on 2 Gloo ranks: N steps, dcp.save, a
fresh build, dcp.load, N more steps == 2N uninterrupted steps, bit for bit, on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from ddp_models import batch, build_model, flat_params, make_ddp
from dist_utils import run_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import gradcomp
from gradcomp.hooks import AutoState, auto_hook
from gradcomp.integrations.dcp import PerRank

pytestmark = pytest.mark.slow
STEPS = 3


def _hook(method, **options):
    def build(net):
        ddp = make_ddp(net)
        state = gradcomp.hooks.register(ddp, method, **options)
        return ddp, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), state
    return build


class ScriptedAutoState(AutoState):
    """``auto`` switching by SCRIPT (step -> choice) instead of by timings: a live decision
    follows the machine's load, so an uninterrupted and a resumed run could choose differently."""

    SCRIPT = {2: "int8:allgather", 4: "sign:twophase", 5: "int8:twophase"}

    def evaluate(self, device):
        if self.step in self.SCRIPT:
            self.switch(self.SCRIPT[self.step])


def _scripted_auto(net):
    ddp = make_ddp(net)
    state = ScriptedAutoState(None, methods=("int8", "sign"), warmup_steps=2, evaluate_every=1)
    ddp.register_comm_hook(state, auto_hook)
    return ddp, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), state


def _fsdp(method):
    def build(net):
        from torch.distributed.fsdp import fully_shard
        for layer in (net.conv, net.fc1, net.fc2):
            fully_shard(layer)
        fully_shard(net)
        handle = gradcomp.fsdp.compress(net, method)
        return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), handle
    return build


def _optimizer(make):
    def build(net):
        ddp = make_ddp(net)
        gradcomp.optim.local_gradients(ddp)
        optimizer = make([p for p in net.parameters() if p.requires_grad], ddp)
        return ddp, optimizer, optimizer
    return build


FRONTS = {
    "int8": _hook("int8"),
    "sign-twophase": _hook("sign", scheme="twophase"),
    "topk": _hook("topk", ratio=0.1),
    "powersgd": _hook("powersgd", matrix_rank=2, start_iter=1),
    "auto": _scripted_auto,
    "hierarchical": _hook("int8", hierarchical=True, node_size=1),
    "fsdp-int8": _fsdp("int8"),
    "zeroone": _optimizer(lambda ps, m: gradcomp.optim.ZeroOneAdam(ps, m, lr=1e-3, warmup_steps=1)),
    "dgc": _optimizer(lambda ps, m: gradcomp.optim.DGC(ps, m, lr=0.05)),
    "diloco": _optimizer(lambda ps, m: gradcomp.optim.DiLoCo(
        ps, m, torch.optim.AdamW, dict(lr=1e-3), sync_every=2, method="sign", fragments=2)),
}


def _checkpoint(model, optimizer, gradcomp_state):
    """What a user hands DCP: model and optimizer through the state_dict helpers (a gradcomp
    optimizer is itself the per-rank state), gradcomp's state as PerRank."""
    own_optimizer = optimizer is gradcomp_state
    model_state, optim_state = get_state_dict(model, [] if own_optimizer else optimizer)
    state = {"model": model_state, "comm": PerRank(gradcomp_state)}
    if not own_optimizer:
        state["optim"] = optim_state
    return state


def _train(model, optimizer, rank, start, stop):
    for step in range(start, stop):
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def _run(rank, world_size, folder, phase):
    """phase "full": 2 STEPS; "first": STEPS, then dcp.save; "resume": dcp.load, STEPS more."""
    out = {}
    for front, build in FRONTS.items():
        net = build_model()
        model, optimizer, state = build(net)
        checkpoint_id = f"{folder}/{front}"
        start, stop = (STEPS, 2 * STEPS) if phase == "resume" else (0, 2 * STEPS if phase == "full" else STEPS)
        if phase == "resume":
            checkpoint = _checkpoint(model, optimizer, state)
            dcp.load(checkpoint, checkpoint_id=checkpoint_id)
            if "optim" in checkpoint:
                set_state_dict(model, optimizer, model_state_dict=checkpoint["model"],
                               optim_state_dict=checkpoint["optim"])
            else:
                set_state_dict(model, [], model_state_dict=checkpoint["model"], optim_state_dict={})
        _train(model, optimizer, rank, start, stop)
        if phase == "first":
            dcp.save(_checkpoint(model, optimizer, state), checkpoint_id=checkpoint_id)
        out[front] = torch.cat([p.full_tensor().reshape(-1) if hasattr(p, "full_tensor") else p.detach().reshape(-1)
                                for p in net.parameters()])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dcp"))
    full = run_ranks(_run, 2, folder, "full", timeout_s=120)
    run_ranks(_run, 2, folder, "first", timeout_s=120)
    resumed = run_ranks(_run, 2, folder, "resume", timeout_s=120)
    return full, resumed


@pytest.mark.parametrize("front", FRONTS)
def test_dcp_resume_is_bit_exact_on_every_rank(runs, front):
    full, resumed = runs
    for rank in (0, 1):
        assert torch.equal(resumed[rank][front], full[rank][front]), f"rank {rank}"


def _load_elsewhere(rank, world_size, folder):
    """Load the 2-rank int8 checkpoint into this world size: the error each rank sees."""
    net = build_model()
    model, optimizer, state = FRONTS["int8"](net)
    try:
        dcp.load({"comm": PerRank(state)}, checkpoint_id=f"{folder}/int8")
    except BaseException as exc:  # DCP's CheckpointException (a BaseException) carries every rank's error
        return str(exc)
    return None


def test_a_checkpoint_from_another_world_size_is_refused_on_every_rank(runs, tmp_path_factory):
    folder = str(tmp_path_factory.getbasetemp() / "dcp0")
    errors = run_ranks(_load_elsewhere, 4, folder, timeout_s=120)
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} loaded a 2-rank checkpoint into 4 ranks"
        # ranks 2 and 3 have no entry: DCP refuses the load on every rank, naming them
        assert "Missing key in checkpoint state_dict: comm.rank2" in error, error
