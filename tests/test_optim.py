"""gradcomp.optim: exchange-owning optimizers (ZeroOneAdam, DGC) and LoCo's moving-average EF."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from ddp_models import batch, build_model, flat_params, make_ddp
from dist_utils import run_ranks

import gradcomp
from gradcomp.analysis.optim import run_wire_bytes
from gradcomp.optim import (DGC, DDPStillReducesError, ZeroOneAdam, exchange_schedule, local_gradients,
                            moving_average_compress)

# ---- options ---------------------------------------------------------------------------------


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("make, message", [
    (lambda: ZeroOneAdam(_params(), torch.nn.Linear(1, 1), lr=-1), "lr"),
    (lambda: ZeroOneAdam(_params(), torch.nn.Linear(1, 1), betas=(0.9, 1.0)), r"betas\[1\]"),
    (lambda: ZeroOneAdam(_params(), torch.nn.Linear(1, 1), eps=0), "eps"),
    (lambda: ZeroOneAdam(_params(), torch.nn.Linear(1, 1), warmup_steps=1.5), "warmup_steps"),
    (lambda: ZeroOneAdam(_params(), torch.nn.Linear(1, 1), sync_every=0), "sync_every"),
    (lambda: ZeroOneAdam(_params(), torch.nn.Linear(1, 1), method="topk", scheme="twophase"), "schemes"),
    (lambda: ZeroOneAdam(_params(), torch.nn.Linear(1, 1), method_options={"chunk": 7}), "chunk"),
    (lambda: ZeroOneAdam(_params(), torch.nn.Linear(1, 1), warmup_method="nope"), "nope"),
    (lambda: ZeroOneAdam(_params(), torch.nn.Linear(1, 1), warmup_scheme="twophase"), "warmup_scheme"),
    (lambda: ZeroOneAdam([{"params": _params(), "betas": (0.5, 0.5)}], torch.nn.Linear(1, 1)), "per param group"),
    (lambda: ZeroOneAdam(_params(), "model"), "model must be"),
    (lambda: ZeroOneAdam(_params(), torch.nn.Linear(1, 1), local_updates="mine"), "local_updates"),
    (lambda: ZeroOneAdam(_params(), torch.nn.Linear(1, 1), sync_growth=-1), "sync_growth"),
    (lambda: DGC(_params(), torch.nn.Linear(1, 1), density=0), "density"),
    (lambda: DGC(_params(), torch.nn.Linear(1, 1), momentum=1.0), "momentum"),
    (lambda: DGC(_params(), torch.nn.Linear(1, 1), clip_norm=0), "clip_norm"),
    (lambda: DGC(_params(), torch.nn.Linear(1, 1), selector="fast"), "selector"),
])
def test_bad_options_raise_value_errors_naming_them(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_dgc_density_warms_up_geometrically():
    opt = DGC(_params(), torch.nn.Linear(1, 1), density=0.001, initial_density=0.1, warmup_steps=2)
    assert [opt.density_at(t) for t in range(4)] == pytest.approx([0.1, 0.01, 0.001, 0.001])


def _phases(opt, steps):
    """The phase ZeroOneAdam ran at each of ``steps`` one-process steps (read off its counters)."""
    params, seen = opt.param_groups[0]["params"], []
    for _ in range(steps):
        params[0].grad = torch.ones(3)
        before = dict(opt.counters)
        opt.step()
        seen.append(next(p for p in ("full", "compressed", "local") if opt.counters[f"{p}_steps"] > before[f"{p}_steps"]))
    return seen


def test_zeroone_phases_refresh_at_exponentially_spaced_steps_as_the_schedule_says():
    opt = ZeroOneAdam(_params(), torch.nn.Linear(1, 1), warmup_steps=3, var_refresh_interval=2,
                      var_freeze_step=14, sync_every=2)
    seen = _phases(opt, 20)
    schedule = exchange_schedule(20, 3, 2, 14, 2)
    assert seen == schedule
    assert [t for t, phase in enumerate(schedule) if phase == "full"] == [0, 1, 2, 5, 9]  # 17: frozen
    assert schedule[3:5] == ["local", "compressed"] and schedule[6:8] == ["local", "compressed"]


@pytest.mark.parametrize("local_updates", ["shared", "own"])
def test_zeroone_sync_interval_doubles_every_growth_steps_up_to_sync_every(local_updates):
    opt = ZeroOneAdam(_params(), torch.nn.Linear(1, 1), warmup_steps=2, sync_every=4, sync_growth=3,
                      local_updates=local_updates)
    seen = _phases(opt, 24)
    assert seen == exchange_schedule(24, 2, sync_every=4, sync_growth=3)
    synced = [t for t, phase in enumerate(seen) if phase == "compressed"]
    # interval 1 at steps 2-4, 2 at 5-7 (one local step, then an exchange), then 4 (the cap)
    assert synced == [2, 3, 4, 6, 10, 14, 18, 22]


# ---- LoCo ------------------------------------------------------------------------------------

def test_moving_average_feedback_keeps_a_moving_average_of_the_errors():
    torch.manual_seed(0)
    method = gradcomp.get_method("int4")
    residual, state, reference = torch.zeros(1000), {}, torch.zeros(1000)
    for _ in range(3):
        g = torch.randn(1000)
        h = g + reference
        payload = moving_average_compress(method, g, residual, state, beta=0.8)
        error = h - gradcomp.decompress(payload)
        reference = 0.8 * reference + 0.2 * error
        torch.testing.assert_close(residual, reference, rtol=0, atol=1e-6)
        assert payload.nbytes == method.wire_bytes(1000)
    assert state["loco_step"] == 3


def test_moving_average_feedback_beta_zero_is_plain_error_feedback_and_resets():
    g = torch.randn(512)
    plain, ours = torch.zeros(512), torch.zeros(512)
    gradcomp.get_method("int8").compress(g, plain)
    moving_average_compress("int8", g, ours, {}, beta=0.0)
    torch.testing.assert_close(ours, plain, rtol=0, atol=0)
    state = {"loco_step": 4}
    moving_average_compress("int8", torch.zeros(512), ours, state, beta=0.5, reset_every=4)
    assert float(ours.abs().max()) == 0.0  # zeroed at step 4, then nothing to remember


def test_moving_average_feedback_never_remembers_non_finite_values():
    g = torch.randn(512)
    g[3] = math.nan
    residual = torch.full((512,), 0.1)
    payload = moving_average_compress("int8", g, residual, {}, beta=0.8)
    assert not torch.isfinite(gradcomp.decompress(payload)[:256]).any()  # the NaN's block is sent
    assert torch.isfinite(residual).all()


@pytest.mark.parametrize("beta, reset", [(1.0, 5), (0.5, 0), (-0.1, None)])
def test_moving_average_feedback_rejects_bad_options(beta, reset):
    with pytest.raises(ValueError):
        moving_average_compress("int8", torch.zeros(8), torch.zeros(8), {}, beta=beta, reset_every=reset)


# ---- on Gloo ranks ---------------------------------------------------------------------------

CONFIGS = {  # name: (class, options); the poisoned step of each is one that exchanges
    "zeroone": (ZeroOneAdam, dict(lr=1e-2, weight_decay=0.1, warmup_steps=2, var_refresh_interval=2,
                                  sync_every=2, method_options={"chunk": 64})),
    "zeroone-own": (ZeroOneAdam, dict(lr=1e-2, weight_decay=0.1, warmup_steps=1, var_refresh_interval=2,
                                      sync_every=2, method_options={"chunk": 64}, local_updates="own")),
    "zeroone-allgather-int8": (ZeroOneAdam, dict(lr=1e-2, warmup_steps=1, warmup_method="int8",
                                                 warmup_scheme="twophase", scheme="allgather")),
    "dgc": (DGC, dict(lr=0.1, weight_decay=5e-4, density=0.05, warmup_steps=3, initial_density=0.5,
                      clip_norm=1.0)),
}

# zeroone: full steps 0, 1 (warm-up), 4 (refresh); 5 local, 6 compressed
# zeroone-own: full 0, 3 (refresh), 7; compressed 2, 5; local 1, 4, 6 (the checkpoint after step 3
# is taken with the replicas apart)
POISON_STEP = {"zeroone": 6, "zeroone-own": 5, "zeroone-allgather-int8": 5, "dgc": 5}


def _optimizer(name, model, ddp):
    cls, options = CONFIGS[name]
    return cls([p for p in model.parameters() if p.requires_grad], ddp, **options)


def _train(ddp, opt, rank, steps, start=0, poison_step=None, diverged=None):
    """Steps of cross-entropy; replicas' parameters after each step (this rank's copies);
    ``diverged`` collects whether the replicas may differ after each step (ZeroOneAdam's own
    local updates)."""
    after = []
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        x, y = batch(step, rank)
        F.cross_entropy(ddp(x), y).backward()
        if step == poison_step and rank == 1:
            next(p for p in ddp.module.parameters() if p.grad is not None).grad[0] = math.nan
        opt.step()
        after.append(flat_params(ddp.module))
        if diverged is not None:
            diverged.append(bool(opt.counters.get("diverged", 0)))
    return after


def _optimizer_worker(rank, world_size, name):
    ddp = make_ddp(build_model(seed=rank))  # DDP broadcasts rank 0's parameters
    with pytest.raises(DDPStillReducesError, match="local_gradients"):
        _optimizer(name, ddp.module, ddp)
    local_gradients(ddp)
    opt = _optimizer(name, ddp.module, ddp)
    diverged = []
    first = _train(ddp, opt, rank, 4, diverged=diverged)
    checkpoint = opt.state_dict()
    params = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    poison = POISON_STEP[name]
    rest = _train(ddp, opt, rank, 4, start=4, poison_step=poison, diverged=diverged)
    stats = opt.stats()
    # resume into a fresh optimizer and model: the same 4 steps bit for bit
    resumed_ddp = make_ddp(build_model(seed=rank))
    resumed_ddp.module.load_state_dict(params)
    local_gradients(resumed_ddp)
    resumed = _optimizer(name, resumed_ddp.module, resumed_ddp)
    resumed.load_state_dict(checkpoint)
    again = _train(resumed_ddp, resumed, rank, 4, start=4, poison_step=poison)
    return {"poison": poison, "params": first + rest, "diverged": diverged, "again": again, "stats": stats, "resumed_stats": resumed.stats(),
            "counters": dict(opt.counters), "numel": opt.flat.numel}


@pytest.mark.slow
@pytest.mark.parametrize("name, world_size", [("zeroone", 3), ("zeroone-own", 3), ("zeroone-allgather-int8", 2),
                                              ("dgc", 2)])
def test_replicas_identical_resume_exact_and_non_finite_steps_skipped(name, world_size):
    results = run_ranks(_optimizer_worker, world_size, name)
    diverged = results[0]["diverged"]
    # bit-identical replicas after every step (own local updates: after every exchange; the
    # local steps in between move each rank with its own momentum, so they really differ there)
    assert diverged == ([False, True, False, True, True, True, False, True] if name == "zeroone-own"
                        else [False] * 8)
    for r in results[1:]:
        assert r["diverged"] == diverged
        for mine, theirs, apart in zip(results[0]["params"], r["params"], diverged):
            assert torch.equal(mine, theirs) != apart
    for r in results:
        for uninterrupted, resumed in zip(r["params"][4:], r["again"]):
            assert torch.equal(uninterrupted, resumed)
        counted = ("steps", "raw_bytes", "wire_bytes", "skipped_steps")  # times differ, of course
        assert {k: r["stats"][k] for k in counted} == {k: r["resumed_stats"][k] for k in counted}
        assert r["stats"]["skipped_steps"] == 1 and r["counters"]["step"] == 7
        poison = r["poison"]
        assert torch.equal(r["params"][poison - 1], r["params"][poison])  # the poisoned step moved nothing
        assert torch.isfinite(r["params"][-1]).all() and not torch.equal(r["params"][-1], r["params"][poison])
        assert r["stats"]["raw_bytes"] == 8 * 4 * r["numel"]


def _wire_worker(rank, world_size, local_updates):
    ddp = make_ddp(build_model())
    local_gradients(ddp)
    n = sum(p.numel() for p in ddp.module.parameters() if p.requires_grad)
    chunk = 64
    opt = ZeroOneAdam([p for p in ddp.module.parameters() if p.requires_grad], ddp, warmup_steps=1,
                      sync_every=2, method_options={"chunk": chunk}, local_updates=local_updates)
    _train(ddp, opt, rank, 5)  # 1 full step, then compressed, local, compressed, local
    sign = gradcomp.get_method("sign", chunk=chunk)
    padded = -(-n // (world_size * chunk)) * world_size * chunk
    # each compressed step: the p chunk payloads (all-to-all), then one summed chunk (all-gather)
    expected = 4 * n + 2 * (world_size + 1) * sign.wire_bytes(padded // world_size)
    predicted = run_wire_bytes("zeroone", n, world_size, 5, warmup_steps=1, sync_every=2,
                               method_options={"chunk": chunk}, local_updates=local_updates)
    return opt.stats()["wire_bytes"], expected, predicted


@pytest.mark.slow
@pytest.mark.parametrize("local_updates", ["shared", "own"])
def test_wire_bytes_are_counted_as_the_hooks_count_them(local_updates):
    for wire, expected, predicted in run_ranks(_wire_worker, 2, local_updates):
        assert wire == expected == predicted
