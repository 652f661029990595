"""The optimizers that own the exchange (ZeroOneAdam, DGC, DiLoCo) when a run goes wrong (issue
49): ranks configured differently, GradScaler overflows on one rank, checkpoints of another rank,
world size or model. Every case runs on 2 Gloo ranks under a wall limit (a hang fails the test)
and must end, within the process-group timeout, in a correct run (replicas identical) or in one
clear error on every rank naming the cause.

Controls, one per harness, show that each can fail: with the configuration check switched off a
differing lr runs to its end with the replicas apart (what the identical-replicas assertion
catches); torch's own per-rank GradScaler decision (the optimizer's amp support switched off)
puts the ranks out of step and the harness sees it; the same configurations written alike (a
default written out on one rank only, an implementation flag differing) train normally.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_models import flat_params
from dist_utils import run_ranks, run_ranks_to_their_end
from torch.nn.parallel import DistributedDataParallel as DDP

from gradcomp.consistency import ConfigMismatchError
from gradcomp.optim import DGC, DiLoCo, ZeroOneAdam

pytestmark = pytest.mark.slow

TIMEOUT_S = 20  # each collective's bound; a launch's wall limit is WALL_S (a hang fails the test)
WALL_S = 90


def _net(dims=(8, 4, 3), dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(dims[0], dims[1]), torch.nn.Linear(dims[1], dims[2])).to(dtype)


def _groups(net, **second):
    """Two param groups (the second with ``second``'s hyper-parameters)."""
    return [{"params": list(net[0].parameters())}, {"params": list(net[1].parameters()), **second}]


def _backward(net, rank, step, model=None):
    """This rank's own batch of (step): the mse loss of ``model`` (default ``net``; a DDP of it)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    dtype = net[0].weight.dtype
    x = torch.randn(4, net[0].in_features, generator=gen).to(dtype)
    return F.mse_loss((model or net)(x), torch.randn(4, net[-1].out_features, generator=gen).to(dtype))


def _train(net, opt, rank, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        _backward(net, rank, step).backward()
        opt.step()
    return flat_params(net)


def _outcome(fn):
    """("ok", what fn returned) or the error as "Type: message"."""
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 (each case reports what ended it)
        return f"{type(exc).__name__}: {exc}", None


# ---- configuration across ranks ------------------------------------------------------------------

ZEROONE = dict(lr=1e-2, warmup_steps=1)
DILOCO = dict(inner_options=dict(lr=1e-2), sync_every=2, method="int8")
# name: (class, options on both ranks, rank 1's changes, the second group's on rank 1, expected line)
MISMATCHES = {
    "zeroone compress_preconditioned": (ZeroOneAdam, ZEROONE, dict(compress_preconditioned=False), {},
                                        "compress_preconditioned: rank 0 has True, rank 1 has False"),
    "zeroone lr": (ZeroOneAdam, ZEROONE, dict(lr=2e-2), {}, "param_groups[0].lr: rank 0 has 0.01, rank 1 has 0.02"),
    "zeroone betas": (ZeroOneAdam, ZEROONE, dict(betas=(0.9, 0.99)), {},
                      "param_groups[0].betas: rank 0 has [0.9, 0.999], rank 1 has [0.9, 0.99]"),
    "zeroone eps": (ZeroOneAdam, ZEROONE, dict(eps=1e-6), {}, "param_groups[0].eps: rank 0 has 1e-08, rank 1 has 1e-06"),
    "zeroone method": (ZeroOneAdam, ZEROONE, dict(method="int8"), {}, "method: rank 0 has 'sign', rank 1 has 'int8'"),
    "zeroone method options": (ZeroOneAdam, ZEROONE, dict(method_options={"chunk": 512}), {},
                               "method_options: rank 0 has {'chunk': 1024}, rank 1 has {'chunk': 512}"),
    "zeroone warm-up": (ZeroOneAdam, ZEROONE, dict(warmup_steps=2), {}, "warmup_steps: rank 0 has 1, rank 1 has 2"),
    "zeroone scheme": (ZeroOneAdam, ZEROONE, dict(scheme="allgather"), {},
                       "scheme: rank 0 has 'twophase', rank 1 has 'allgather'"),
    "zeroone weight decay of one group": (ZeroOneAdam, ZEROONE, {}, dict(weight_decay=0.1),
                                          "param_groups[1].weight_decay: rank 0 has 0, rank 1 has 0.1"),
    "dgc density": (DGC, dict(density=0.5), dict(density=0.25), {}, "density: rank 0 has 0.5, rank 1 has 0.25"),
    "dgc momentum": (DGC, dict(density=0.5), dict(momentum=0.8), {},
                     "param_groups[0].momentum: rank 0 has 0.9, rank 1 has 0.8"),
    "diloco method": (DiLoCo, DILOCO, dict(method="int4"), {}, "method: rank 0 has 'int8', rank 1 has 'int4'"),
    "diloco inner lr": (DiLoCo, DILOCO, dict(inner_options=dict(lr=2e-2)), {},
                        "param_groups[0].lr: rank 0 has 0.01, rank 1 has 0.02"),
    "diloco sync_every": (DiLoCo, DILOCO, dict(sync_every=3), {}, "sync_every: rank 0 has 2, rank 1 has 3"),
}
# written alike: rank 0 spells out defaults (and an int lr / a list of betas / foreach, an
# implementation flag), rank 1 leaves them implicit; both must train with identical replicas
ALIKE = {
    "zeroone defaults written out": (
        ZeroOneAdam, dict(lr=1, betas=[0.9, 0.999], eps=1e-8, weight_decay=0, warmup_steps=1, method="sign",
                          method_options={"chunk": 1024}, scheme="twophase", compress_preconditioned=True,
                          variance_floor=0.1, sync_every=1, local_updates="shared"),
        dict(lr=1.0, warmup_steps=1)),
    "dgc defaults written out": (DGC, dict(lr=0.1, momentum=0.9, weight_decay=0, density=0.5, selector="exact"),
                                 dict(density=0.5)),
    "diloco defaults written out": (
        DiLoCo, dict(inner=torch.optim.AdamW, inner_options=dict(lr=1e-2, weight_decay=0.01, foreach=True),
                     sync_every=2, method="int8", scheme="allgather", outer_lr=0.7, nesterov=True),
        dict(inner_options=dict(lr=0.01, foreach=False), sync_every=2)),
}


def _config_cases(rank, world_size):
    out = {}
    for name, (cls, options, changes, second, _) in MISMATCHES.items():
        net = _net()
        opt = cls(_groups(net, **(second if rank == 1 else {})), net, **{**options, **(changes if rank == 1 else {})})
        out[name] = _outcome(lambda: _train(net, opt, rank, 2))
    for name, (cls, mine, theirs) in ALIKE.items():
        net = _net()
        opt = cls(_groups(net), net, **(mine if rank == 0 else theirs))
        out[name] = _outcome(lambda: _train(net, opt, rank, 4))
    # parameters of another dtype: refused at construction, before rank 0's parameters are
    # broadcast (which would abort in Gloo on the size mismatch)
    net = _net(dtype=torch.float64 if rank == 1 else torch.float32)
    out["model dtype"] = _outcome(lambda: ZeroOneAdam(net.parameters(), net, **ZEROONE))
    # a scheduler on one rank only (its lr would part from the other's later)
    net = _net()
    opt = ZeroOneAdam(net.parameters(), net, **ZEROONE)
    if rank == 0:
        torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    out["scheduler on one rank"] = _outcome(lambda: _train(net, opt, rank, 2))
    # control: the check switched off, lr differing: runs to its end, silently apart
    net = _net()
    opt = ZeroOneAdam(net.parameters(), net, **{**ZEROONE, "lr": 2e-2 if rank else 1e-2})
    opt._checked = True
    out["control: lr differing, check off"] = _outcome(lambda: _train(net, opt, rank, 3))
    return out


@pytest.fixture(scope="module")
def config_cases():
    return run_ranks(_config_cases, 2, timeout_s=TIMEOUT_S, wall_s=WALL_S)


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_a_configuration_differing_on_one_rank_is_one_error_on_every_rank_naming_it(config_cases, name):
    (first, _), (second, _) = (r[name] for r in config_cases)
    assert first == second  # the same error, word for word, on both ranks
    assert first.startswith("ConfigMismatchError: gradcomp.optim.") and MISMATCHES[name][-1] in first, first


def test_parameters_and_a_scheduler_on_one_rank_only_are_refused_on_every_rank(config_cases):
    dtype = [r["model dtype"][0] for r in config_cases]
    assert dtype[0] == dtype[1] and dtype[0].startswith("ConfigMismatchError: the parameters of gradcomp.optim")
    assert "parameter names, shapes and dtypes (digest)" in dtype[0]
    scheduled = [r["scheduler on one rank"][0] for r in config_cases]
    assert scheduled[0] == scheduled[1]
    assert "param_groups[0].initial_lr: rank 0 has 0.01, rank 1 has '<unset>'" in scheduled[0]
    assert "param_groups[0].lr: rank 0 has 0.01, rank 1 has 0.01" not in scheduled[0]  # lr itself agrees


@pytest.mark.parametrize("name", list(ALIKE))
def test_options_written_differently_but_resolving_alike_train_with_identical_replicas(config_cases, name):
    (first, mine), (second, theirs) = (r[name] for r in config_cases)
    assert (first, second) == ("ok", "ok")
    assert torch.isfinite(mine).all() and torch.equal(mine, theirs)


def test_control_without_the_check_a_differing_lr_diverges_silently(config_cases):
    """What the check prevents, and proof that the identical-replicas assertion can fail."""
    (first, mine), (second, theirs) = (r["control: lr differing, check off"] for r in config_cases)
    assert (first, second) == ("ok", "ok") and not torch.equal(mine, theirs)


# ---- checkpoints -----------------------------------------------------------------------------------

def _state_of(opt, net):
    return copy.deepcopy(opt.state_dict()["gradcomp"]), flat_params(net)


def _unchanged(opt, net, before) -> bool:
    state, params = before
    now, now_params = _state_of(opt, net)
    return (torch.equal(params, now_params) and now["counters"] == state["counters"]
            and all(torch.equal(now["buffers"][k], v) for k, v in state["buffers"].items()))


def _checkpoint_cases(rank, world_size):
    out = {}
    net = _net()
    opt = ZeroOneAdam(net.parameters(), net, **ZEROONE)
    _train(net, opt, rank, 2)
    at_two = opt.state_dict()
    uninterrupted = _train(net, opt, rank, 1, start=2)
    at_three = opt.state_dict()
    states = [None] * world_size
    dist.all_gather_object(states, at_two)
    out["state"] = at_two  # for the one-process test
    # another rank's state, a truncated buffer: refused, the optimizer as it was
    fresh_net = _net()
    fresh = ZeroOneAdam(fresh_net.parameters(), fresh_net, **ZEROONE)
    _train(fresh_net, fresh, rank, 1)
    before = _state_of(fresh, fresh_net)
    out["another rank's state"] = _outcome(lambda: fresh.load_state_dict(states[1 - rank]))
    truncated = copy.deepcopy(at_two)
    truncated["gradcomp"]["buffers"]["momentum"] = truncated["gradcomp"]["buffers"]["momentum"][:-1]
    out["truncated buffer"] = _outcome(lambda: fresh.load_state_dict(truncated))
    out["unchanged after refusals"] = _unchanged(fresh, fresh_net, before)
    # ranks resumed from checkpoints of different steps: the next step refuses on every rank
    apart_net = _net()
    apart = ZeroOneAdam(apart_net.parameters(), apart_net, **ZEROONE)
    apart.load_state_dict(at_two if rank == 0 else at_three)
    out["resumed at different steps"] = _outcome(lambda: _train(apart_net, apart, rank, 1, start=2))
    # control: each rank's own state resumes exactly (model values from the checkpointed run)
    good_net = _net()
    good = ZeroOneAdam(good_net.parameters(), good_net, **ZEROONE)
    _train(good_net, good, rank, 2)  # the same two steps as the checkpointed run: the same values
    good.load_state_dict(at_two)
    out["own state resumed"] = _outcome(lambda: _train(good_net, good, rank, 1, start=2))
    out["uninterrupted"] = uninterrupted
    # DiLoCo: another rank's state refused too; its state for the one-process test
    dnet = _net()
    diloco = DiLoCo(dnet.parameters(), dnet, **DILOCO)
    _train(dnet, diloco, rank, 1)
    dstates = [None] * world_size
    dist.all_gather_object(dstates, diloco.state_dict())
    out["diloco state"] = dstates[rank]
    before = _state_of(diloco, dnet)
    out["diloco another rank's state"] = _outcome(lambda: diloco.load_state_dict(dstates[1 - rank]))
    out["diloco unchanged"] = _unchanged(diloco, dnet, before)
    return out


@pytest.fixture(scope="module")
def checkpoint_cases():
    return run_ranks(_checkpoint_cases, 2, timeout_s=TIMEOUT_S, wall_s=WALL_S)


def test_a_checkpoint_of_another_rank_or_truncated_is_refused_before_anything_changes(checkpoint_cases):
    for rank, r in enumerate(checkpoint_cases):
        other = 1 - rank
        assert r["another rank's state"][0] == (
            f"ValueError: ZeroOneAdam.load_state_dict: the checkpoint holds rank {other}'s state, this process "
            f"is rank {rank}; save opt.state_dict() on every rank and load each rank's own")
        assert r["truncated buffer"][0].startswith("ValueError: ZeroOneAdam.load_state_dict: state buffer "
                                                   "'momentum' is [50], this optimizer's parameters have 51")
        assert r["unchanged after refusals"]
        assert r["diloco another rank's state"][0].startswith(
            f"ValueError: DiLoCo.load_state_dict: the checkpoint holds rank {other}'s state")
        assert r["diloco unchanged"]


def test_ranks_resumed_from_different_steps_are_refused_at_the_next_step_on_every_rank(checkpoint_cases):
    first, second = (r["resumed at different steps"][0] for r in checkpoint_cases)
    assert first == second and "step: rank 0 has 2, rank 1 has 3" in first, first
    for r in checkpoint_cases:  # control: each rank's own checkpoint resumes bit-exactly
        status, params = r["own state resumed"]
        assert status == "ok" and torch.equal(params, r["uninterrupted"])


def test_a_two_rank_state_is_refused_by_a_one_process_run(checkpoint_cases):
    state, dstate = checkpoint_cases[0]["state"], checkpoint_cases[0]["diloco state"]
    net = _net()
    opt = ZeroOneAdam(net.parameters(), net, **ZEROONE)
    with pytest.raises(ValueError, match="saved by a run of world size 2, this run has 1; .*resume with 2 ranks"):
        opt.load_state_dict(state)
    dnet = _net()
    diloco = DiLoCo(dnet.parameters(), dnet, **DILOCO)
    with pytest.raises(ValueError, match="world size 2, this run has 1"):
        diloco.load_state_dict(dstate)


# ---- one process: states of another model, methods the optimizers cannot send ---------------------

def _one_process_state(cls, net, **options):
    opt = cls(net.parameters(), net, **options)
    _train(net, opt, 0, 2)
    return opt.state_dict()


def test_another_models_state_is_refused_naming_the_parameter():
    state = _one_process_state(ZeroOneAdam, _net((8, 4, 3)), **ZEROONE)
    net = _net((4, 8, 3))  # 67 elements: another numel; and the same numel in other shapes
    with pytest.raises(ValueError, match="numel"):
        ZeroOneAdam(net.parameters(), net, **ZEROONE).load_state_dict(state)
    swapped = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3))
    swapped[0].weight = torch.nn.Parameter(torch.zeros(8, 4))  # [8, 4] instead of [4, 8]: 32 alike
    opt = ZeroOneAdam(swapped.parameters(), swapped, **ZEROONE)
    with pytest.raises(ValueError, match=r"parameter 0 is 0.weight \[4, 8\] torch.float32 in the checkpoint, "
                                         r"0.weight \[8, 4\] torch.float32 here"):
        opt.load_state_dict(state)


def test_a_truncated_inner_state_or_residual_is_refused_before_the_next_step_would_fail():
    net = _net()
    state = _one_process_state(DiLoCo, net, **{**DILOCO, "sync_every": 1})  # outer steps: residuals exist
    inner = copy.deepcopy(state)
    inner["gradcomp"]["inner"]["state"][0]["exp_avg"] = inner["gradcomp"]["inner"]["state"][0]["exp_avg"][:2]
    fresh = DiLoCo(net.parameters(), net, **{**DILOCO, "sync_every": 1})
    with pytest.raises(ValueError, match=r"inner optimizer's 'exp_avg' of parameter 0.weight is \[2, 8\]"):
        fresh.load_state_dict(inner)
    residual = copy.deepcopy(state)
    entry = residual["gradcomp"]["exchange"]["feedback"]["entries"]["fragment0"]
    entry["residual"], entry["shape"] = entry["residual"][:-1], [entry["residual"].numel() - 1]
    with pytest.raises(ValueError, match="residual 'fragment0' holds 50 elements, this optimizer sends 51"):
        fresh.load_state_dict(residual)
    fresh.load_state_dict(state)  # control: the untouched state loads


@pytest.mark.parametrize("make", [
    lambda net: DiLoCo(net.parameters(), net, method="powersgd"),
    lambda net: ZeroOneAdam(net.parameters(), net, method="powersgd", scheme="lowrank"),
    lambda net: ZeroOneAdam(net.parameters(), net, warmup_method="powersgd"),
])
def test_a_per_tensor_method_is_refused_at_construction_naming_the_methods_that_work(make):
    with pytest.raises(ValueError, match=r"'powersgd' exchanges tensor by tensor .* use one of .*int8.*sign"):
        make(_net())


# ---- GradScaler ---------------------------------------------------------------------------------------

STEPS, OVERFLOW_STEP = 5, 2  # an inf gradient on rank 1 only at step 2
SCALER = dict(init_scale=2.0 ** 10, growth_interval=1000)
AMP = {  # name: (class, options, follow the scaler, unscale_ before step (the clipping recipe))
    "zeroone": (ZeroOneAdam, dict(lr=1e-2, warmup_steps=1, sync_every=2), True, False),
    "zeroone unscaled first": (ZeroOneAdam, dict(lr=1e-2, warmup_steps=1), True, True),
    "zeroone own": (ZeroOneAdam, dict(lr=1e-2, warmup_steps=1, local_updates="own"), True, False),
    "dgc": (DGC, dict(lr=0.1, density=0.5), True, False),
    "diloco": (DiLoCo, dict(inner_options=dict(lr=1e-2), sync_every=2, method="int8"), False, False),
}


def _overflow(grad):
    grad = grad.clone()
    grad[0, 0] = float("inf")
    return grad


def _amp_run(rank, cls, options, follow, unscale_first, scaler_on=True, overflow=True, ddp=False):
    """STEPS of the fp16 recipe (fp32 model: the scaler's logic without autocast); per step this
    rank's parameters, the scale and the optimizer's counters."""
    net = _net()
    model = DDP(net) if ddp else net
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2) if ddp else cls(net.parameters(), net, **options)
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_on, **SCALER)
    if follow:
        opt.follow_scaler(scaler)
    record = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        # the overflow arises in backward (before DDP's reducer sees the gradient)
        hook = net[0].weight.register_hook(_overflow) if overflow and step == OVERFLOW_STEP and rank == 1 else None
        scaler.scale(_backward(net, rank, step, model)).backward()
        if hook is not None:
            hook.remove()
        if not scaler_on and step == OVERFLOW_STEP:  # the reference: every rank skips this step
            continue
        if unscale_first:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1e3)
        scaler.step(opt)
        scaler.update()
        record.append({"params": flat_params(net), "scale": scaler.get_scale(),
                       "counters": dict(getattr(opt, "counters", {}))})
    return record


def _amp_cases(rank, world_size):
    out = {"ddp adamw": _outcome(lambda: _amp_run(rank, None, {}, False, False, ddp=True))}
    for name, args in AMP.items():
        out[name] = _outcome(lambda: _amp_run(rank, *args))
        out[name + " reference"] = _outcome(lambda: _amp_run(rank, *args, scaler_on=False, overflow=False))
    cls, options, _, _ = AMP["zeroone"]
    out["zeroone not followed"] = _outcome(lambda: _amp_run(rank, cls, options, False, False))
    out["zeroone followed on rank 0 only"] = _outcome(lambda: _amp_run(rank, cls, options, rank == 0, False))
    return out


@pytest.fixture(scope="module")
def amp_cases():
    return run_ranks(_amp_cases, 2, timeout_s=TIMEOUT_S, wall_s=WALL_S)


def test_plain_ddp_control_skips_the_overflowed_step_on_every_rank(amp_cases):
    runs = [r["ddp adamw"][1] for r in amp_cases]
    scales = [[s["scale"] for s in run] for run in runs]
    assert scales[0] == scales[1] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    assert all(torch.equal(a["params"], b["params"]) for a, b in zip(*runs))


@pytest.mark.parametrize("name", ["zeroone", "zeroone unscaled first", "zeroone own", "dgc"])
def test_an_overflow_on_one_rank_skips_that_step_on_every_rank_and_the_scales_stay_equal(amp_cases, name):
    control = [s["scale"] for s in amp_cases[0]["ddp adamw"][1]]
    for r in amp_cases:
        assert r[name][0] == "ok", r[name][0]
    runs = [r[name][1] for r in amp_cases]
    for a, b in zip(*runs):  # step for step: the same parameters, scale and counters on both ranks
        assert torch.equal(a["params"], b["params"]) and a["scale"] == b["scale"] and a["counters"] == b["counters"]
    assert [s["scale"] for s in runs[0]] == control  # backed off once, as DDP's all-reduced inf does
    assert runs[0][-1]["counters"]["skipped_steps"] == 1 and runs[0][-1]["counters"]["step"] == STEPS - 1
    # the same values as a run without scaler whose every rank skips that step: the gradients
    # were unscaled exactly (power-of-2 scales) and the skipped step changed nothing
    reference = [s["params"] for s in amp_cases[0][name + " reference"][1]]
    kept = [s["params"] for t, s in enumerate(runs[0]) if t != OVERFLOW_STEP]
    assert len(kept) == len(reference) and all(torch.equal(a, b) for a, b in zip(kept, reference))


def test_diloco_skips_the_overflowed_inner_step_on_its_rank_only_and_stays_on_schedule(amp_cases):
    """DiLoCo's inner steps are local: no collective per step; each rank's scaler follows its
    own overflows, the outer steps stay on every rank's schedule and meet."""
    runs = [r["diloco"][1] for r in amp_cases]
    assert all(r["diloco"][0] == "ok" for r in amp_cases)
    for t, (a, b) in enumerate(zip(*runs)):
        assert a["counters"]["step"] == b["counters"]["step"] == t + 1
        assert torch.equal(a["params"], b["params"]) == (t % 2 == 1)  # identical after outer steps (H = 2)
    assert [run[-1]["counters"]["skipped_inner_steps"] for run in runs] == [0, 1]
    assert [run[-1]["counters"]["outer_steps"] for run in runs] == [2, 2]
    assert [run[-1]["scale"] for run in runs] == [1024.0, 512.0]
    assert all(torch.isfinite(run[-1]["params"]).all() for run in runs)


def test_an_exchanging_optimizer_under_a_scaler_it_does_not_follow_refuses_on_every_rank(amp_cases):
    first, second = (r["zeroone not followed"][0] for r in amp_cases)
    assert first == second and first.startswith("RuntimeError: ZeroOneAdam is stepped by torch.amp.GradScaler")
    assert "opt.follow_scaler(scaler)" in first
    first, second = (r["zeroone followed on rank 0 only"][0] for r in amp_cases)
    assert first == second and "grad_scaler: rank 0 has 'GradScaler, followed', rank 1 has 'GradScaler'" in first


def _torch_decides(rank, world_size, folder):
    """Control of the GradScaler harness: torch's per-rank decision (the optimizer's amp support
    switched off), as before issue 49: rank 1 skips alone."""
    net = _net()
    opt = DGC(net.parameters(), net, lr=0.1, density=0.5)
    opt._step_supports_amp_scaling = False
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        scaler.scale(_backward(net, rank, step)).backward()
        if step == OVERFLOW_STEP and rank == 1:
            net[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    return {"step": opt.counters["step"], "params": flat_params(net)}


def test_control_torchs_per_rank_decision_puts_the_ranks_out_of_step():
    outcomes = run_ranks_to_their_end(_torch_decides, 2, timeout_s=3, wall_s=30)
    assert not any(o["killed"] for o in outcomes)
    # rank 1 skipped alone and ended one exchange short; rank 0's last exchange had no peer: it
    # failed in Gloo (peer gone, or the timeout), no word of the cause: what the harness above
    # (ok on both ranks, equal counters) refuses
    assert outcomes[1]["returned"]["step"] == STEPS - 1, outcomes[1]
    assert outcomes[0]["raised"] == "RuntimeError" and "GradScaler" not in outcomes[0]["message"], outcomes[0]
