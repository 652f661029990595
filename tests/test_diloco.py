"""gradcomp.optim.DiLoCo: inner steps apart, outer steps on compressed pseudo-gradients together."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from ddp_models import batch, build_model, make_ddp
from dist_utils import run_ranks

import gradcomp
from gradcomp.analysis.optim import run_wire_bytes
from gradcomp.consistency import ConfigMismatchError
from gradcomp.optim import DDPStillReducesError, DiLoCo, fragment_bounds, fragments_due, local_gradients


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("options, message", [
    (dict(sync_every=0), "sync_every"),
    (dict(sync_every=2.5), "sync_every"),
    (dict(outer_lr=0), "outer_lr"),
    (dict(outer_lr=-0.1), "outer_lr"),
    (dict(outer_momentum=1.0), "outer_momentum"),
    (dict(nesterov="yes"), "nesterov"),
    (dict(method="nope"), "nope"),
    (dict(method="topk", scheme="twophase"), "schemes"),
    (dict(method=None, scheme="allgather"), "needs a method"),
    (dict(method_options={"block": 0}), "block"),
    (dict(inner=torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])), "inner must be"),
    (dict(inner_options={"lr": -1.0}), "learning rate"),
    (dict(fragments=0), "fragments"),
    (dict(sync_every=4, fragments=5), "fragments"),
    (dict(sync_every=4, fragments=4), "at most the number of parameters"),
])
def test_bad_options_raise_value_errors_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        DiLoCo(_params(), torch.nn.Linear(1, 1), **options)


def test_fragments_are_synced_once_per_period_at_staggered_steps():
    # fragment f after steps t with (t + 1 + 2 f) % 6 == 0: 2 at 1, 7; 1 at 3, 9; 0 at 5, 11
    assert [fragments_due(t, 6, 3) for t in range(12)] == [[], [2], [], [1], [], [0]] * 2
    assert [t for t in range(12) if fragments_due(t, 6)] == [5, 11]
    assert fragment_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]


def test_the_model_must_be_a_module():
    with pytest.raises(TypeError, match="model must be"):
        DiLoCo(_params(), "model")


def test_outer_step_is_nesterov_sgd_on_the_pseudo_gradient_and_the_scheduler_sets_the_inner_lr():
    torch.manual_seed(0)
    net = torch.nn.Linear(20, 3)
    opt = DiLoCo(net.parameters(), net, torch.optim.SGD, dict(lr=0.1), sync_every=2, method=None,
                 outer_lr=0.7, outer_momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    anchor = [p.detach().clone().requires_grad_() for p in net.parameters()]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    lrs = []
    for step in range(6):
        lrs.append(opt.inner.param_groups[0]["lr"])
        opt.zero_grad()
        net(torch.randn(4, 20)).square().mean().backward()
        before = [p.detach().clone() for p in net.parameters()]
        opt.step()
        scheduler.step()
        if fragments_due(step, 2):
            # the pseudo-gradient: anchor - the parameters after the inner SGD step (which the
            # outer step has overwritten: recomputed from the gradient)
            for a, b, g in zip(anchor, before, (p.grad for p in net.parameters())):
                a.grad = a.detach() - (b - lrs[-1] * g)
            outer.step()
            for a, p in zip(anchor, net.parameters()):
                # two torch kernels (SGD's foreach=False path and DiLoCo's flat ops) compute the same
                # fp32 expression; a fused multiply-add on one CPU could round the last bit apart
                torch.testing.assert_close(p.detach(), a.detach(), rtol=1e-6, atol=1e-7)
    assert lrs == [0.1 * 0.5 ** t for t in range(6)]
    assert opt.stats()["outer_steps"] == 3 and opt.stats()["steps"] == 6


# ---- on Gloo ranks ---------------------------------------------------------------------------

H, STEPS, CHECKPOINT_AFTER, POISON_STEP = 3, 12, 4, 6  # NaN gradient on rank 1 at step 6
CONFIGS = {  # name: (world size, DiLoCo options, the skipped outer step: (step, fragment, its last sync))
    # outer steps after steps 2, 5, 8 and 11; the NaN reaches the exchange at 8
    "adamw-int4": (3, dict(inner_options=dict(lr=1e-2, weight_decay=0.1), method="int4"), (8, 0, 5)),
    # fragment 0 after steps 2, 5, 8, 11; 1 after 1, 4, 7, 10; 2 after 0, 3, 6, 9: the NaN is in
    # fragment 0 after step 6 (fragment 2's exchange there is finite), everywhere after step 7
    "sgd-sign-twophase-streaming": (2, dict(inner=torch.optim.SGD, inner_options=dict(lr=0.05, momentum=0.9),
                                            method="sign", method_options={"chunk": 64}, scheme="twophase",
                                            outer_lr=1.0, outer_momentum=0.5, nesterov=False, fragments=3),
                                    (7, 1, 4)),
}


def _diloco(ddp, name, **changes):
    options = {**CONFIGS[name][1], **changes}
    return DiLoCo([p for p in ddp.module.parameters() if p.requires_grad], ddp, sync_every=H, **options)


def _train(ddp, opt, rank, steps, start=0):
    """Steps of cross-entropy with a NaN gradient on rank 1 at POISON_STEP; this rank's
    parameters after each step."""
    after = []
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        x, y = batch(step, rank)
        F.cross_entropy(ddp(x), y).backward()
        if step == POISON_STEP and rank == 1:
            next(p for p in ddp.module.parameters() if p.grad is not None).grad[0] = math.nan
        opt.step()
        after.append(opt.flat.values())  # the trained parameters, in the order of the fragments
    return after


def _spy_on_exchanges(opt, world_size):
    """Record each pseudo-gradient exchange: what this rank owed (its pseudo-gradient / p), what
    its own payload decodes to, the residual before it, and whether the mean was finite."""
    seen, mean = [], opt.exchange.mean

    def spied(x, *args, **kwargs):
        feedback = opt.exchange.feedback
        before = feedback.residual("fragment0").clone() if "fragment0" in feedback.names() else None
        result = mean(x, *args, **kwargs)
        seen.append({"owed": x / world_size, "sent": gradcomp.decompress(opt.exchange.last_payload),
                     "before": before, "finite": bool(torch.isfinite(result).all())})
        return result

    opt.exchange.mean = spied
    return seen


def _diloco_worker(rank, world_size, name):
    ddp = make_ddp(build_model(seed=rank))  # DDP broadcasts rank 0's parameters
    with pytest.raises(DDPStillReducesError, match="local_gradients"):
        _diloco(ddp, name)
    local_gradients(ddp)
    mismatched = _diloco(ddp, name, outer_lr=0.7 if rank == 0 else 0.5)
    with pytest.raises(ConfigMismatchError, match="outer_lr: rank 0 has 0.7, rank 1 has 0.5"):
        mismatched.step()  # checked at the first step, before its first collective
    opt = _diloco(ddp, name)
    seen = _spy_on_exchanges(opt, world_size) if opt.fragments == 1 and opt.scheme == "allgather" else None
    first = _train(ddp, opt, rank, CHECKPOINT_AFTER)
    checkpoint = opt.state_dict()  # between outer steps: the replicas differ here
    rest = _train(ddp, opt, rank, STEPS - CHECKPOINT_AFTER, start=CHECKPOINT_AFTER)
    # resume into a fresh model (rank 0's initial parameters) and optimizer
    resumed_ddp = make_ddp(build_model(seed=rank))
    local_gradients(resumed_ddp)
    resumed = _diloco(resumed_ddp, name)
    resumed.load_state_dict(checkpoint)
    again = _train(resumed_ddp, resumed, rank, STEPS - CHECKPOINT_AFTER, start=CHECKPOINT_AFTER)
    return {"params": first + rest, "again": again, "stats": opt.stats(), "resumed_stats": resumed.stats(),
            "numel": opt.flat.numel, "seen": seen, "residual": opt.exchange.feedback.residual("fragment0")}


def _same(a, b):
    """Bit-identical, NaN where NaN (rank 1 between the poisoned step and the skipped outer step)."""
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())


def _check_error_feedback(r):
    """What this rank owed over the applied exchanges = what its payloads decode to + the final
    residual; the skipped exchange leaves the residual as it was."""
    seen = r["seen"]
    assert [s["finite"] for s in seen] == [True, True, False, True]
    assert torch.equal(seen[3]["before"], seen[2]["before"])
    applied = [s for s in seen if s["finite"]]
    owed, sent = sum(s["owed"] for s in applied), sum(s["sent"] for s in applied)
    assert not torch.equal(sent, owed)  # the method really dropped something
    # fp32 sums of a few terms of size ~1e-2: their rounding stays far below 1e-6
    torch.testing.assert_close(sent + r["residual"], owed, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_replicas_meet_at_outer_steps_resume_exactly_and_skip_non_finite_pseudo_gradients(name):
    world_size, options, (skip_step, skip_fragment, last_sync) = CONFIGS[name]
    fragments = options.get("fragments", 1)
    results = run_ranks(_diloco_worker, world_size, name)
    bounds = fragment_bounds(results[0]["numel"], fragments)
    for r in results[1:]:  # a fragment is identical after its outer steps, apart after other steps
        for t, (mine, theirs) in enumerate(zip(results[0]["params"], r["params"])):
            for f, (start, end) in enumerate(bounds):
                assert _same(mine[start:end], theirs[start:end]) == (f in fragments_due(t, H, fragments)), (t, f)
    start, end = bounds[skip_fragment]
    for r in results:
        for uninterrupted, resumed in zip(r["params"][CHECKPOINT_AFTER:], r["again"]):
            assert _same(uninterrupted, resumed)
        counted = ("steps", "raw_bytes", "wire_bytes", "skipped_steps", "outer_steps")
        assert {k: r["stats"][k] for k in counted} == {k: r["resumed_stats"][k] for k in counted}
        # the outer step the NaN reached was skipped: every rank back at that fragment's anchor
        exchanges = sum(len(fragments_due(t, H, fragments)) for t in range(STEPS))
        assert r["stats"]["skipped_steps"] == 1 and r["stats"]["outer_steps"] == exchanges - 1
        assert torch.equal(r["params"][skip_step][start:end], r["params"][last_sync][start:end])
        assert torch.isfinite(r["params"][-1]).all() and not torch.equal(r["params"][-1], r["params"][skip_step])
        assert r["stats"]["raw_bytes"] == STEPS * 4 * r["numel"]
        predicted = run_wire_bytes("diloco", r["numel"], world_size, STEPS, sync_every=H, fragments=fragments,
                                   method=options["method"], method_options=options.get("method_options"),
                                   scheme=options.get("scheme", ""))
        assert r["stats"]["wire_bytes"] == predicted
        if r["seen"] is not None:  # one fragment, all-gathered: this rank's payload is its own
            _check_error_feedback(r)


# ---- H = 1 with SGD inner steps is synchronous data-parallel SGD ------------------------------

INNER_LR, SYNC_STEPS = 0.1, 6
# (outer lr, outer momentum): 1, 0 is plain averaging; 0.7, 0.9 is Nesterov SGD at lr 0.07
OUTER_SETTINGS = ((1.0, 0.0), (0.7, 0.9))


def _ddp_sgd_worker(rank, world_size):
    """Per outer setting: this rank's parameters after each step of DiLoCo (SGD inner, H = 1,
    fp32) and of plain DDP with torch's SGD (lr inner lr x outer lr, the outer momentum,
    Nesterov), both from rank 0's initial parameters, on this rank's own batches."""
    results = []
    for outer_lr, outer_momentum in OUTER_SETTINGS:
        trajectories = []
        for diloco in (True, False):
            ddp = make_ddp(build_model(seed=rank))  # DDP broadcasts rank 0's parameters
            params = [p for p in ddp.module.parameters() if p.requires_grad]
            if diloco:
                local_gradients(ddp)
                opt = DiLoCo(params, ddp, torch.optim.SGD, dict(lr=INNER_LR), sync_every=1, method=None,
                             outer_lr=outer_lr, outer_momentum=outer_momentum)
            else:
                opt = torch.optim.SGD(params, lr=INNER_LR * outer_lr, momentum=outer_momentum,
                                      nesterov=outer_momentum > 0)
            after = []
            for step in range(SYNC_STEPS):
                opt.zero_grad(set_to_none=True)
                x, y = batch(step, rank)
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
                after.append(torch.cat([p.detach().flatten() for p in params]))
            trajectories.append(after)
        results.append(trajectories)
    return results


@pytest.mark.slow
def test_one_inner_sgd_step_per_outer_step_is_data_parallel_sgd():
    """H = 1, SGD inner, fp32 pseudo-gradients: the mean pseudo-gradient is the inner lr times
    the mean gradient, so DiLoCo is DDP + SGD (outer lr 1, momentum 0: plain SGD; otherwise
    Nesterov SGD at lr inner x outer, its momentum buffer scaled by the inner lr)."""
    world_size = 3
    results = run_ranks(_ddp_sgd_worker, world_size)
    for (outer_lr, outer_momentum), setting in zip(OUTER_SETTINGS, zip(*results)):
        for rank, (diloco, ddp_sgd) in enumerate(setting):
            for step, (mine, reference) in enumerate(zip(diloco, ddp_sgd)):
                # the same sum in another order: DiLoCo rounds anchor - (anchor - lr g) and the
                # mean of those, DDP the mean gradient then lr x it; parameters are O(1), so the
                # difference stays within a few fp32 ulps per step
                torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"outer {outer_lr}/{outer_momentum}, rank {rank}, "
                                                         f"step {step}: {m}")
            # the replicas meet after every step (each rank's batches are its own: unaveraged
            # replicas would part after the first step)
            assert all(torch.equal(a, b) for a, b in zip(diloco, setting[0][0]))


def test_a_refused_checkpoint_leaves_the_optimizer_as_it_was():
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 2)
    opt = DiLoCo(net.parameters(), net, sync_every=2, method=None)

    def step():
        opt.zero_grad()
        net(torch.randn(4, 6)).square().mean().backward()
        opt.step()

    step()
    good = opt.state_dict()  # after step 1; the optimizer then moves on (an outer step)
    step()
    before = copy.deepcopy(opt.state_dict()["gradcomp"])
    parameters = [p.detach().clone() for p in net.parameters()]
    assert before["counters"] != good["gradcomp"]["counters"]

    def changed(part, value):
        return {**good, "gradcomp": {**good["gradcomp"], part: value}}

    other_inner = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]).state_dict()
    refused = [
        ({**good, "gradcomp": {k: v for k, v in good["gradcomp"].items() if k != "inner"}}, "missing"),
        (changed("local_parameters", torch.zeros(5)), "parameters"),
        (changed("inner", other_inner), "param groups"),
    ]
    for state, message in refused:
        with pytest.raises(ValueError, match=message):
            opt.load_state_dict(state)
        assert opt.counters == before["counters"]
        assert all(torch.equal(opt.buffers[k], v) for k, v in before["buffers"].items())
        assert all(torch.equal(p, q) for p, q in zip(net.parameters(), parameters))
    opt.load_state_dict(good)  # and a good one still loads
