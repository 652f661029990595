"""Hierarchical DDP hook (exact inside a node, compressed between nodes) on 4 Gloo ranks as 2 nodes
x 2: training against plain DDP, replicas bit-identical, bytes per link class, node_size 1 equal
to the flat hook, resume, configuration checks."""
from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import run_ranks
from ddp_models import build_model, flat_params, make_ddp, train_steps

import gradcomp
from gradcomp.hooks.hierarchical import HierarchicalState, shard_size

STEPS = 8
NODE_SIZE = 2
RUNS = {  # label: (method, options, tolerance on the worst relative loss gap to plain DDP)
    "int8": ("int8", {}, 0.01),
    "int8_twophase": ("int8", {"scheme": "twophase"}, 0.01),
    "fp16": ("fp16", {}, 0.005),
    "sign_twophase": ("sign", {"scheme": "twophase"}, 0.5),
}


def _train(rank, method, node_size=NODE_SIZE, steps=STEPS, flat=False, **options):

    model = build_model()
    ddp = make_ddp(model)
    placement = {} if flat else {"hierarchical": True, "node_size": node_size}
    state = gradcomp.hooks.register(ddp, method, **placement, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = train_steps(ddp, optimizer, steps, rank)
    return model, ddp, state, optimizer, losses


def four_ranks(rank, world_size):
    from gradcomp.hooks import hierarchical

    out = {}
    model = build_model()
    out["plain"] = train_steps(make_ddp(model), torch.optim.SGD(model.parameters(), lr=0.1), STEPS, rank)
    for label, (method, options, _) in RUNS.items():
        model, _, state, _, losses = _train(rank, method, **options)
        out[label] = {"losses": losses, "params": flat_params(model), "link": state.link_stats()}

    # bytes of steps 2.. (after DDP's bucket rebuild): link bytes after step 1 vs at the end
    marks = []
    holder = {}

    def mark(step):
        if step == 0:
            marks.append(dict(holder["state"].link_bytes))

    model = build_model()
    ddp = make_ddp(model)
    holder["state"] = gradcomp.hooks.register(ddp, "int8", hierarchical=True, node_size=NODE_SIZE)
    train_steps(ddp, torch.optim.SGD(model.parameters(), lr=0.1), STEPS, rank, on_step=mark)
    out["bytes_after_rebuild"] = {k: holder["state"].link_bytes[k] - marks[0][k] for k in marks[0]}
    # what each rank's residuals hold inside and outside its own shard, after the rebuild
    memory, local = holder["state"].residuals, rank % NODE_SIZE
    held = {"inside": 0.0, "outside": 0.0}
    for name in (n for n in memory.names() if "/" not in n):
        whole = memory.residual(name)
        shard = whole.numel() // NODE_SIZE
        mine = whole[local * shard:(local + 1) * shard]
        outside = torch.cat([whole[:local * shard], whole[(local + 1) * shard:]])
        held["inside"] = max(held["inside"], mine.abs().max().item())
        # the largest |value| outside the shard, read directly: the flush zeroes it, so it is an
        # exact 0.0 (a difference of two sums, whole minus shard, would carry their rounding)
        held["outside"] = max(held["outside"], outside.abs().max().item())
    out["residual_held"] = held
    out["bytes_layouts"] = [sum(n for _, n in layout) for layout in holder["state"].layouts.values()]

    # node_size 1: every rank its own node, the same as the flat int8 all-gather hook
    flat_model = _train(rank, "int8", flat=True)[0]
    one_model = _train(rank, "int8", node_size=1)[0]
    out["node_size_1_equal_flat"] = torch.equal(flat_params(flat_model), flat_params(one_model))

    # resume: 4 steps, checkpoint, 4 more == 8 straight
    model, ddp, state, optimizer, _ = _train(rank, "int8", steps=4)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "hook": state.state_dict()})
    train_steps(ddp, optimizer, 4, rank, start=4)
    straight = flat_params(model)
    model = build_model()
    model.load_state_dict(saved["model"])
    ddp = make_ddp(model)
    restored = HierarchicalState(ddp.process_group, method="int8", node_size=NODE_SIZE).bind(ddp)
    restored.load_state_dict(saved["hook"])
    ddp.register_comm_hook(restored, hierarchical.hierarchical_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.load_state_dict(saved["optimizer"])
    train_steps(ddp, optimizer, 4, rank, start=4)
    out["resume_equal"] = torch.equal(straight, flat_params(model))

    # configuration checks, raised on every rank
    for label, node_size in (("mismatch", 1 if rank == 3 else NODE_SIZE), ("indivisible", 3)):
        try:
            _train(rank, "int8", node_size=node_size, steps=1)
            out[label] = ""
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def four():
    return run_ranks(four_ranks, 4, timeout_s=120)


def worst_relative_gap(curve, reference):
    return max(abs(a - b) / b for a, b in zip(curve, reference))


@pytest.mark.parametrize("label", list(RUNS))
def test_trains_like_plain_ddp_with_replicas_bit_identical(four, label):
    tolerance = RUNS[label][2]
    assert worst_relative_gap(four[0][label]["losses"], four[0]["plain"]) <= tolerance
    for rank in range(1, 4):
        assert torch.equal(four[0][label]["params"], four[rank][label]["params"]), rank


def test_nothing_owed_is_stranded_outside_a_ranks_shard(four):
    """DDP's bucket rebuild after step 1 moves elements between shards: what a rank owed for
    them is flushed to the new owner, so no residual is left where this rank never sends."""
    for rank in range(4):
        held = four[rank]["residual_held"]
        assert held["inside"] > 0 and held["outside"] == 0.0, (rank, held)


def test_link_bytes_per_step_intra_exact_inter_compressed(four):
    """Per bucket of n elements, shard s = ceil(n / 2): intra 4 (2s + s) bytes (reduce-scatter input,
    all-gather input), inter the int8 payload of s elements (s + 4 ceil(s / 256))."""
    int8 = gradcomp.get_method("int8")
    shards = [shard_size(n, NODE_SIZE, 2, "allgather", 1) for n in four[0]["bytes_layouts"]]
    steps = STEPS - 1
    measured = four[0]["bytes_after_rebuild"]
    assert measured["intra"] == steps * sum(4 * 3 * s for s in shards)
    assert measured["inter"] == steps * sum(int8.wire_bytes(s) for s in shards)
    assert measured["inter_raw"] == steps * sum(4 * s for s in shards)
    link = four[0]["int8"]["link"]
    assert 3.5 < link["inter"]["ratio"] < 4.0


def test_node_size_one_is_the_flat_hook_bit_for_bit(four):
    assert all(r["node_size_1_equal_flat"] for r in four)


def test_resume_is_bit_identical(four):
    assert all(r["resume_equal"] for r in four)


def test_configuration_errors_raise_on_every_rank(four):
    for rank in range(4):
        assert "ConfigMismatchError" in four[rank]["mismatch"] and "node_size" in four[rank]["mismatch"]
        assert "not a multiple of node_size 3" in four[rank]["indivisible"]


def test_shard_size_whole_chunks_for_twophase():
    assert shard_size(1000, 2, 2, "allgather", 256) == 500
    assert shard_size(1000, 2, 2, "twophase", 256) == 512  # 2 chunks of one 256-block each
    assert shard_size(1000, 4, 1, "twophase", 256) == 250  # one node: nothing to cut


def test_state_options_validated(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="node_size"):
        HierarchicalState(method="int8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert HierarchicalState(method="int8").node_size == 8
    with pytest.raises(ValueError, match="integer >= 1"):
        HierarchicalState(method="int8", node_size=0)
    with pytest.raises(ValueError, match="PowerSGDState"):
        HierarchicalState(method="powersgd", node_size=2)
    with pytest.raises(ValueError, match="node_size"):
        HierarchicalState(method="int8", node_size=4).load_state_dict(
            HierarchicalState(method="int8", node_size=2).state_dict())


def test_flat_hooks_refuse_a_hierarchical_state():
    from ddp_models import FakeBucket
    from gradcomp.hooks import compressed_hook, int8_hook

    state = HierarchicalState(method="int8", node_size=2)
    for hook, name in ((compressed_hook, "compressed_hook"), (int8_hook, "int8_hook")):
        with pytest.raises(TypeError, match=f"{name}: a HierarchicalState runs with"):
            hook(state, FakeBucket(torch.zeros(4)))
