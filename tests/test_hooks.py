"""gradcomp's DDP hooks under real multi-process DDP on Gloo (2 and 3 ranks).

Each spawned run checks several things, to keep the suite fast: a spawn costs seconds.
"""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddp_models import (FakeBucket, batch, build_model, flat_grads, flat_params, make_ddp, random_buckets_step,
                        train_steps)
from dist_utils import run_ranks
from gradcomp.hooks import HOOKS, register

pytestmark = pytest.mark.slow

# (label, method, options); None is DDP's built-in all-reduce, "torch_fp16" torch's fp16 hook
HOOK_CONFIGS = [
    ("default", None, {}),
    ("torch_fp16", "torch_fp16", {}),
    ("allreduce", "none", {}),  # gradcomp's uncompressed hook
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("int8", "int8", {}),
    ("int8_twophase", "int8", {"scheme": "twophase", "stochastic": True}),
    ("sign", "sign", {}),
    ("sign_twophase", "sign", {"scheme": "twophase", "chunk": 64}),
    ("topk", "topk", {"ratio": 0.05}),
    ("topk_threshold", "topk", {"ratio": 0.3, "selector": "threshold", "sample": 64}),
]
COMPRESSED = [c for c in HOOK_CONFIGS if c[1] not in (None, "torch_fp16")]


def _attach(ddp, method, options):
    if method is None:
        return None
    if method == "torch_fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    return register(ddp, method, **options)


def _record_training(rank, world, steps=3, model_options=None, ddp_options=None, configs=HOOK_CONFIGS):
    """Per config: (grads, params) after every step, and the hook's stats."""
    out = {}
    for label, method, options in configs:
        ddp = make_ddp(build_model(**(model_options or {})), **(ddp_options or {}))
        state = _attach(ddp, method, options)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        records = []
        train_steps(ddp, optimizer, steps, rank,
                    on_step=lambda step: records.append((flat_grads(ddp.module), flat_params(ddp.module))))
        out[label] = {"records": records, "stats": state.stats() if state else None}
    return out


def _check_replicas_identical(results):
    for label in results[0]:
        for step, (_, params) in enumerate(results[0][label]["records"]):
            for rank in range(1, len(results)):
                other = results[rank][label]["records"][step][1]
                assert torch.equal(params, other), f"{label}: rank {rank} differs from rank 0 at step {step}"


def _check_every_hook(results, world):
    _check_replicas_identical([r["hooks"] for r in results])
    ranks0 = results[0]["hooks"]
    default = ranks0["default"]["records"]
    # allreduce_hook gives exactly DDP's built-in gradients, hence parameters
    for (g_ref, p_ref), (g, p) in zip(default, ranks0["allreduce"]["records"]):
        assert torch.equal(g, g_ref) and torch.equal(p, p_ref)
    # fp16_hook matches torch's fp16_compress_hook up to one fp16 rounding: torch casts, then
    # divides in fp16 (two roundings, which differ below fp16's normal range or for p = 3);
    # gradcomp divides in fp32 and casts once
    for (g_ref, _), (g, _) in zip(ranks0["torch_fp16"]["records"], ranks0["fp16"]["records"]):
        assert (g - g_ref).abs().max() <= world * 2**-11 * g_ref.abs().max()
        if world == 2:
            assert (g == g_ref).float().mean() > 0.99
    for label, method, options in COMPRESSED:
        stats = ranks0[label]["stats"]
        assert stats["steps"] == 3 and stats["buckets"] > stats["steps"], f"{label}: not several buckets"
        final = ranks0[label]["records"][-1][1]
        assert torch.isfinite(final).all()
        # every hook moves the parameters roughly like uncompressed training
        moved, reference = final - default[0][1], default[-1][1] - default[0][1]
        assert torch.dot(moved, reference) > 0, label
    assert ranks0["bf16"]["stats"]["ratio"] == pytest.approx(2.0)
    assert ranks0["sign"]["stats"]["ratio"] > 20
    assert ranks0["int8"]["stats"]["ratio"] > 3.5


def _two_rank_suite(rank, world, path):
    """Everything checked on 2 ranks, in one spawn; the silent peer comes last."""
    return {"hooks": _record_training(rank, world), "variants": _variants(rank, world),
            "safety": _safety(rank, world), "full": _train_checkpoint(rank, world, path, "full", 2),
            "first": _train_checkpoint(rank, world, path, "first", 2),
            "silent_peer": _silent_peer(rank, world)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("checkpoints")
    return path, run_ranks(_two_rank_suite, 2, str(path))


def _three_rank_suite(rank, world):
    return {"hooks": _record_training(rank, world), "conservation": _conservation(rank, world)}


@pytest.fixture(scope="module")
def three_ranks():
    return run_ranks(_three_rank_suite, 3)


def test_every_hook_on_two_ranks_several_buckets_identical_replicas(two_ranks):
    _check_every_hook(two_ranks[1], 2)


def test_every_hook_on_three_ranks_several_buckets_identical_replicas(three_ranks):
    _check_every_hook(three_ranks, 3)


def _variants(rank, world):
    """fp16/bf16 params, find_unused_parameters, static_graph, no_sync accumulation."""
    hooks = [("int8", {}), ("sign", {"scheme": "twophase", "chunk": 64}), ("topk", {"ratio": 0.1})]
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        configs = [(f"{m}_{dtype}", m, o) for m, o in hooks + [("bf16", {})]]
        out.update(_record_training(rank, world, 2, {"dtype": dtype}, configs=configs))
    configs = [(f"{m}_unused", m, o) for m, o in hooks]
    out.update(_record_training(rank, world, 2, {"with_unused": True},
                                {"find_unused_parameters": True}, configs))
    configs = [(f"{m}_static", m, o) for m, o in hooks]
    out.update(_record_training(rank, world, 2, None, {"static_graph": True}, configs))
    # accumulation: allreduce_hook with no_sync equals DDP's built-in accumulation exactly
    for label, method in (("accumulate_default", None), ("accumulate_allreduce", "none"),
                          ("accumulate_int8", "int8")):
        ddp = make_ddp(build_model())
        state = _attach(ddp, method, {})
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        records = []
        train_steps(ddp, optimizer, 2, rank, accumulate=3,
                    on_step=lambda step: records.append((flat_grads(ddp.module), flat_params(ddp.module))))
        out[label] = {"records": records, "stats": state.stats() if state else None}
    frozen = build_model().frozen.weight
    out["frozen_unchanged"] = torch.equal(ddp.module.frozen.weight, frozen) and ddp.module.frozen.weight.grad is None
    return out


def test_dtypes_unused_static_graph_accumulation_frozen(two_ranks):
    results = [r["variants"] for r in two_ranks[1]]
    _check_replicas_identical([{k: v for k, v in r.items() if k != "frozen_unchanged"} for r in results])
    ranks0 = results[0]
    assert all(r["frozen_unchanged"] for r in results)
    for label, value in ranks0.items():
        if label == "frozen_unchanged":
            continue
        grads, params = value["records"][-1]
        assert torch.isfinite(params).all() and torch.isfinite(grads).all(), label
    # the unused layer's parameters are never touched
    reference = build_model(with_unused=True)
    unused = flat_params(reference.unused)
    assert torch.equal(ranks0["int8_unused"]["records"][-1][1][-unused.numel():], unused)
    for (g_ref, p_ref), (g, p) in zip(ranks0["accumulate_default"]["records"],
                                      ranks0["accumulate_allreduce"]["records"]):
        assert torch.equal(g, g_ref) and torch.equal(p, p_ref)
    # no_sync steps never call the hook: 2 steps, as many bucket calls as 2 synced steps
    assert ranks0["accumulate_int8"]["stats"]["steps"] == 2


def _safety(rank, world):
    """A non-finite gradient reaches the optimizer and never enters a residual; misconfigured
    ranks fail at the first step with an error naming the difference."""
    out = {"nonfinite": {}}
    for method, options in (("int8", {}), ("int8", {"scheme": "twophase"}), ("sign", {}),
                            ("topk", {"ratio": 0.1}), ("fp16", {"error_feedback": True})):
        ddp = make_ddp(build_model())
        state = register(ddp, method, **options)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        train_steps(ddp, optimizer, 1, rank)
        x, y = batch(5, rank)
        loss = F.cross_entropy(ddp(x), y) * (float("inf") if rank == 0 else 1.0)
        loss.backward()
        grads_finite = bool(torch.isfinite(flat_grads(ddp.module)).all())
        residuals_finite = all(bool(torch.isfinite(state.residuals.residual(n)).all())
                               for n in state.residuals.names())
        optimizer.zero_grad()  # what GradScaler does: skip the step
        train_steps(ddp, optimizer, 1, rank, start=6)
        out["nonfinite"][f"{method}{options}"] = (grads_finite, residuals_finite,
                                                  flat_params(ddp.module))
    errors = []
    for configs in ({"method": "topk", "ratio": 0.01 * (rank + 1)},
                    {"method": "int8" if rank == 0 else "sign"}):
        ddp = make_ddp(build_model())
        register(ddp, **configs)
        x, y = batch(0, rank)
        try:
            F.cross_entropy(ddp(x), y).backward()
        except Exception as exc:  # DDP re-raises hook errors as RuntimeError
            errors.append(str(exc))
        else:
            errors.append(None)
    out["errors"] = errors
    return out


def test_nonfinite_gradients_and_mismatched_configs(two_ranks):
    results = [r["safety"] for r in two_ranks[1]]
    for key, (grads_finite, residuals_finite, params) in results[0]["nonfinite"].items():
        assert not grads_finite, f"{key}: the inf gradient did not reach the optimizer"
        assert residuals_finite, f"{key}: a residual became non-finite"
        assert torch.isfinite(params).all(), f"{key}: training did not recover after skipping"
        assert torch.equal(params, results[1]["nonfinite"][key][2])
    for rank in range(2):
        ratio_error, method_error = results[rank]["errors"]
        assert "configured differently across ranks" in ratio_error
        assert "ratio: rank 0 has 0.01, rank 1 has 0.02" in ratio_error
        assert "method: rank 0 has 'int8', rank 1 has 'sign'" in method_error
        assert "hook: rank 0 has 'int8_hook', rank 1 has 'sign_hook'" in method_error


def _train_checkpoint(rank, world, path, phase, steps):
    """phase "full": 2 * steps uninterrupted; "first": steps then save; "resume": load, steps."""
    out = {}
    for label, method, options in (("int8_twophase", "int8", {"scheme": "twophase", "stochastic": True}),
                                   ("sign", "sign", {"chunk": 64}),
                                   ("topk", "topk", {"ratio": 0.1, "selector": "threshold", "sample": 64})):
        ddp = make_ddp(build_model())
        state = register(ddp, method, **options)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        file = f"{path}/{label}-{rank}.pt"
        if phase == "resume":
            saved = torch.load(file, weights_only=False)
            ddp.module.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            state.load_state_dict(saved["hook"])
            start = steps
        else:
            start = 0
        count = 2 * steps if phase == "full" else steps
        train_steps(ddp, optimizer, count, rank, start=start)
        if phase == "first":
            torch.save({"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "hook": state.state_dict()}, file)
        out[label] = (flat_params(ddp.module), state.stats()["steps"])
    return out


def test_checkpoint_resume_in_new_processes_equals_uninterrupted(two_ranks):
    path, results = two_ranks
    resumed = run_ranks(_train_checkpoint, 2, str(path), "resume", 2)
    for rank in range(2):
        for label, (params, count) in results[rank]["full"].items():
            assert not torch.equal(results[rank]["first"][label][0], params)
            assert torch.equal(resumed[rank][label][0], params), label
            assert resumed[rank][label][1] == count == 4


def _single_rank(rank, world):
    out = {}
    for label, method, options in HOOK_CONFIGS:
        ddp = make_ddp(build_model())
        _attach(ddp, method, options)
        x, y = batch(0, rank)
        F.cross_entropy(ddp(x), y).backward()
        out[label] = flat_grads(ddp.module)
    return out


def test_world_size_one_sends_the_local_gradient_through_the_compressor():
    (grads,) = run_ranks(_single_rank, 1)
    local = grads["default"]
    assert torch.equal(grads["allreduce"], local)
    torch.testing.assert_close(grads["fp16"], local, rtol=1e-3, atol=1e-6)
    for label in ("int8", "int8_twophase"):  # 127 levels per block
        assert (grads[label] - local).abs().max() <= local.abs().max() / 127
    assert torch.equal(grads["sign"] < 0, local < 0)  # scaled signs, zero decodes to +scale
    nonzero = grads["topk_threshold"] != 0  # the top 30% of magnitudes, sent exactly
    assert torch.equal(grads["topk_threshold"][nonzero], local[nonzero]) and nonzero.sum() > 0


def _silent_peer(rank, world):
    """Rank 1 stays alive but never joins rank 0's next collective (on a group with a short
    timeout): rank 0 must get the group's timeout error, not hang."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    ddp = make_ddp(build_model())
    register(ddp, "int8", process_group=group)
    if rank == 1:
        time.sleep(5)
        return None
    start = time.perf_counter()
    x, y = batch(0, rank)
    try:
        F.cross_entropy(ddp(x), y).backward()
    except Exception as exc:
        return ("raised", str(exc), time.perf_counter() - start)
    return ("no error", "", time.perf_counter() - start)


def test_silent_peer_surfaces_as_the_process_group_timeout(two_ranks):
    status, message, seconds = two_ranks[1][0]["silent_peer"]
    assert status == "raised"
    assert "timed out" in message.lower() or "timeout" in message.lower(), message
    assert seconds < 5


def _conservation(rank, world, steps=4):
    """Hooks called directly on two buckets per step: over several steps, what the hook returned
    plus every residual left (workers' and, for two-phase, the chunk owners') equals the sum of
    the true averages."""
    out = {}
    sizes = (600, 401)
    configs = COMPRESSED + [("int8_twophase_no_feedback", "int8", {"scheme": "twophase", "error_feedback": False})]
    for label, method, options in configs:
        hook, state_type = HOOKS[method]
        state = state_type(None, **options)
        if not getattr(state, "error_feedback", False):
            hook(state, FakeBucket(torch.randn(100), 0, True)).wait()
            out[label] = state.residuals.names()
            continue
        params = [[torch.empty(n)] for n in sizes]
        sent = [torch.zeros(n) for n in sizes]
        owed = [torch.zeros(n) for n in sizes]
        for step in range(steps):
            random_buckets_step(hook, state, step, rank, world, sizes, params, sent, owed)
        left = []
        for index, n in enumerate(sizes):
            residual = state.residuals.residual(f"bucket{index}")[:n].clone()
            dist.all_reduce(residual)
            server = f"bucket{index}/server"
            if server in state.residuals.names():
                chunks = [torch.empty_like(state.residuals.residual(server)) for _ in range(world)]
                dist.all_gather(chunks, state.residuals.residual(server))
                residual += torch.cat(chunks)[:n]
            left.append(residual)
        out[label] = (sent, left, owed, state.stats())
    return out


def test_error_feedback_conserves_gradient_mass_on_three_ranks(three_ranks):
    checked, without_feedback = set(), set()
    for rank, result in enumerate(three_ranks):
        for label, value in result["conservation"].items():
            if isinstance(value, list):  # error feedback off: no residual is kept
                assert value == [], label
                without_feedback.add(label)
                continue
            sent, left, owed, stats = value
            checked.add(label)
            assert stats["steps"] == 4 and stats["buckets"] == 8
            for s, l, o in zip(sent, left, owed):
                torch.testing.assert_close(s + l, o, rtol=0, atol=1e-4)
                assert l.abs().max() > 1e-3, f"{label}: nothing was owed, the test proves nothing"
            for s, s0 in zip(sent, three_ranks[0]["conservation"][label][0]):
                assert torch.equal(s, s0), f"{label}: rank {rank} got another average"
    assert {"int8", "int8_twophase", "sign", "sign_twophase", "topk"} <= checked
    assert without_feedback == {"allreduce", "fp16", "bf16", "int8_twophase_no_feedback"}
