"""The cost model's hierarchical (exact inside a node, compressed between nodes) and sharded
(FSDP2: parameter all-gathers + compressed reduce-scatter) cases against hand-computed values,
and `gradcomp breakeven --hierarchical / --sharded`."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from gradcomp.analysis import (Choice, Compute, LinearCost, Link, MethodCost, ModelSpec, Network, Parameter,
                               Profile, Scenario, estimate, make_scenario, simulate)
from gradcomp.analysis.collectives import allgather_total_s, ring_allreduce_s
from gradcomp.analysis.costmodel import default_choices, fsdp_units
from gradcomp.cli import main

LINK = Link("test", 8.0, 10.0)      # 1 ns per byte, 10 us
INTRA = Link("nv", 80.0, 1.0)       # 0.1 ns per byte, 1 us
FREE = MethodCost(LinearCost(0.0, 0.0), LinearCost(0.0, 0.0))
PROFILE = Profile("toy", {"int8": FREE, "fp16": FREE, "powersgd": FREE})
N = 1_048_576                       # one parameter, one bucket: nothing overlaps


def _scenario(world_size=16, gpus_per_node=4, sharded=False, parameters=None, compute=None):
    spec = ModelSpec("toy", tuple(parameters or [Parameter("w", (N,))]))
    network = Network(world_size, LINK, gpus_per_node, INTRA if gpus_per_node > 1 else None)
    return Scenario(spec, network, PROFILE, compute or Compute(0.0, 0.01, 0.0), sharded=sharded)


def test_hierarchical_int8_by_hand():
    # 16 ranks, 4 per node: shard s = N / 4 = 262,144; reduce-scatter + all-gather of 4N bytes in
    # the node: 2 * (3 * 1us + 3/4 * 4N * 0.1ns); the 4 nodes all-gather the int8 payload of s:
    # w = s + 4 s / 256 = 266,240 bytes, 3 * 10us + 3 * w * 1ns
    s = N // 4
    wire = s + 4 * (s // 256)
    inside = 2 * (3e-6 + 0.75 * 4 * N * 1e-10)
    across = 3 * 10e-6 + 3 * wire * 1e-9
    step = simulate(_scenario(), Choice("int8", {}, "allgather", hierarchical=True))
    assert step.step_s == pytest.approx(0.01 + inside + across)
    assert step.wire_bytes == wire
    assert step.exact_bytes == 4 * (4 * s + s)  # what the hook counts: reduce-scatter + all-gather inputs
    # the uncompressed baseline across nodes is the two-level all-reduce, its levels pipelined:
    # both levels' latencies, the slower level's bytes
    none = simulate(_scenario(), Choice("none"))
    ring = ring_allreduce_s(LINK, 4, 4 * N / 4)
    assert none.step_s == pytest.approx(0.01 + 2 * 3e-6 + 60e-6 + max(inside - 2 * 3e-6, ring - 60e-6))


def test_one_node_runs_every_collective_over_the_node_link():
    # 4 ranks in one node of 4: the all-reduce is a ring over the intra link, not the network link
    one_node = Network(4, LINK, 4, INTRA)
    assert one_node.single_node and one_node.nodes == 1
    assert one_node.allreduce_s(4e6) == pytest.approx(ring_allreduce_s(INTRA, 4, 4e6))
    assert one_node.allgather_s(1e6) == pytest.approx(allgather_total_s(INTRA, 4, 4e6))
    # hierarchical on one node: exact reduce-scatter + all-gather, nothing compressed
    step = simulate(_scenario(world_size=4), Choice("int8", hierarchical=True))
    assert step.wire_bytes == 0
    assert step.step_s == pytest.approx(0.01 + 2 * allgather_total_s(INTRA, 4, 4 * N))


def test_compressing_inside_an_nvlink_node_never_pays():
    scenario = make_scenario("gpt2-1.5b", 8, "h100", "100gbe", gpus_per_node=8)
    records = estimate(scenario, crossovers=False)
    assert all(not r.pays for r in records), [(r.method, r.speedup) for r in records if r.pays]


def test_across_nodes_hierarchical_compression_beats_flat_allgather():
    # 64 H100s in 8 NVLink nodes over 100 GbE: int8 all-gathered over all 64 ranks costs more than
    # it saves; compressing only the shard that crosses the network costs far less (and pays with two-phase)
    scenario = make_scenario("gpt2-1.5b", 64, "h100", "100gbe", gpus_per_node=8)
    flat, hier, hier_twophase = estimate(scenario, [Choice("int8"), Choice("int8", hierarchical=True),
                                                    Choice("int8", {}, "twophase", hierarchical=True)],
                                         crossovers=False)[1:]
    assert flat.speedup < 0.5 < 4 * flat.speedup < hier.speedup
    assert hier.wire_bytes * 7 < flat.wire_bytes  # n / 8 compressed per rank instead of n
    assert hier_twophase.pays  # its exchange between the 8 nodes does not grow with them


def test_sharded_by_hand():
    # FSDP2 on 4 ranks of one 1M-element unit: forward waits for the parameter all-gather, backward
    # for the second one, then the reduce-scatter (ring: 3 * 10us + 3/4 * 4N * 1ns)
    compute = Compute(0.005, 0.01, 0.004)
    scenario = _scenario(world_size=4, gpus_per_node=1, sharded=True, compute=compute)
    gather = 3e-6 * 10 + 0.75 * 4 * N * 1e-9
    none = simulate(scenario, Choice("none"))
    assert none.step_s == pytest.approx(gather + 0.005 + gather + 0.01 + gather + 0.004 / 4)
    assert none.wire_bytes == 3 * 4 * N // 4 and none.exact_bytes == 2 * 3 * 4 * N // 4
    # int8 rows of N / 4: each rank sends 3 payloads w(N / 4) by one all-to-all
    row_wire = N // 4 + 4 * (N // 4 // 256)
    int8 = simulate(scenario, Choice("int8"))
    assert int8.wire_bytes == 3 * row_wire
    alltoall = 3 * 10e-6 + 0.75 * 4 * row_wire * 1e-9
    assert int8.step_s == pytest.approx(gather + 0.005 + gather + 0.01 + alltoall + 0.004 / 4)


def test_sharded_prefetches_one_unit_ahead():
    # two units: the second unit's parameters are gathered while the first one computes
    compute = Compute(0.02, 0.04, 0.0)
    a, b = Parameter("layers.0.w", (N,), flops=1.0), Parameter("layers.1.w", (N,), flops=1.0)
    scenario = _scenario(world_size=4, gpus_per_node=1, sharded=True, parameters=[a, b], compute=compute)
    assert [u.numel for u in fsdp_units(scenario.model)] == [N, N]
    gather = 3e-6 * 10 + 0.75 * 4 * N * 1e-9  # 3.2 ms < 10 ms of a unit's forward
    step = simulate(scenario, Choice("none"))
    # gather, both forwards (the second gather hidden), both backwards (the first backward's gather
    # waits for the end of forward; the second hides behind it), then the last reduce-scatter
    assert step.step_s == pytest.approx(gather + 0.02 + gather + 0.04 + gather)


def test_sharded_compressed_exchange_holds_backward():
    # gradcomp.fsdp's reduce-scatter returns only when its sum is decoded (FSDP2 calls a custom
    # reduce-scatter synchronously): the next unit's backward waits for the row exchange, which
    # FSDP's own (asynchronous) reduce-scatter lets it overlap
    compute = Compute(0.02, 0.04, 0.0)
    a, b = Parameter("layers.0.w", (N,), flops=1.0), Parameter("layers.1.w", (N,), flops=1.0)
    scenario = _scenario(world_size=4, gpus_per_node=1, sharded=True, parameters=[a, b], compute=compute)
    gather = 3e-6 * 10 + 0.75 * 4 * N * 1e-9
    row_wire = N // 4 + 4 * (N // 4 // 256)
    alltoall = 3 * 10e-6 + 0.75 * 4 * row_wire * 1e-9
    step = simulate(scenario, Choice("int8"))
    assert step.step_s == pytest.approx(gather + 0.02 + gather + 0.02 + alltoall + 0.02 + alltoall)


def test_fsdp_units_group_numbered_blocks_and_the_root():
    spec = ModelSpec("t", (Parameter("embed.weight", (10,)), Parameter("layers.0.a", (3,)),
                           Parameter("layers.0.b", (4,)), Parameter("layers.1.a", (5,)), Parameter("norm.w", (2,))))
    assert [u.numel for u in fsdp_units(spec)] == [5, 7, 12]  # backward order; root = embed + norm


def test_choices_for_each_case():
    sharded = default_choices(sharded=True)
    assert "powersgd" not in {c.method for c in sharded} and len({c.method for c in sharded}) == len(sharded)
    hier = [c for c in default_choices(hierarchical=True) if c.hierarchical]
    assert hier and all(c.label.startswith("hier:") and c.scheme != "lowrank" for c in hier)
    assert Choice.parse("hier:int8:twophase") == Choice("int8", {}, "twophase", hierarchical=True)
    for bad in ("hier:none", "hier:powersgd"):
        with pytest.raises(ValueError, match="no hierarchical form"):
            Choice.parse(bad)
    with pytest.raises(ValueError, match="gpus_per_node > 1"):
        simulate(_scenario(gpus_per_node=1), Choice("int8", hierarchical=True))
    with pytest.raises(ValueError, match="cannot reduce-scatter"):
        simulate(_scenario(world_size=4, gpus_per_node=1, sharded=True), Choice("powersgd"))
    with pytest.raises(ValueError, match="cannot be combined"):
        simulate(replace(_scenario(), sharded=True), Choice("int8", hierarchical=True))


def test_cli_hierarchical_and_sharded(capsys):
    base = ["breakeven", "--model", "gpt2-124m", "--world-size", "16", "--link", "25gbe", "--json"]
    assert main([*base, "--gpus-per-node", "8", "--hierarchical", "--methods", "int8"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in records] == ["none", "int8:allgather", "hier:int8:allgather"]
    assert records[2]["exact_bytes"] > 0 and records[2]["wire_bytes"] < records[1]["wire_bytes"]
    assert main([*base, "--sharded"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records[0]["method"] == "none" and "powersgd" not in {r["method"] for r in records}
    assert all(r["scheme"] == "rows" for r in records)
    assert main(["breakeven", "--model", "gpt2-124m", "--hierarchical"]) == 2
    assert "--gpus-per-node > 1" in capsys.readouterr().err
    assert main(["breakeven", "--model", "gpt2-124m", "--world-size", "8", "--gpus-per-node", "8",
                 "--intra-link", "pcie4"]) == 0
    assert "in one node over pcie4" in capsys.readouterr().out


def test_node_presets_fill_device_node_size_and_links(capsys):
    from gradcomp.analysis import node

    dgx = node("dgx-h100")
    assert (dgx.device, dgx.gpus, dgx.intra, dgx.inter) == ("h100", 8, "nvlink4", "ib-ndr")
    assert main(["breakeven", "--model", "gpt2-124m", "--world-size", "32", "--node", "dgx-h100",
                 "--methods", "int8", "--hierarchical"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "8 per node over nvlink4" in first and "link ib-ndr 400 Gbit/s" in first and "h100" in first
    with pytest.raises(ValueError, match="unknown node"):
        node("dgx-z")


def test_hierarchical_world_size_scan_starts_at_two_nodes():
    from gradcomp.analysis import breakeven_world_size

    scenario = make_scenario("gpt2-1.5b", 64, "h100", "100gbe", gpus_per_node=8)
    world, pays_from_two_nodes = breakeven_world_size(scenario, Choice("int8", {}, "twophase", hierarchical=True))
    assert not pays_from_two_nodes and world is not None and world > 9


def test_measured_reduce_scatter_links_price_the_reduce_scatters():
    """A network with links fitted to the backend's own reduce-scatter (Gloo's costs more than
    its all-reduce) prices every reduce-scatter over them: FSDP's over all ranks, the
    hierarchical hook's inside the node; the all-gathers keep their links."""
    measured_rs, intra_rs = Link("rs", 2.0, 40.0), Link("nv-rs", 20.0, 2.0)
    flat = Network(4, LINK, reduce_scatter_link=measured_rs)
    assert flat.reduce_scatter_s(4e6) == pytest.approx(allgather_total_s(measured_rs, 4, 4e6))
    assert Network(4, LINK).reduce_scatter_s(4e6) == pytest.approx(allgather_total_s(LINK, 4, 4e6))
    # a new bandwidth scales the measured reduce-scatter as it scales the all-gather
    assert flat.with_bandwidth(16.0).reduce_scatter_link.bandwidth_gbps == pytest.approx(4.0)
    one_node = Network(4, LINK, 4, INTRA, intra_reduce_scatter=intra_rs)
    assert one_node.reduce_scatter_s(4e6) == pytest.approx(allgather_total_s(intra_rs, 4, 4e6))
    nodes = Network(16, LINK, 4, INTRA, intra_reduce_scatter=intra_rs)
    assert nodes.within_node_s(4e6, reduce_scatter=True) == pytest.approx(allgather_total_s(intra_rs, 4, 4e6))
    assert nodes.within_node_s(4e6) == pytest.approx(allgather_total_s(INTRA, 4, 4e6))
    # hierarchical int8 by hand (test_hierarchical_int8_by_hand) with the node's reduce-scatter measured
    s = N // 4
    wire = s + 4 * (s // 256)
    inside = allgather_total_s(intra_rs, 4, 4 * N) + allgather_total_s(INTRA, 4, 4 * N)
    across = 3 * 10e-6 + 3 * wire * 1e-9
    scenario = replace(_scenario(), network=nodes)
    step = simulate(scenario, Choice("int8", {}, "allgather", hierarchical=True))
    assert step.step_s == pytest.approx(0.01 + inside + across)
    # FSDP's plain reduce-scatter of one unit over the measured link
    sharded = Scenario(ModelSpec("toy", (Parameter("w", (N,)),)), flat, PROFILE, Compute(0.0, 0.01, 0.0),
                       sharded=True)
    plain = Scenario(sharded.model, Network(4, LINK), PROFILE, sharded.compute, sharded=True)
    assert (simulate(sharded, Choice("none")).step_s - simulate(plain, Choice("none")).step_s
            == pytest.approx(allgather_total_s(measured_rs, 4, 4 * N) - allgather_total_s(LINK, 4, 4 * N)))


def test_a_reduce_scatter_links_host_share_is_host_work():
    host_share = Link("rs", 2.0, 40.0).with_host_share(Link("unshaped-rs", 20.0, 30.0))
    network = Network(4, LINK, reduce_scatter_link=host_share, intra_reduce_scatter=host_share)
    free = network.without_host_cost()
    assert free.reduce_scatter_link.per_byte_s == 0 and free.reduce_scatter_link.latency_us == pytest.approx(10.0)
    assert free.intra_reduce_scatter == free.reduce_scatter_link
    assert free.reduce_scatter_s(4e6) < network.reduce_scatter_s(4e6)
