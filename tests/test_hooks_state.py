"""Hook states without processes: validation, residual remapping, checkpoints, pickling."""
from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcomp

from ddp_models import FakeBucket
from gradcomp.comm import Deferred
from gradcomp import ErrorFeedback
from gradcomp.hooks import (AllreduceState, HookState, Int8State, SignState,
                            TopKState, int8_hook, register, topk_hook)
from gradcomp.consistency import describe_differences


@st.composite
def _two_partitions(draw):
    """Parameter sizes, and two ways of cutting their (shuffled) order into buckets."""
    sizes = draw(st.lists(st.integers(1, 9), min_size=1, max_size=8))
    keys = [f"p{i}" for i in range(len(sizes))]

    def partition():
        order = draw(st.permutations(list(zip(keys, sizes))))
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(order) - 1)), max_size=len(order) - 1)))
        bounds = [0, *[c for c in cuts if c < len(order)], len(order)]
        return [tuple(order[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]

    return partition(), partition(), draw(st.integers(0, 3))


@settings(max_examples=60, deadline=None)
@given(_two_partitions())
def test_residuals_follow_parameters_across_a_bucket_rebuild(case):
    before, after, padding = case
    memory = ErrorFeedback()
    owed = {}
    for index, layout in enumerate(before):
        residual, _ = memory.get(f"bucket{index}", sum(s for _, s in layout) + padding, layout)
        residual[:sum(s for _, s in layout)].normal_()
        offset = 0
        for key, size in layout:
            owed[key] = residual[offset:offset + size].clone()
            offset += size
    for index, layout in enumerate(after):
        residual, _ = memory.get(f"bucket{index}", sum(s for _, s in layout) + padding, layout)
        offset = 0
        for key, size in layout:
            assert torch.equal(residual[offset:offset + size], owed.pop(key)), key
            offset += size
        assert not residual[offset:].any(), "padding must start at zero"
    assert not owed


def test_same_layout_returns_the_same_residual_and_state():
    memory = ErrorFeedback()
    residual, state = memory.get("bucket0", 5, (("w", 5),))
    residual.fill_(3.0)
    state["step"] = 7
    again, again_state = memory.get("bucket0", 5, (("w", 5),))
    assert again is residual and again_state["step"] == 7


def test_state_dict_round_trip_and_checks():
    state = Int8State(scheme="twophase", block=64)
    residual, method_state = state.residuals.get("bucket0", 4, (("fc.weight", 4),))
    residual.copy_(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    method_state["step"] = 3
    state.residuals.get("bucket1", 2, (("#123", 2),))
    state.residuals._split("bucket1")  # an unbound piece: meaningless in another process
    state.step = 5
    state.stats.add(raw_bytes=100.0, wire_bytes=25.0)
    saved = pickle.loads(pickle.dumps(state.state_dict()))
    restored = Int8State(scheme="twophase", block=64)
    held_stats, held_residuals = restored.stats, restored.residuals  # what a training loop keeps
    restored.load_state_dict(saved)
    assert restored.step == 5 and restored.stats()["ratio"] == 4.0
    assert restored.stats is held_stats and restored.residuals is held_residuals
    assert torch.equal(restored.residuals.residual("bucket0"), residual)
    assert restored.residuals.get("bucket0", 4, (("fc.weight", 4),))[1]["step"] == 3
    assert restored.residuals.state_dict()["pieces"] == {}
    assert restored.residuals.residual("bucket0") is not residual
    with pytest.raises(ValueError, match="options"):
        Int8State(scheme="allgather", block=64).load_state_dict(saved)
    with pytest.raises(ValueError, match="Int8State checkpoint cannot be loaded into a SignState"):
        SignState().load_state_dict(saved)
    with pytest.raises(ValueError, match="missing"):
        restored.load_state_dict({"options": {}})


def test_pickling_drops_the_process_group_and_pending_work():
    state = TopKState(process_group=lambda: None, ratio=0.1)  # a lambda cannot be pickled
    state.deferred.then(torch.futures.Future(), lambda value: value)
    copy = pickle.loads(pickle.dumps(state))
    assert copy.process_group is None and len(copy.deferred) == 0
    assert copy.options == state.options


@pytest.mark.parametrize("make, message", [
    (lambda: Int8State(scheme="ring"), "scheme must be one of"),
    (lambda: TopKState(ratio=0), "ratio must be in"),
    (lambda: Int8State(blocks=3), r"unknown option\(s\) \['blocks'\]"),
    (lambda: SignState(error_feedback="yes"), "error_feedback must be True or False"),
])
def test_bad_options_raise_value_errors_naming_them(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_hooks_reject_states_of_the_wrong_type():
    bucket = FakeBucket(torch.zeros(4))
    with pytest.raises(TypeError, match="int8_hook: state must be a Int8State, got NoneType"):
        int8_hook(None, bucket)
    with pytest.raises(TypeError, match="topk_hook: state must be a TopKState, got Int8State"):
        topk_hook(Int8State(), bucket)


def test_register_rejects_unknown_methods_and_plain_modules():
    with pytest.raises(ValueError, match="unknown hook method 'int3'"):
        register(torch.nn.Linear(2, 2), "int3")
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register(torch.nn.Linear(2, 2), "int8")


def test_config_differences_are_named_per_rank():
    text = describe_differences([{"hook": "int8_hook", "block": 256},
                                  {"hook": "int8_hook", "block": 256},
                                  {"hook": "sign_hook", "chunk": 1024}])
    assert "hook: rank 0 has 'int8_hook', rank 2 has 'sign_hook'" in text
    assert "block: rank 0 has 256, rank 2 has '<unset>'" in text
    assert "rank 1" not in text


def test_deferred_launches_in_order_at_flush_and_forwards_errors():
    launched = []
    first, second = torch.futures.Future(), torch.futures.Future()
    deferred = Deferred()

    def launch(tag):
        def run(value):
            launched.append((tag, value))
            if tag == "bad":
                raise RuntimeError("launch failed")
            done = torch.futures.Future()
            done.set_result(value * 10)
            return done
        return run

    a = deferred.then(first, launch("a"))
    b = deferred.then(second, launch("bad"))
    first.set_result(1)
    second.set_result(2)
    assert launched == [] and not a.done()
    deferred.flush()
    assert launched == [("a", 1), ("bad", 2)] and len(deferred) == 0
    assert a.wait() == 10
    with pytest.raises(RuntimeError, match="launch failed"):
        b.wait()


def test_allreduce_state_takes_no_options_and_base_state_keeps_any():
    assert AllreduceState().options == {}
    assert HookState(note="x").options == {"note": "x"}
    with pytest.raises(TypeError):
        AllreduceState(ratio=0.1)


def test_stats_intervals_and_pickling():
    from gradcomp.hooks import HookStats

    stats = HookStats()
    start = stats.mark("cpu")
    assert isinstance(start, float)
    stats.add_interval("compress_s", start, start + 0.25)
    with stats.timed("decompress_s", "cpu"):
        pass
    restored = pickle.loads(pickle.dumps(stats))
    assert restored.summary()["compress_s"] == 0.25 and restored.summary()["decompress_s"] >= 0
    restored.add(comm_s=1.0)  # a restored object has its own lock
    with pytest.raises(ValueError, match="unknown statistics"):
        stats.add_interval("bogus_s", start)


def test_register_knows_auto_and_every_registered_method():
    from gradcomp.hooks import AutoState, auto_hook, hook_for

    assert hook_for("auto") == (auto_hook, AutoState)
    with pytest.raises(ValueError, match="choose auto or one of none, fp16"):
        hook_for("int3")


LOCO_INT4_DRIFT = 0.05
"""Largest parameter difference from plain DDP after 4 SGD steps (lr 0.1) of int4 + LoCo."""


def test_loco_option_keeps_a_moving_average_of_the_errors():
    from gradcomp.feedback import moving_average_compress

    state = Int8State(loco_beta=0.8, loco_reset_every=4)
    assert state.options["loco_beta"] == 0.8 and "loco_beta" not in Int8State().options
    method = gradcomp.get_method("int8")
    reference, reference_state = torch.zeros(1000), {}
    for step in range(6):
        g = torch.randn(1000, generator=torch.Generator().manual_seed(step))
        payload = state.compress("bucket0", g, method, True, (("w", 1000),))
        expected = moving_average_compress(method, g, reference, reference_state, 0.8, 4)
        assert all(torch.equal(payload.parts[k], v) for k, v in expected.parts.items())
        assert torch.equal(state.residuals.residual("bucket0"), reference)
    with pytest.raises(ValueError, match="loco_beta is a kind of error feedback"):
        Int8State(loco_beta=0.8, error_feedback=False)
    with pytest.raises(ValueError, match="beta must lie in"):
        Int8State(loco_beta=1.5)


def _train_loco(rank, world):
    from ddp_models import build_model, flat_params, make_ddp, train_steps

    out = {}
    for method, options in (("none", {}), ("int4", {"loco_beta": 0.8, "scheme": "twophase"})):
        ddp = make_ddp(build_model())
        state = register(ddp, method, **options)
        train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), 4, rank)
        out[method] = (flat_params(ddp.module), state.stats()["ratio"])
    return out


def test_loco_int4_hook_trains_with_identical_replicas():
    from dist_utils import run_ranks

    zero, one = run_ranks(_train_loco, 2)
    (params, ratio), (plain, _) = zero["int4"], zero["none"]
    assert torch.equal(params, one["int4"][0]) and ratio > 3
    assert (params - plain).abs().max() < LOCO_INT4_DRIFT, (params - plain).abs().max()


# ---- a refused load leaves the state as it was ---------------------------------------------------

def _filled_states(process_group=None) -> dict:
    """One state of each class with its own load (flat, PowerSGD, hierarchical, auto), each with
    a residual, a step and statistics to lose."""
    from gradcomp.hooks import AutoState, HierarchicalState, PowerSGDState

    states = {"int8": Int8State(process_group), "powersgd": PowerSGDState(process_group, matrix_rank=2),
              "hierarchical": HierarchicalState(process_group, method="int8", node_size=1),
              "auto": AutoState(process_group)}
    for state in states.values():
        state.residuals.get("bucket0", 4, (("w", 4),))[0].fill_(1.5)
        state.step = 3
        state.stats.add(raw_bytes=64.0, wire_bytes=16.0)
    return states


def _same(a, b) -> bool:
    """Equal nested state dicts (tensors equal element for element)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _refusals_leave_states_as_they_were(checkpoints) -> dict:
    """For each state of :func:`_filled_states` and each (label, change to its own checkpoint):
    the load's error, and whether every attribute is still the same object and the state dict
    the same values."""
    import torch.distributed as dist

    states = _filled_states(dist.group.WORLD if dist.is_initialized() else None)
    out = {}
    for kind, state in states.items():
        saved = state.state_dict()
        for label, change in checkpoints.items():
            attributes = dict(vars(state))
            try:
                state.load_state_dict(change(kind, saved))
                error = None
            except ValueError as exc:
                error = str(exc)
            unchanged = (vars(state).keys() == attributes.keys()
                         and all(vars(state)[k] is v for k, v in attributes.items())
                         and _same(state.state_dict(), saved))
            out[kind, label] = (error, unchanged)
    return out


def _positions(rank, world_size):
    return _refusals_leave_states_as_they_were({
        "other rank": lambda kind, saved: {**saved, "rank": rank + 1},
        "other world size": lambda kind, saved: {**saved, "world_size": world_size + 3}})


@pytest.mark.slow
def test_a_checkpoint_of_another_rank_or_world_size_is_refused_before_anything_changes():
    from dist_utils import run_ranks

    results = run_ranks(_positions, 1)[0]
    for (kind, label), (error, unchanged) in results.items():
        expected = "holds rank 1's error-feedback residuals" if label == "other rank" else \
            "saved with world size 4, this run has 1"
        assert error is not None and expected in error, (kind, label, error)
        assert unchanged, (kind, label)


def test_a_malformed_checkpoint_is_refused_before_anything_changes():
    """Refusals found late in a load (a subclass's part, a malformed entry) change nothing."""
    def broken(kind, saved):
        if kind == "hierarchical":
            return {**saved, "node_size": 2}
        if kind == "auto":
            return {**saved, "auto": {"choices": {0: ["int8", "ring"]}, "flush_from": {}}}
        if kind == "powersgd":
            return {**saved, "warm_start_q": {"entries": {}}}
        return {**saved, "residuals": {"entries": {}}}

    results = _refusals_leave_states_as_they_were({"broken": broken})
    for (kind, _), (error, unchanged) in results.items():
        assert error is not None and unchanged, (kind, error)
    assert "node_size 2 differs" in results["hierarchical", "broken"][0]
    assert "int8 has no scheme 'ring'" in results["auto", "broken"][0]
    assert "missing ['pieces']" in results["powersgd", "broken"][0]
    assert "missing ['pieces']" in results["int8", "broken"][0]
