"""powersgd_hook on real multi-process DDP (Gloo, 2 and 3 ranks), and PowerSGDState's options."""
from __future__ import annotations

import warnings

import hypothesis.strategies as st
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_models import batch, build_model, flat_params, make_ddp, train_steps
from dist_utils import run_ranks
from hypothesis import given, settings

from gradcomp.hooks import ConfigMismatchError, PowerSGDState, powersgd_hook, register
from gradcomp.hooks.powersgd import LowRankMemory, _BucketPlan
from gradcomp.methods.powersgd import PowerSGD, initial_q

SINGLE_BUCKET_MB = 25.0


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


class _AllreduceLog:
    """Records the size of every dist.all_reduce call made while installed."""

    def __init__(self):
        self.sizes = []
        self._original = dist.all_reduce

    def __enter__(self):
        def counting(tensor, *args, **kwargs):
            self.sizes.append(tensor.numel())
            return self._original(tensor, *args, **kwargs)
        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---- against torch's powerSGD_hook (one bucket: torch's hook crashes Gloo with several) -------

def _vs_torch(rank, world, approx_ranks, steps):
    return {approx_rank: _vs_torch_at(rank, approx_rank, steps) for approx_rank in approx_ranks}


def _vs_torch_at(rank, approx_rank, steps):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    start = 2  # torch requires start_powerSGD_iter > 1 with error feedback
    ours = make_ddp(build_model(), SINGLE_BUCKET_MB)
    state = register(ours, "powersgd", matrix_rank=approx_rank, start_iter=start)
    # torch's hook started from our initial Q (its own comes from numpy's RNG): pre-filling its
    # Q memory makes it skip the random draw and orthogonalize ours instead
    theirs = make_ddp(build_model(), SINGLE_BUCKET_MB)
    seeder = PowerSGDState(None, matrix_rank=approx_rank)

    def torch_hook(torch_state, bucket):
        if torch_state.iter == start and bucket.index() not in torch_state.q_memory_dict:
            plan = _BucketPlan(bucket, seeder.bucket_layout(bucket), seeder.method, True)
            torch_state.p_memory_dict[bucket.index()] = torch.empty(plan.fused_numel - plan.uncompressed_numel)
            torch_state.q_memory_dict[bucket.index()] = seeder.lowrank.q(bucket, plan, "cpu", 0).clone()
        return torch_psgd.powerSGD_hook(torch_state, bucket)

    theirs.register_comm_hook(torch_psgd.PowerSGDState(None, matrix_approximation_rank=approx_rank,
                                                       start_powerSGD_iter=start), torch_hook)
    plain = make_ddp(build_model(), SINGLE_BUCKET_MB)
    out = {}
    for name, ddp in (("ours", ours), ("torch", theirs), ("plain", plain)):
        losses = train_steps(ddp, _sgd(ddp), steps, rank)
        out[name] = (flat_params(ddp.module), losses)
    out["buckets"] = len(state.lowrank.plans)
    return out


EXACT_OPTIONS = ({"error_feedback": False, "warm_start": False, "batch_tensors_with_same_shape": False},
                 {"use_error_feedback": False, "orthogonalization_epsilon": 1e-12},  # torch's name
                 {"start_iter": 0})


def _exact_when_low_rank(rank, world):
    """Max parameter difference to plain DDP after 3 steps, per EXACT_OPTIONS, at r = 8: only
    fc1 [32, 64] is compressed, and its gradient over 2 x 4 samples has rank <= 8."""
    plain = make_ddp(build_model())
    train_steps(plain, _sgd(plain), 3, rank)
    out = []
    for options in EXACT_OPTIONS:
        ddp = make_ddp(build_model())
        state = register(ddp, "powersgd", **{"matrix_rank": 8, **options})
        train_steps(ddp, _sgd(ddp), 3, rank)
        keys = [key for plan in state.lowrank.plans.values() for key, _ in plan.residual_layout]
        out.append((keys, float((flat_params(ddp.module) - flat_params(plain.module)).abs().max())))
    return out


def _two_ranks(rank, world, folder, checkpoint_steps):
    """Everything the 2-rank tests check, in one pair of processes (spawning is the slow part)."""
    return {"vs_torch": _vs_torch(rank, world, (1, 4), 6),
            "exact": _exact_when_low_rank(rank, world),
            "safety": _mismatch_then_nonfinite(rank, world),
            "uninterrupted": _checkpoint(rank, world, folder, "first", checkpoint_steps)}


CHECKPOINT_STEPS = 3


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("powersgd_checkpoint"))
    return folder, run_ranks(_two_ranks, 2, folder, CHECKPOINT_STEPS)


def test_matches_torch_powersgd_hook_single_bucket(two_ranks):
    for results in two_ranks[1]:
        for out in results["vs_torch"].values():
            assert out["buckets"] == 1
            ours, theirs, plain = out["ours"][0], out["torch"][0], out["plain"][0]
            # same algorithm from the same initial Q: equal up to float rounding (measured
            # 1.5e-8: sign-fixed QR vs torch's Gram-Schmidt/QR, summation order), and clearly
            # not plain averaging
            assert (ours - theirs).abs().max() < 1e-6
            assert (ours - plain).abs().max() > 1e-3
            assert out["ours"][1] == pytest.approx(out["torch"][1], abs=1e-6)


# ---- several buckets, 3 ranks: replicas, collective count and order, mass, warm-up ----------

def _multi_bucket(rank, world, steps, start):
    ddp = make_ddp(build_model())  # small buckets: several per step
    state = register(ddp, "powersgd", matrix_rank=1, start_iter=start)
    plain = make_ddp(build_model())
    opt, plain_opt = _sgd(ddp), _sgd(plain)
    module = ddp.module
    trained = {name: p for name, p in module.named_parameters() if p.requires_grad}
    out = {"mass_error": 0.0, "replicas_equal": [], "allreduces": [], "expected": [], "sizes": [],
           "residual_norm": 0.0}
    for step in range(steps):
        x, y = batch(step, rank)
        owed_before = state.parameter_residuals()
        local = dict(zip(trained, torch.autograd.grad(F.cross_entropy(module(x), y), list(trained.values()))))
        buckets_before = state.stats.buckets
        opt.zero_grad(set_to_none=True)
        with _AllreduceLog() as log:
            F.cross_entropy(ddp(x), y).backward()
        buckets = state.stats.buckets - buckets_before
        owed_after = state.parameter_residuals()
        # error feedback conserves mass: sum over ranks of (g + e_old - e_new) = world * decoded
        for key, e_new in owed_after.items():
            sent = local[key].reshape(-1) + owed_before.get(key, torch.zeros_like(e_new)) - e_new
            dist.all_reduce(sent)
            out["mass_error"] = max(out["mass_error"],
                                    float((sent / world - trained[key].grad.reshape(-1)).abs().max()))
            out["residual_norm"] = max(out["residual_norm"], float(e_new.norm()))
        compressed = step >= start
        out["allreduces"].append(len(log.sizes))
        out["expected"].append(sum(2 if plan.chunks else 1 for plan in state.lowrank.plans.values())
                               if compressed else buckets)
        out["buckets"] = buckets
        out["sizes"].append(log.sizes)
        opt.step()
        if step == 0:
            train_steps(plain, plain_opt, 1, rank)
            out["warmup_equals_plain"] = torch.equal(flat_params(module), flat_params(plain.module))
        params = _gather(flat_params(module))
        out["replicas_equal"].append(all(torch.equal(params[0], p) for p in params[1:]))
    out["compressed_keys"] = sorted(owed_after)
    out["compressing_buckets"] = sum(1 for plan in state.lowrank.plans.values() if plan.chunks)
    out["stats"] = state.stats()
    return out


def test_multi_bucket_three_ranks():
    steps = 4
    results = run_ranks(_multi_bucket, 3, steps, 1)
    for out in results:
        assert out["buckets"] >= 2 and out["compressing_buckets"] >= 2
        assert out["replicas_equal"] == [True] * steps  # bit-identical after every step
        assert out["warmup_equals_plain"]  # step 0 (start_iter=1) is DDP's plain average
        # one all-reduce per bucket in the warm-up, then two per compressing bucket
        assert out["allreduces"] == out["expected"]
        assert out["allreduces"][1] == out["buckets"] + out["compressing_buckets"]
        assert out["mass_error"] < 1e-5 and out["residual_norm"] > 1e-3
        assert "conv.weight" in out["compressed_keys"]  # 4-D weights compressed, 1-D ones not
        assert not any(key.endswith("bias") for key in out["compressed_keys"])
        assert 0 < out["stats"]["wire_bytes"] < out["stats"]["raw_bytes"]
    # every rank issued the same collectives in the same order
    assert all(out["sizes"] == results[0]["sizes"] for out in results)


# ---- checkpoint N steps, resume in new processes for N more == 2N uninterrupted --------------

def _checkpoint(rank, world, folder, phase, n):
    def fresh():
        ddp = make_ddp(build_model())
        return ddp, register(ddp, "powersgd", matrix_rank=1, start_iter=1), _sgd(ddp)

    path = f"{folder}/rank{rank}.pt"
    if phase == "resume":
        ddp, state, opt = fresh()
        saved = torch.load(path)
        ddp.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["hook"])
        train_steps(ddp, opt, n, rank, start=n)
        return flat_params(ddp.module), state.step
    ddp, state, opt = fresh()
    train_steps(ddp, opt, 2 * n, rank)
    uninterrupted = flat_params(ddp.module)
    ddp, state, opt = fresh()
    train_steps(ddp, opt, n, rank)
    torch.save({"model": ddp.module.state_dict(), "optimizer": opt.state_dict(),
                "hook": state.state_dict()}, path)
    return uninterrupted


def test_exact_when_gradients_have_rank_r_in_every_mode(two_ranks):
    # without error feedback (M is the bucket's own strided view), without warm start,
    # unbatched, Gram-Schmidt with epsilon, compression from step 0: all average exactly
    for results in two_ranks[1]:
        for keys, difference in results["exact"]:
            assert set(keys) == {"fc1.weight"}
            assert difference < 1e-5


def test_checkpoint_resume_in_new_processes_equals_uninterrupted(two_ranks):
    folder, results = two_ranks
    resumed = run_ranks(_checkpoint, 2, folder, "resume", CHECKPOINT_STEPS)
    for full, (params, step) in zip((r["uninterrupted"] for r in results), resumed):
        assert step == 2 * CHECKPOINT_STEPS
        assert torch.equal(params, full)


# ---- safety: ranks configured differently; non-finite gradients ------------------------------

def _mismatch_then_nonfinite(rank, world):
    out = {}
    ddp = make_ddp(build_model())
    ddp.register_comm_hook(PowerSGDState(None, matrix_rank=1 + rank).bind(ddp), powersgd_hook)
    try:
        train_steps(ddp, _sgd(ddp), 1, rank)
    except ConfigMismatchError as exc:
        out["mismatch"] = str(exc)

    ddp = make_ddp(build_model())
    state = register(ddp, "powersgd", matrix_rank=1)
    opt = _sgd(ddp)
    train_steps(ddp, opt, 2, rank)
    x, y = batch(2, rank)
    if rank == 0:
        x[0, 0, 0, 0] = float("inf")
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(ddp(x), y).backward()
    grads = [p.grad for p in ddp.module.parameters() if p.grad is not None]
    out["nonfinite_grads_seen"] = not all(bool(torch.isfinite(g).all()) for g in grads)
    residuals = state.parameter_residuals()
    out["residuals_finite"] = bool(residuals) and all(bool(torch.isfinite(r).all()) for r in residuals.values())
    out["q_finite"] = all(bool(torch.isfinite(state.lowrank.warm_start_q.residual(name)).all())
                          for name in state.lowrank.warm_start_q.names())
    # the optimizer step is skipped (what GradScaler does); training then continues finite
    losses = train_steps(ddp, opt, 2, rank, start=3)
    out["after"] = losses
    out["params_finite"] = bool(torch.isfinite(flat_params(ddp.module)).all())
    return out


def test_config_mismatch_fails_at_first_step_and_nonfinite_is_not_remembered(two_ranks):
    for out in (r["safety"] for r in two_ranks[1]):
        assert "matrix_rank: rank 0 has 1, rank 1 has 2" in out["mismatch"]
        assert out["nonfinite_grads_seen"]  # the optimizer (GradScaler) sees the overflow
        assert out["residuals_finite"] and out["q_finite"]
        assert all(torch.isfinite(torch.tensor(out["after"]))) and out["params_finite"]


# ---- the bucket plan and the options (no processes) -----------------------------------------

class _FakeBucket:
    """buffer() and gradients() views of a flat buffer, like DDP's GradBucket."""

    def __init__(self, shapes):
        numels = [torch.Size(s).numel() for s in shapes]
        self._buffer = torch.zeros(sum(numels))
        offsets = [sum(numels[:i]) for i in range(len(shapes))]
        self._grads = [self._buffer[o:o + k].view(s) for o, k, s in zip(offsets, numels, shapes)]
        self.offsets = offsets

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads

    def index(self):
        return 0


def test_local_error_is_one_power_step_per_matrix():
    """LowRankMemory.local_error_sq (the auto hook's quality sample) is, summed over the bucket's
    matrices, ||M - P P^T M||^2 with P = orth(M Q) and Q the seeded initial Q with unit columns
    (no warm start yet; the 1-D tensor is sent as it is: no error); 0 for matrices of rank <= r;
    and it leaves the Q the hook starts from as it was."""
    shapes = [(16, 40), (16, 40), (24, 24), (8,), (40, 16)]
    method = PowerSGD(rank=3, seed=5)
    layout = tuple((f"p{i}", torch.Size(s).numel()) for i, s in enumerate(shapes))
    bucket, memory = _FakeBucket(shapes), LowRankMemory(method)
    bucket.buffer().copy_(torch.randn(bucket.buffer().numel(), generator=torch.Generator().manual_seed(0)))
    q = memory.q(bucket, memory.plan(bucket, layout), "cpu", 0).clone()
    error = memory.local_error_sq(bucket, layout, 0)
    expected = 0.0
    for g in bucket.gradients():
        if g.dim() == 2:
            start = initial_q(g.shape[1], 3, 5, "cpu").double()
            p, _ = torch.linalg.qr(g.double() @ (start / start.norm(dim=0)))
            expected += float((g.double() - p @ p.T @ g.double()).square().sum())
    assert error.dtype == torch.float64 and error.shape == ()
    assert float(error) == pytest.approx(expected, rel=1e-5) and expected > 1.0
    assert torch.equal(memory.warm_start_q.residual("bucket0"), q)
    gen = torch.Generator().manual_seed(1)
    for g in bucket.gradients():
        g.copy_(torch.randn(g.shape[0], 3, generator=gen) @ torch.randn(3, g[0].numel(), generator=gen)
                if g.dim() == 2 else torch.randn(g.shape, generator=gen))
    low_rank = memory.local_error_sq(bucket, layout, 0)
    assert float(low_rank) < 1e-8 * float(bucket.buffer().double().square().sum())


shape_lists = st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=4).map(tuple),
                       min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(shapes=shape_lists, approx_rank=st.integers(1, 4), batched=st.booleans())
def test_plan_splits_every_gradient_once_and_sends_the_methods_wire_bytes(shapes, approx_rank, batched):
    bucket = _FakeBucket(shapes)
    method = PowerSGD(rank=approx_rank)
    layout = tuple((f"p{i}", torch.Size(s).numel()) for i, s in enumerate(shapes))
    plan = _BucketPlan(bucket, layout, method, batched)
    in_chunks = [i for c in plan.chunks for i in c.tensors]
    uncompressed = [i for i, s in enumerate(shapes) if method.low_rank(s) is None]
    assert sorted(in_chunks + uncompressed) == list(range(len(shapes)))
    assert all(method.low_rank(shapes[i]) == (c.n, c.m, c.r) for c in plan.chunks for i in c.tensors)
    expected_index = [o + k for i in uncompressed for o in [bucket.offsets[i]]
                      for k in range(torch.Size(shapes[i]).numel())]
    assert plan.uncompressed_index.tolist() == expected_index
    # the chunks tile the residual, the P part of the fused buffer and the Q buffer
    for part, begin, end in (("matrices", 0, plan.matrices_numel),
                             ("p", plan.uncompressed_numel, plan.fused_numel), ("q", 0, plan.q_numel)):
        bounds = [begin] + [getattr(c, part).stop for c in plan.chunks]
        assert [getattr(c, part).start for c in plan.chunks] == bounds[:-1]
        assert bounds[-1] == end
    # each chunk is one strided view of the bucket holding exactly its gradients
    for c in plan.chunks:
        view = c.in_bucket(bucket.buffer())
        assert [v.data_ptr() for v in view] == [bucket.gradients()[i].data_ptr() for i in c.tensors]
        assert view.shape == (c.count, c.n, c.m)
    if not batched:
        assert all(c.count == 1 for c in plan.chunks)
    # wire bytes: what the method's rule says, tensor by tensor (fp32, all-reduced as they lie)
    assert 4 * (plan.fused_numel + plan.q_numel) == sum(method.parts_bytes(torch.Size(s).numel(), s)
                                                        for s in shapes)


def test_options_are_validated_and_torch_names_accepted():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's names are not deprecated
        state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=5, random_seed=3)
    assert (state.options["matrix_rank"], state.options["start_iter"], state.options["seed"]) == (2, 5, 3)
    assert state.method.rank == 2 and PowerSGDState(None, matrix_rank=3).method.rank == 3
    assert PowerSGDState(None, use_error_feedback=False).error_feedback is False
    assert PowerSGDState(None, error_feedback=False).options["error_feedback"] is False
    with pytest.raises(ValueError, match="not both"):
        PowerSGDState(None, matrix_rank=2, matrix_approximation_rank=2)
    with pytest.raises(TypeError, match="compression_stats"):
        PowerSGDState(None, compression_stats_logging_frequency=10)
    with pytest.raises(ValueError, match="start_iter"):
        PowerSGDState(None, start_iter=-1)
    with pytest.raises(ValueError, match="rank must be an integer"):
        PowerSGDState(None, matrix_rank=0)
    with pytest.raises(ValueError, match="epsilon"):
        PowerSGDState(None, orthogonalization_epsilon=-1.0)
    with pytest.raises(ValueError, match="min_compression_rate"):
        PowerSGDState(None, min_compression_rate=0.5)
    with pytest.raises(TypeError, match="warm_start"):
        PowerSGDState(None, warm_start=1)
    with pytest.raises(TypeError, match="PowerSGDState"):
        powersgd_hook(object(), None)


def test_rank_keyword_is_deprecated_for_matrix_rank():
    with pytest.warns(DeprecationWarning, match=r"PowerSGDState\(rank=\.\.\.\) is deprecated .* use matrix_rank="):
        state = PowerSGDState(None, rank=2)
    assert state.options["matrix_rank"] == 2 and "rank" not in state.options
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="not both"):
        PowerSGDState(None, matrix_rank=2, rank=2)


def test_register_forwards_the_deprecated_rank_keyword():
    class _Model:  # what register needs of a DDP model
        process_group = None

        def named_parameters(self):
            return []

        def register_comm_hook(self, state, hook):
            self.hook = (state, hook)

    with pytest.warns(DeprecationWarning, match="use matrix_rank="):
        state = register(_Model(), "powersgd", rank=3)
    assert state.options["matrix_rank"] == 3


def test_state_dict_saved_with_the_old_rank_key_loads():
    saved = PowerSGDState(None, matrix_rank=2, start_iter=1).state_dict()
    saved["options"] = {("rank" if key == "matrix_rank" else key): value for key, value in saved["options"].items()}
    state = PowerSGDState(None, matrix_rank=2, start_iter=1)
    state.load_state_dict(saved)
    assert state.options["matrix_rank"] == 2
    with pytest.raises(ValueError, match="options"):
        PowerSGDState(None, matrix_rank=3, start_iter=1).load_state_dict(saved)
