"""A rank that dies mid-step makes every survivor raise, on every front and scheme.

Each case trains a small model on 2 or 4 Gloo ranks; one rank is killed (SIGKILL, no cleanup)
during its backward pass at step ``DIES_AT``. Every survivor must exit with an error within the
process group's timeout: never finish its steps on an unfilled receive buffer, never hang.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_models import batch, build_model, flat_params, make_ddp
from dist_utils import die, run_ranks, run_ranks_to_their_end

import gradcomp

STEPS, DIES_AT = 8, 3
TIMEOUT_S = 15.0
"""The process group's timeout: a survivor that waits on a dead peer raises by then at worst."""

# ---- fronts (run inside the ranks) -------------------------------------------------------------

def _ddp_hook(method, **options):
    def setup(model):
        ddp = make_ddp(model)
        gradcomp.hooks.register(ddp, method, **options)
        return ddp, torch.optim.SGD(model.parameters(), lr=0.05)
    return setup

def _optimizer(make):
    def setup(model):
        ddp = make_ddp(model)
        gradcomp.optim.local_gradients(ddp)
        return ddp, make([p for p in model.parameters() if p.requires_grad], ddp)
    return setup

def _fsdp(method, replicas=1):
    def setup(model):
        from torch.distributed.fsdp import fully_shard
        replicate_group, mesh = None, None
        if replicas > 1:  # HSDP by hand: shard over pairs of ranks, average the replicas
            from torch.distributed.device_mesh import init_device_mesh
            mesh2d = init_device_mesh("cpu", (replicas, dist.get_world_size() // replicas),
                                      mesh_dim_names=("replicate", "shard"))
            mesh, replicate_group = mesh2d["shard"], mesh2d.get_group("replicate")
        for layer in (model.conv, model.fc1, model.fc2):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        gradcomp.fsdp.compress(model, method, replicate_group=replicate_group)
        return model, torch.optim.SGD(model.parameters(), lr=0.05)
    return setup

FRONTS = {
    "ddp-none": (2, _ddp_hook("none")),
    "ddp-fp16": (2, _ddp_hook("fp16")),
    "ddp-bf16": (2, _ddp_hook("bf16")),
    "ddp-int8-allgather": (2, _ddp_hook("int8", scheme="allgather")),
    "ddp-int8-twophase": (2, _ddp_hook("int8", scheme="twophase")),
    "ddp-int4-allgather": (2, _ddp_hook("int4", scheme="allgather")),
    "ddp-int4-twophase": (2, _ddp_hook("int4", scheme="twophase")),
    "ddp-sign-allgather": (2, _ddp_hook("sign", scheme="allgather")),
    "ddp-sign-twophase": (2, _ddp_hook("sign", scheme="twophase")),
    "ddp-topk-allgather": (2, _ddp_hook("topk", ratio=0.1)),
    "ddp-powersgd": (2, _ddp_hook("powersgd", matrix_rank=2, start_iter=0)),
    "ddp-auto": (2, _ddp_hook("auto", warmup_steps=2, evaluate_every=2)),
    "hierarchical-int8-allgather": (4, _ddp_hook("int8", hierarchical=True, node_size=2, scheme="allgather")),
    "hierarchical-sign-twophase": (4, _ddp_hook("sign", hierarchical=True, node_size=2, scheme="twophase")),
    "fsdp-int8": (2, _fsdp("int8")),
    "fsdp-sign-hsdp-by-hand": (4, _fsdp("sign", replicas=2)),
    "zeroone-twophase": (2, _optimizer(lambda params, ddp: gradcomp.optim.ZeroOneAdam(
        params, ddp, lr=1e-3, warmup_steps=1))),
    "zeroone-allgather": (2, _optimizer(lambda params, ddp: gradcomp.optim.ZeroOneAdam(
        params, ddp, lr=1e-3, warmup_steps=1, scheme="allgather"))),
    "dgc": (2, _optimizer(lambda params, ddp: gradcomp.optim.DGC(params, ddp, lr=0.05))),
    "diloco-sign": (2, _optimizer(lambda params, ddp: gradcomp.optim.DiLoCo(
        params, ddp, torch.optim.AdamW, dict(lr=1e-3), sync_every=2, method="sign"))),
    "diloco-streaming-int8": (2, _optimizer(lambda params, ddp: gradcomp.optim.DiLoCo(
        params, ddp, torch.optim.AdamW, dict(lr=1e-3), sync_every=2, method="int8", fragments=2))),
}

def train_until_a_peer_dies(rank, world_size, folder, front, dead_rank):
    """Train STEPS steps under ``front``; ``dead_rank`` dies inside its backward at DIES_AT, as
    the backward reaches fc1 (fc2's gradients are done: DDP's and FSDP's first collectives may
    be in flight). Returns the steps done and whether the parameters stayed finite (a survivor
    should never get here)."""
    net = build_model()
    model, optimizer = FRONTS[front][1](net)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(step, rank)
        if rank == dead_rank and step == DIES_AT:  # before the forward, which arms the hook
            net.fc1.register_full_backward_pre_hook(lambda module, grad_output: die(folder))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return {"steps": STEPS, "finite": bool(torch.isfinite(flat_params(model)).all())}

@pytest.mark.slow
@pytest.mark.parametrize("front", FRONTS)
def test_every_survivor_raises_when_a_peer_dies(front):
    world_size = FRONTS[front][0]
    dead_rank = world_size - 1
    outcomes = run_ranks_to_their_end(train_until_a_peer_dies, world_size, front, dead_rank,
                                      timeout_s=TIMEOUT_S)
    assert outcomes[dead_rank]["exitcode"] == -9, outcomes[dead_rank]
    for rank, outcome in enumerate(outcomes[:dead_rank]):
        assert not outcome["killed"], f"rank {rank} hung: still running {TIMEOUT_S * 2 + 30:g} s in"
        assert "returned" not in outcome, f"rank {rank} trained on after its peer died: {outcome}"
        assert outcome["exitcode"] == 1, outcome
        assert outcome["after_death_s"] < TIMEOUT_S + 5, outcome
        # the collective's own error, not a downstream crash on garbage
        assert outcome["raised"] in ("RuntimeError", "DistBackendError"), outcome["traceback"]


# ---- restart from the last checkpoint ---------------------------------------------------------

RESTART_FRONTS = {"ddp-int8-allgather": ("int8", {"scheme": "allgather"}),
                  "ddp-sign-twophase": ("sign", {"scheme": "twophase"})}


def train_from(rank, front, checkpoints, start, stop, die_at=None, folder=None):
    """Steps [start, stop) under a RESTART_FRONTS hook (loading rank's checkpoint when start >
    0); saves a checkpoint after each step; the last rank dies in its backward at ``die_at``."""
    name, options = RESTART_FRONTS[front]
    net = build_model()
    ddp = make_ddp(net)
    state = gradcomp.hooks.register(ddp, name, **options)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    file = f"{checkpoints}/{front}-rank{rank}.pt"
    if start:
        saved = torch.load(file, weights_only=False)
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["hook"])
        assert saved["step"] == start, (rank, saved["step"], start)
    for step in range(start, stop):
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(step, rank)
        if step == die_at and rank == dist.get_world_size() - 1:
            net.fc1.register_full_backward_pre_hook(lambda module, grad_output: die(folder))
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                    "hook": state.state_dict(), "step": step + 1}, file)
    return flat_params(net)


def _dies(rank, world_size, folder, front, checkpoints):
    return train_from(rank, front, checkpoints, 0, STEPS, die_at=DIES_AT, folder=folder)


def _resumes(rank, world_size, front, checkpoints):
    return train_from(rank, front, checkpoints, DIES_AT, STEPS)


def _uninterrupted(rank, world_size, front, checkpoints):
    return train_from(rank, front, checkpoints, 0, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("front", RESTART_FRONTS)
def test_a_restart_from_the_last_checkpoint_continues_bit_exactly(front, tmp_path):
    died, whole = tmp_path / "died", tmp_path / "whole"
    died.mkdir(), whole.mkdir()
    outcomes = run_ranks_to_their_end(_dies, 2, front, str(died), timeout_s=TIMEOUT_S)
    assert outcomes[1]["exitcode"] == -9 and outcomes[0]["exitcode"] == 1, outcomes
    resumed = run_ranks(_resumes, 2, front, str(died))
    reference = run_ranks(_uninterrupted, 2, front, str(whole))
    for rank in (0, 1):
        assert torch.equal(resumed[rank], reference[rank]), f"rank {rank} resumed differently"


# ---- a payload corrupted on the wire ----------------------------------------------------------

WIRE_METHODS = [("int8", {}), ("int4", {}), ("sign", {}), ("topk", {"ratio": 0.1})]


def corrupted_on_the_wire(rank, world_size, steps):
    """Train ``steps`` steps under each WIRE_METHODS hook (all-gather) while rank 1 corrupts what
    it sends: random bytes at random places, and for top-k every index set outside the tensor.
    Returns per method: (top-k indices rank 1 put out of range, this rank's dropped_entries,
    whether its parameters stayed finite)."""
    from gradcomp import comm
    from gradcomp.payload import wire_layout

    gen = torch.Generator().manual_seed(rank)
    original, original_gather, results = comm.all_gather_into, comm.allgather_payloads, {}
    for name, options in WIRE_METHODS:
        outside, sending = [0], []

        def record(payload, group=None):  # the payload whose flat bytes all_gather_into sends
            sending[:] = [payload]
            return original_gather(payload, group)

        def corrupt(out, inp, group=None, async_op=False, name=name, options=options):
            if inp.dtype != torch.uint8:  # not a payload (the configuration check's all-gather)
                return original(out, inp, group=group, async_op=async_op)
            bad = inp.clone()
            if name == "topk":  # values (fp32) then indices (int32), k of each, in the wire layout
                k = sending[0].parts["indices"].numel()
                start = wire_layout([4 * k, 4 * k])[0][1]
                bad[start:start + 4 * k].view(torch.int32)[:] = torch.randint(
                    1 << 20, 1 << 30, (k,), generator=gen, dtype=torch.int32)
                outside[0] += k
            else:
                where = torch.randint(bad.numel(), (8,), generator=gen)
                bad[where] = torch.randint(256, (8,), generator=gen, dtype=torch.uint8)
            return original(out, bad, group=group, async_op=async_op)

        comm.all_gather_into = corrupt if rank == 1 else original
        comm.allgather_payloads = record if rank == 1 else original_gather
        net = build_model()
        ddp = make_ddp(net)
        state = gradcomp.hooks.register(ddp, name, **options)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            x, y = batch(step, rank)
            F.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        results[name] = (outside[0], state.stats()["dropped_entries"],
                         bool(torch.isfinite(flat_params(net)).all()))
    comm.all_gather_into, comm.allgather_payloads = original, original_gather
    return results


@pytest.mark.slow
def test_a_payload_corrupted_on_the_wire_never_crashes_a_rank(monkeypatch):
    """On the torch path; tests/interpreted/test_untrusted_payloads.py runs the same ranks on the
    kernels (under the interpreter: its process's forkserver starts ranks in a fraction of a
    second, where this process would spawn each rank afresh with TRITON_INTERPRET=1, ~10 s)."""
    monkeypatch.setenv("GRADCOMP_BACKEND", "torch")
    assert_corruption_survived(run_ranks(corrupted_on_the_wire, 2, 3))


def assert_corruption_survived(results) -> None:
    """corrupted_on_the_wire's results by rank: rank 1 sent top-k indices out of range, every rank
    dropped exactly those (and nothing of the other methods), and top-k's parameters stayed finite."""
    sent_outside = results[1]["topk"][0]
    assert sent_outside > 0
    for rank in (0, 1):  # rank 1 decodes its own corrupted row too
        for name, _ in WIRE_METHODS:
            outside, dropped, finite = results[rank][name]
            assert dropped == (sent_outside if name == "topk" else 0), (rank, name, dropped)
        assert results[rank]["topk"][2], "top-k's remaining entries are finite: so are the parameters"
