"""The break-even cost model: formulas against hand-computed values, presets against published
parameter counts, DDP bucketing against torch's own routine, and monotonicity properties."""
from __future__ import annotations

import json
import math
import time

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcomp
from gradcomp.analysis import (Choice, Compute, LinearCost, Link, MethodCost, ModelSpec, Network, Parameter,
                               Profile, Scenario, breakeven_gbps, breakeven_world_size, ddp_buckets, estimate,
                               from_module, make_scenario, model, preset_profile, simulate)
from gradcomp.analysis.collectives import allgather_total_s, ring_allreduce_s, tree_allreduce_s
from gradcomp.analysis.presets import device
from gradcomp.schemes import SCHEMES
from gradcomp.analysis.profile import REFERENCE_NUMEL, declared_bytes

# 8 Gbit/s = 1e9 bytes/s: beta = 1 ns per byte; alpha = 10 us
LINK = Link("test", 8.0, 10.0)


def test_link_alpha_beta():
    assert LINK.alpha_s == pytest.approx(10e-6)
    assert LINK.beta_s == pytest.approx(1e-9)
    slow = Link("x", 8.0, 0.0, efficiency=0.5, per_byte_s=1e-9)
    assert slow.beta_s == pytest.approx(3e-9)  # 2 ns at half efficiency + 1 ns host cost


def test_ring_tree_allgather_by_hand():
    # ring, p=4, 1 MB: 2*3*10us + 2*(3/4)*1e6 B * 1 ns = 60 us + 1.5 ms
    assert ring_allreduce_s(LINK, 4, 1e6) == pytest.approx(60e-6 + 1.5e-3)
    # tree, p=4: 2*log2(4)*10us + 2*1e6*1ns = 40 us + 2 ms
    assert tree_allreduce_s(LINK, 4, 1e6) == pytest.approx(40e-6 + 2e-3)
    # all-gather of 100 kB from each of 4 ranks: 3*10us + 3*100kB*1ns
    assert Network(4, LINK).allgather_s(1e5) == pytest.approx(30e-6 + 3e-4)
    # all-to-all where each rank sends 1 MB in total: 3*10us + (3/4)*1 MB*1ns
    assert Network(4, LINK).alltoall_s(1e6) == pytest.approx(30e-6 + 7.5e-4)
    for p in (1, 0):
        assert ring_allreduce_s(LINK, p, 1e6) == 0.0 == allgather_total_s(LINK, p, 1e6)


def test_two_level_allreduce_by_hand():
    """The levels are pipelined (NCCL's ring moves chunks over both at once): every latency
    term, plus the slower level's bytes."""
    intra = Link("nv", 80.0, 1.0)  # 0.1 ns per byte, 1 us
    net = Network(16, LINK, gpus_per_node=4, intra=intra)
    # reduce-scatter + all-gather inside a node of 4: 2 * (3*1us + (3/4)*1e6*0.1ns)
    inside_latency, inside_bytes = 2 * 3e-6, 2 * 0.75e6 * 1e-10
    # ring all-reduce of M/4 = 250 kB over 4 nodes: 2*3*10us + 2*(3/4)*250kB*1ns
    across_latency, across_bytes = 60e-6, 1.5 * 2.5e5 * 1e-9
    assert net.allreduce_s(1e6) == pytest.approx(inside_latency + across_latency + max(inside_bytes, across_bytes))
    assert net.nodes == 4
    # a node as slow as the network (PCIe): its bytes, not the sum of both levels'
    slow = Network(16, LINK, gpus_per_node=4, intra=Link("pcie", 8.0, 1.0))
    assert slow.allreduce_s(1e6) == pytest.approx(inside_latency + across_latency + 2 * 0.75e6 * 1e-9)
    # all-gather and all-to-all alike: 1 MB from each of 16 ranks; 1 MB sent by each in all
    assert slow.allgather_s(1e6) == pytest.approx(3e-6 + 30e-6 + max(0.75 * 4e6 * 1e-9, 0.75 * 16e6 * 1e-9))
    assert slow.alltoall_s(1e6) == pytest.approx(3e-6 + 30e-6 + 0.75e6 * 1e-9)


def test_auto_takes_the_faster_of_ring_and_tree():
    many = Network(1024, LINK)
    assert many.allreduce_s(1e3) == pytest.approx(tree_allreduce_s(LINK, 1024, 1e3))  # latency-bound
    few = Network(4, LINK)
    assert few.allreduce_s(1e9) == pytest.approx(ring_allreduce_s(LINK, 4, 1e9))  # bandwidth-bound


@pytest.mark.parametrize("bad", [
    dict(bandwidth_gbps=0.0, latency_us=1.0), dict(bandwidth_gbps=-1.0, latency_us=1.0),
    dict(bandwidth_gbps=1.0, latency_us=-1.0), dict(bandwidth_gbps=float("inf"), latency_us=1.0)])
def test_link_rejects_impossible_numbers(bad):
    with pytest.raises(ValueError, match="link 'x'"):
        Link("x", **bad)


def test_network_rejects_bad_world_sizes_and_algorithms():
    with pytest.raises(ValueError, match="world size"):
        Network(0, LINK)
    with pytest.raises(ValueError, match="algorithm"):
        Network(4, LINK, algorithm="butterfly")
    with pytest.raises(ValueError, match="intra-node link"):
        Network(16, LINK, gpus_per_node=4)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 4096), nbytes=st.floats(1.0, 1e10), factor=st.floats(1.01, 100.0))
def test_collective_costs_are_monotone(p, nbytes, factor):
    net = Network(p, LINK)
    assert net.allreduce_s(nbytes * factor) >= net.allreduce_s(nbytes)
    assert net.with_bandwidth(LINK.bandwidth_gbps * factor).allreduce_s(nbytes) <= net.allreduce_s(nbytes)
    # all-gather of a fixed per-rank payload grows with the number of ranks; all-reduce nearly not
    assert Network(p + 1, LINK).allgather_s(nbytes) > net.allgather_s(nbytes)
    assert net.allreduce_s(nbytes) <= 2 * nbytes * LINK.beta_s + 2 * p * LINK.alpha_s


# ---- presets -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, parameters", [
    ("resnet50", 25_557_032),        # torchvision resnet50
    ("resnet18-cifar", 11_220_132),  # the CIFAR ResNet-18 (kuangliu/pytorch-cifar) at 100 classes
    ("vgg16", 138_357_544),          # torchvision vgg16
    ("bert-large", 335_141_888),     # bert-large-uncased BertModel with pooler
    ("gpt2-124m", 124_439_808),      # Hugging Face gpt2
    ("gpt2-355m", 354_823_168),      # gpt2-medium
    ("gpt2-1.5b", 1_557_611_200),    # gpt2-xl
    ("llama-7b", 6_738_415_616),     # LLaMA-7B
])
def test_model_presets_match_published_parameter_counts(name, parameters):
    assert model(name).numel == parameters


def test_model_flops_from_shape_rules():
    # ResNet-50 is ~4.1 G multiply-adds per 224x224 image: ~8.2 GFLOPs
    assert 8.0e9 < model("resnet50").forward_flops / 64 < 8.4e9
    # GPT-2 124M at 1024 tokens: 2 * (85M matmul weights + 38.6M tied head) + attention 4*12*1024*768
    spec = model("gpt2-124m")
    per_token = 2 * (85_054_464 - 12 * (3072 + 2304 + 768 + 3072 + 768)) + 2 * 50257 * 768 + 4 * 12 * 1024 * 768
    assert spec.forward_flops == pytest.approx(per_token * 8 * 1024, rel=1e-9)


def test_unknown_presets_are_named():
    for lookup, kind in ((model, "model"), (device, "device")):
        with pytest.raises(ValueError, match=f"unknown {kind} 'nope'"):
            lookup("nope")
    with pytest.raises(ValueError, match="unknown link"):
        make_scenario("resnet50", 4, link="carrier-pigeon")


def test_from_module_takes_trainable_parameters_in_order():
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    net[0].bias.requires_grad_(False)
    spec = from_module(net)
    assert [p.shape for p in spec.parameters] == [(4, 3), (2, 4), (2,)]
    with pytest.raises(TypeError, match="nn.Module"):
        from_module("resnet50")


def test_ddp_buckets_match_torch_assignment():
    spec = model("gpt2-124m")
    # CPU tensors: torch.empty reserves their 0.5 GB without touching it (meta tensors were
    # refused by some torch builds)
    tensors = [torch.empty(p.shape) for p in reversed(spec.parameters)]
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2 ** 20]
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
    ours = ddp_buckets(spec)
    assert [b.numel for b in ours] == [sum(tensors[i].numel() for i in idx) for idx in expected]
    assert sum(b.backward_share for b in ours) == pytest.approx(1.0)


def ddp_bucket_numels(rank, world_size, config):
    """The buckets DDP hands its comm hook at the second step of ``gradcomp.emulate.mlp(512)``
    (after its bucket rebuild), for each of ``config["caps"]`` (None: DDP's default cap)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomp.emulate import mlp
    from gradcomp.optim import local_gradients_hook

    sizes = {}
    for cap in config["caps"]:
        ddp = DDP(mlp(512), **({} if cap is None else {"bucket_cap_mb": cap}))
        seen = sizes[str(cap)] = []

        def hook(state, bucket, seen=seen):
            seen.append(bucket.buffer().numel())
            return local_gradients_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        for _ in range(2):
            seen.clear()
            ddp(torch.randn(2, 512)).sum().backward()
    return sizes


@pytest.mark.slow
def test_ddp_buckets_are_the_buckets_ddp_makes():
    """DDP's default cap has a small first bucket; an explicit bucket_cap_mb has none (one bucket
    of the whole 4.2 MB model at 25 MB): the model used 1 MB first buckets for both before, and
    priced the validation's bucket_cap_mb=25 runs as two buckets overlapping backward."""
    from pathlib import Path

    from gradcomp.emulate import launch_ranks, mlp

    caps = [None, 25.0, 2.0]
    (made,) = launch_ranks("test_analysis:ddp_bucket_numels", 1, {"caps": caps}, timeout_s=120,
                           env={"PYTHONPATH": str(Path(__file__).parent)})
    spec = from_module(mlp(512))
    for cap in caps:
        assert [b.numel for b in ddp_buckets(spec, cap)] == made[str(cap)], cap
    assert len(made["None"]) > 1 and len(made["25.0"]) == 1


# ---- compute costs -----------------------------------------------------------------------------

def test_preset_bytes_per_element_from_the_kernels():
    n = REFERENCE_NUMEL

    def per_element(name, world=1):
        return tuple(b / n for b in declared_bytes(name, world))

    # error feedback: read gradient (4) + read and write the residual (8), then write the payload
    assert per_element("int8") == pytest.approx((12 + 1 + 4 / 256, 1 + 4 / 256 + 4))
    assert per_element("sign") == pytest.approx((12 + 1 / 8 + 4 / 1024, 1 / 8 + 4 / 1024 + 4))
    assert per_element("fp16") == pytest.approx((4 + 2, 2 + 4))  # its hook keeps no residual
    # decoding and summing 3 payloads reads each once and writes the fp32 result once
    assert per_element("int8", 3)[1] == pytest.approx(3 * (1 + 4 / 256) + 4)
    for name in ("topk", "powersgd"):
        assert per_element(name)[0] > 12
    h100 = preset_profile(device("h100"))
    elements = 100_000_000
    # at the H100's measured fraction of the copy: 0.95 compressing, 0.98 decoding 2 payloads,
    # 0.99 decoding 8: 3 payloads in between, log-linear in the count
    at_3 = 0.98 + math.log(3 / 2) / math.log(4) * 0.01
    assert h100.method("int8").compress(elements) == pytest.approx(
        5e-6 + elements * (13 + 4 / 256) / (0.85 * 3350e9 * 0.95))
    assert h100.method("int8").decompress_s(elements, payloads=3) == pytest.approx(
        5e-6 + elements * (3 * (1 + 4 / 256) + 4) / (0.85 * 3350e9 * at_3))


def test_gpu_presets_price_each_kernel_at_its_measured_fraction_of_the_copy():
    """The H100 table is the two bench_gpu runs' median fraction of the copy at 100M elements
    (recomputed from the result files); every GPU preset takes it, the CPU none, PowerSGD none
    (its fixed costs are priced apart); a sign decode-sum of 64 payloads (0.32 of the copy)
    costs 0.91 / 0.32 times what one of 2 does per byte."""
    import json
    import statistics

    from gradcomp.analysis.presets import H100_KERNEL_RATES

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    runs = [json.loads((results / f"bench_gpu_h100_532ad50{suffix}.json").read_text()) for suffix in ("", "_2")]
    measured = {}
    for run in runs:
        for row in run["rows"]:
            if row["n"] == 100_000_000:
                measured.setdefault((row["method"], row["op"]), []).append(row["copy_fraction"])
    for name, rates in H100_KERNEL_RATES.items():
        assert rates.compress == pytest.approx(statistics.median(measured[name, "compress+EF"]), abs=0.006)
        for p, fraction in rates.decode:
            assert fraction == pytest.approx(statistics.median(measured[name, f"decode-sum p={p}"]), abs=0.006)
    assert "powersgd" not in H100_KERNEL_RATES and not device("cpu").kernel_rates
    for name in ("v100", "a100", "l40s", "h100", "h200", "mi300x"):
        assert device(name).kernel_rates is H100_KERNEL_RATES
    sign = preset_profile(device("h200")).method("sign")
    per_byte = [(sign.decompress_s(1e8, p) - 5e-6) / declared_bytes("sign", p)[1] for p in (2, 64)]
    assert per_byte[1] / per_byte[0] == pytest.approx(0.91 / 0.32)
    assert sign.decompress_s(1e8, 1) == pytest.approx(sign.decompress_s(1e8, 2) - 1e8 * sign.decompress.per_element_s
                                                     / 0.91)  # fewer than 2 payloads: 2's fraction
    assert sign.decode_factor(1000) == 0.32


def test_decode_rates_are_checked_and_kept_through_json():
    cost = preset_profile(device("h100")).method("topk")
    assert Profile.from_dict(preset_profile(device("h100")).to_dict()).method("topk").decode_rates == cost.decode_rates
    for bad, message in ((((8, 0.5), (2, 0.9)), "increasing order"), (((0, 0.5),), ">= 1"),
                         (((2, 0.0),), "fraction at 2 payloads"), (((2, math.nan),), "fraction at 2 payloads")):
        with pytest.raises(ValueError, match=message):
            MethodCost(LinearCost(0, 1e-9), LinearCost(0, 1e-9), decode_rates=bad)
    data = preset_profile(device("h100")).to_dict()
    data["methods"]["topk"]["decode_rates"] = [2, 0.5]
    with pytest.raises(ValueError, match="decode_rates' of 'topk'"):
        Profile.from_dict(data)


def test_kernel_rates_are_declared_bytes_per_second_over_the_copys():
    """``gradcomp calibrate --backend nccl`` measures what the presets hold, by the device-agnostic
    path (untested on a GPU here): with timings that make each kernel run at a chosen fraction of
    the copy, those fractions come back; on this CPU the real timings give one positive rate per
    op, PowerSGD left out."""
    from gradcomp.analysis import calibrate

    numel, chosen = 4096, {"int8": (0.5, (0.8, 0.25)), "topk": (0.2, (0.4, 0.1))}
    copy_s = 8 * numel / 100e9  # a 100 GB/s copy
    seconds = [copy_s]
    for name, (compress, decode) in chosen.items():
        method = gradcomp.methods.get_method(name)
        seconds.append(method.declared_bytes((numel,), 1)[0] / (compress * 100e9))
        seconds += [method.declared_bytes((numel,), p)[1] / (f * 100e9) for p, f in zip((2, 8), decode)]
    timings = iter(seconds)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibrate, "median_seconds", lambda fn, *args, **kwargs: (fn(), next(timings))[1])
        gbps, rates = calibrate.measure_kernel_rates([*chosen, "powersgd"], numel, payloads=(2, 8))
    assert gbps == pytest.approx(100.0) and set(rates) == set(chosen)
    for name, (compress, decode) in chosen.items():
        assert rates[name].compress == pytest.approx(compress)
        assert [p for p, _ in rates[name].decode] == [2, 8]
        assert [f for _, f in rates[name].decode] == pytest.approx(decode)
    gbps, rates = calibrate.measure_kernel_rates(["sign", "powersgd"], numel, payloads=(2, 8), repeats=2)
    assert gbps > 0 and list(rates) == ["sign"] and [p for p, _ in rates["sign"].decode] == [2, 8]
    assert rates["sign"].compress > 0 and all(f > 0 for _, f in rates["sign"].decode)
    with pytest.raises(ValueError, match="numel must be an integer >= 1"):
        calibrate.measure_kernel_rates(["sign"], 0)


def test_gpu_fixed_costs_per_launch_per_hook_call_and_per_tensor():
    """GPU presets carry the H100's measured fixed costs: 5 us per compress or decode launch,
    and for PowerSGD 313 us per hook call and 484 us per compressed tensor (biases and small
    matrices it sends as they are pay nothing), so a step of many small layers pays for them;
    the profile keeps the per-tensor cost through JSON."""
    from gradcomp.analysis.costmodel import compressed_tensors, step_buckets

    for name in ("v100", "a100", "l40s", "h100", "h200", "mi300x"):
        cost = preset_profile(device(name)).method("powersgd")
        assert cost.per_tensor_s == pytest.approx(484e-6) and cost.compress.fixed_s == pytest.approx(318e-6)
        assert preset_profile(device(name)).method("int8").per_tensor_s == 0.0
    assert preset_profile(device("cpu")).method("powersgd").per_tensor_s == 0.0
    scenario = make_scenario("resnet50", 16, "h100", "10gbe")
    powersgd = gradcomp.methods.get_method("powersgd")
    buckets = step_buckets(scenario)
    tensors = sum(compressed_tensors(powersgd, b.shapes) for b in buckets)
    assert 50 <= tensors < sum(len(b.shapes) for b in buckets) / 2  # the convolutions and fc, not BN or biases
    with_fixed = simulate(scenario, Choice("powersgd"))
    without = simulate(replace(scenario, profile=replace(
        scenario.profile, methods={**scenario.profile.methods, "powersgd": replace(
            scenario.profile.method("powersgd"), per_tensor_s=0.0)})), Choice("powersgd"))
    assert with_fixed.compress_s - without.compress_s == pytest.approx(tensors * 484e-6)
    data = Profile.from_dict(preset_profile(device("h100")).to_dict())
    assert data.method("powersgd").per_tensor_s == pytest.approx(484e-6)


def test_decompress_sums_payloads():
    cost = MethodCost(LinearCost(1e-6, 0.0), LinearCost(2e-6, 1e-9), output_per_element_s=4e-9)
    assert cost.decompress_s(1000, payloads=3) == pytest.approx(2e-6 + 1000 * (4e-9 + 3e-9))


def test_linear_fit_recovers_a_line():
    fit = LinearCost.fit([1, 2, 4, 8], [3 + 2 * x for x in (1, 2, 4, 8)])
    assert (fit.fixed_s, fit.per_element_s) == pytest.approx((3.0, 2.0))
    with pytest.raises(ValueError, match="two different sizes"):
        LinearCost.fit([5, 5], [1, 2])


def test_linear_fit_through_a_measured_point():
    """With ``through`` the line goes through that point: the slope alone is least squares,
    sum dx (y - y0) / sum dx^2 with dx = x - x0; a point on the true line gives the line back."""
    sizes, seconds = [1, 2, 4, 8], [3 + 2 * x for x in (1, 2, 4, 8)]
    fit = LinearCost.fit(sizes, seconds, through=(0, 3.0))
    assert (fit.fixed_s, fit.per_element_s) == (3.0, pytest.approx(2.0))
    fit = LinearCost.fit(sizes, seconds, through=(0, 5.0))  # y - 5 = 0, 2, 6, 14
    assert (fit.fixed_s, fit.per_element_s) == (5.0, pytest.approx((2 * 2 + 4 * 6 + 8 * 14) / (1 + 4 + 16 + 64)))
    # through a point above the line at x0 = 1: dx = 0, 1, 3, 7 and y - 9 = -4, -2, 2, 10
    fit = LinearCost.fit(sizes, seconds, through=(1, 9.0))
    slope = (1 * -2 + 3 * 2 + 7 * 10) / (1 + 9 + 49)
    assert (fit.fixed_s, fit.per_element_s) == pytest.approx((9.0 - slope, slope))
    assert LinearCost.fit(sizes, seconds, through=(0, 100.0)).per_element_s == 0.0  # clipped
    # through (4, 1): dx = -3, -2, 0, 4 and y - 1 = 4, 6, 10, 18: slope 48 / 29, intercept 1 - 4 slope < 0
    fit = LinearCost.fit(sizes, seconds, through=(4, 1.0))
    assert (fit.fixed_s, fit.per_element_s) == (0.0, pytest.approx(48 / 29))
    assert LinearCost.fit([7], [1.0], through=(0, 0.5)).per_element_s == pytest.approx(0.5 / 7)  # one size will do
    with pytest.raises(ValueError, match="the seconds of through must be a finite number >= 0"):
        LinearCost.fit(sizes, seconds, through=(0, -1.0))
    with pytest.raises(ValueError, match="needs a size other than 4"):
        LinearCost.fit([4, 4], [1.0, 1.0], through=(4, 1.0))


def test_fit_network_recovers_each_collectives_link():
    """Times made from known links by the ring formulas come back as those links, the
    reduce-scatter's its own (fitted to (p-1) alpha + (p-1)/p M beta) only when it was swept."""
    from gradcomp.analysis.calibrate import fit_network, fit_sweep
    p, sizes = 4, [4096, 65536, 1048576, 8388608]
    ar, ag, rs = Link("ar", 2.0, 30.0), Link("ag", 3.0, 20.0), Link("rs", 1.0, 50.0)
    links = fit_network(p, sizes, [ring_allreduce_s(ar, p, m) for m in sizes],
                        [allgather_total_s(ag, p, p * m) for m in sizes],
                        [allgather_total_s(rs, p, m) for m in sizes])
    for kind, link in (("allreduce", ar), ("allgather", ag), ("reduce_scatter", rs)):
        assert (links[kind].bandwidth_gbps, links[kind].latency_us) == pytest.approx(
            (link.bandwidth_gbps, link.latency_us), rel=1e-6)
    assert "reduce_scatter" not in fit_network(p, sizes, [ring_allreduce_s(ar, p, m) for m in sizes],
                                               [allgather_total_s(ag, p, p * m) for m in sizes])
    # a sweep recorded before the reduce-scatter was timed: priced as its all-reduce
    old = fit_sweep(p, {"sizes": sizes, "allreduce_s": [ring_allreduce_s(ar, p, m) for m in sizes],
                        "allgather_s": [allgather_total_s(ag, p, p * m) for m in sizes]})
    assert allgather_total_s(old["reduce_scatter"], p, 1e6) == pytest.approx(ring_allreduce_s(ar, p, 1e6))
    assert "alltoall" not in old  # priced as the all-gather (Network.alltoall_link None)
    a2a = Link("a2a", 0.5, 40.0)  # the all-to-all's own link when swept: (p-1) alpha + (p-1)/p M beta
    swept = fit_network(p, sizes, [ring_allreduce_s(ar, p, m) for m in sizes],
                        [allgather_total_s(ag, p, p * m) for m in sizes],
                        alltoall_s=[allgather_total_s(a2a, p, m) for m in sizes])
    assert (swept["alltoall"].bandwidth_gbps, swept["alltoall"].latency_us) == pytest.approx((0.5, 40.0), rel=1e-6)


def test_each_collective_kind_achieves_its_transports_fraction():
    """A preset link is nominal: all-reduce, all-gather and all-to-all each run at the fraction
    of it their transport measured (presets.TRANSPORTS); --efficiency sets one fraction for all;
    a custom bandwidth is achieved as given; a calibrated all-to-all link prices the all-to-alls."""
    from gradcomp.analysis.collectives import alltoall_s
    from gradcomp.analysis.presets import LINKS, TRANSPORTS

    assert all(link.transport in TRANSPORTS for link in LINKS.values())
    for name, transport in TRANSPORTS.items():
        assert all(0 < transport.fraction(k) <= 1 for k in ("allreduce", "allgather", "alltoall")), name
        assert transport.source
    net = make_scenario("resnet50", 16, "h100", "ib-ndr").network
    assert net.link.achieved_gbps == pytest.approx(400 * TRANSPORTS["ib"].allreduce)
    assert net.allgather_link.efficiency == TRANSPORTS["ib"].allgather
    assert net.alltoall_s(1e6) == pytest.approx(alltoall_s(replace(net.link, efficiency=TRANSPORTS["ib"].alltoall),
                                                           16, 1e6))
    assert net.with_bandwidth(200).alltoall_link.achieved_gbps == pytest.approx(200 * TRANSPORTS["ib"].alltoall)
    tcp = make_scenario("resnet50", 16, "h100", "100gbe").network
    assert tcp.allreduce_s(1e8) > 1.8 * make_scenario("resnet50", 16, "h100", "ib-hdr").network.allreduce_s(1e8) * 0.9
    flat = make_scenario("resnet50", 16, "h100", "ib-ndr", efficiency=0.5).network
    assert {flat.link.efficiency, flat.allgather_link.efficiency, flat.alltoall_link.efficiency} == {0.5}
    custom = make_scenario("resnet50", 16, "h100", bandwidth_gbps=4.0).network
    assert custom.link.achieved_gbps == 4.0 and custom.alltoall_link.achieved_gbps == 4.0
    with pytest.raises(ValueError, match="efficiency"):
        make_scenario("resnet50", 16, "h100", "ib-ndr", efficiency=1.5)
    nodes = make_scenario("resnet50", 16, "v100", "ib-edr", gpus_per_node=8, intra_gbps=100.0).network
    assert nodes.intra.achieved_gbps == 100.0 and nodes.intra.transport == ""
    measured = Network(4, Link("ar", 8.0, 10.0), allgather_link=Link("ag", 8.0, 10.0),
                       alltoall_link=Link("a2a", 2.0, 10.0))
    assert measured.alltoall_s(1e6) == pytest.approx(alltoall_s(Link("a2a", 2.0, 10.0), 4, 1e6))
    assert Network(4, Link("ar", 8.0, 10.0), allgather_link=Link("ag", 2.0, 10.0)).alltoall_s(1e6) == pytest.approx(
        alltoall_s(Link("ag", 2.0, 10.0), 4, 1e6))


def test_new_device_presets_and_a_shared_nic(capsys):
    """V100, L40S and MI300X presets (datasheet bandwidth and 16-bit peak); a node whose NIC
    serves two GPUs gives each rank half of it (the CLI's --node dgx1-v100); the first line names
    each link's nominal bandwidth and the fractions its collectives achieve."""
    from gradcomp.analysis.presets import DEVICES, NODES
    from gradcomp.cli import main

    assert {"v100", "l40s", "mi300x"} <= set(DEVICES)
    assert DEVICES["v100"].memory_gbps == pytest.approx(0.85 * 900) and DEVICES["v100"].peak_tflops == 125
    assert NODES["dgx1-v100"].gpus_per_nic == 2
    assert main(["breakeven", "--model", "resnet50", "--world-size", "16", "--node", "dgx1-v100",
                 "--methods", "fp16"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "8 per node over nvlink2 1200 Gbit/s x0.78 all-reduce" in first, first
    assert "v100, link ib-edr 50 Gbit/s x0.93 all-reduce, 0.96 all-to-all" in first, first


def test_fit_network_takes_alpha_from_the_measured_latency():
    """A latency per collective pins each line: alpha is the intercept over the collective's
    message steps (2(p-1) for the ring all-reduce, p-1 for the others) and beta the slope fitted
    through the pinned point; a point on the line the times imply gives the links back."""
    from gradcomp.analysis.calibrate import fit_network, fit_sweep
    p, sizes = 4, [4096, 65536, 1048576, 8388608]
    ar, ag, rs = Link("ar", 2.0, 30.0), Link("ag", 3.0, 20.0), Link("rs", 1.0, 50.0)
    times = ([ring_allreduce_s(ar, p, m) for m in sizes], [allgather_total_s(ag, p, p * m) for m in sizes],
             [allgather_total_s(rs, p, m) for m in sizes])
    implied = {"allreduce": 6 * 30e-6, "allgather": 3 * 20e-6, "reduce_scatter": 3 * 50e-6}
    links = fit_network(p, sizes, *times, latency_s=implied)
    for kind, link in (("allreduce", ar), ("allgather", ag), ("reduce_scatter", rs)):
        assert (links[kind].bandwidth_gbps, links[kind].latency_us) == pytest.approx(
            (link.bandwidth_gbps, link.latency_us), rel=1e-9)
    # measured on the smallest size instead (the sweep's point): the same links
    smallest = {kind: seconds[0] for kind, seconds in zip(("allreduce", "allgather", "reduce_scatter"), times)}
    links = fit_network(p, sizes, *times, latency_s=smallest, latency_bytes=sizes[0])
    for kind, link in (("allreduce", ar), ("allgather", ag), ("reduce_scatter", rs)):
        assert (links[kind].bandwidth_gbps, links[kind].latency_us) == pytest.approx(
            (link.bandwidth_gbps, link.latency_us), rel=1e-9)
    # a latency far above the intercept the sizes imply (a collective's waking, which the large
    # sizes do not show): alpha follows it, beta is still about the link's
    measured = {"allreduce": 3e-3, "allgather": 1.5e-3, "reduce_scatter": 1.5e-3}
    links = fit_sweep(p, {"sizes": sizes, "allreduce_s": times[0], "allgather_s": times[1],
                          "reduce_scatter_s": times[2], "latency_s": measured})
    assert [links[k].latency_us for k in ("allreduce", "allgather", "reduce_scatter")] == pytest.approx(
        [500.0, 500.0, 500.0])
    assert links["allreduce"].bandwidth_gbps == pytest.approx(ar.bandwidth_gbps, rel=0.1)


def test_measure_latency_averages_calls_issued_after_compute():
    """Each call comes after pause_s of compute that is not timed, and the latency is the mean
    of the calls (one slow call in four: the median would be the fast one)."""
    from gradcomp.analysis.calibrate import WARMUP, measure_latency

    entered, count = [], [0]

    def one_slow_in_four():
        entered.append(time.perf_counter())
        count[0] += 1
        if count[0] > WARMUP and (count[0] - WARMUP) % 4 == 0:
            time.sleep(0.02)

    latency = measure_latency(repeats=8, pause_s=0.005,
                              collectives={"slow": one_slow_in_four, "fast": lambda: None})
    assert set(latency) == {"slow", "fast"}
    assert 0.02 * 2 / 8 <= latency["slow"] < 0.02  # the mean of 2 slow calls in 8
    assert latency["fast"] < 0.005  # the 5 ms of compute before each call is not in it
    timed = entered[WARMUP:]
    assert len(timed) == 8 and min(b - a for a, b in zip(timed, timed[1:])) >= 0.005


def test_a_live_sweep_measures_each_collectives_latency():
    """network_worker on two Gloo ranks records latency_s for the four collectives on the
    smallest swept size, and each fitted line goes through that point (alpha: the intercept it
    implies over the collective's message steps)."""
    from gradcomp.analysis.calibrate import fit_sweep
    from gradcomp.emulate import launch_ranks

    sweep, _ = launch_ranks("gradcomp.analysis.calibrate:network_worker", 2,
                            {"sizes": [16384, 1024], "repeats": 1}, timeout_s=120)
    assert sweep["latency_bytes"] == 1024
    assert set(sweep["latency_s"]) == {"allreduce", "allgather", "reduce_scatter", "alltoall"}
    assert all(0 < s < 1 for s in sweep["latency_s"].values()), sweep["latency_s"]
    links = fit_sweep(2, sweep)
    for kind, steps in (("allreduce", 2), ("allgather", 1), ("reduce_scatter", 1), ("alltoall", 1)):
        line = LinearCost.fit(sweep["sizes"], sweep[f"{kind}_s"], through=(1024, sweep["latency_s"][kind]))
        assert links[kind].latency_us == pytest.approx(line.fixed_s / steps * 1e6)


def test_measure_compute_prices_the_gradient_zeroing_as_the_optimizer_phase():
    """A training step zeroes its gradients; the model's step has no other place for that time
    than the optimizer phase, so measure_compute times step() and zero_grad() together, with the
    caller's set_to_none (the harness trains with False: a write of every gradient)."""
    from gradcomp.analysis.calibrate import measure_compute

    class SlowZeroing(torch.optim.SGD):
        calls = []

        def zero_grad(self, set_to_none=True):
            self.calls.append(set_to_none)
            time.sleep(0.02)
            super().zero_grad(set_to_none=set_to_none)

    module = torch.nn.Linear(8, 2)
    optimizer = SlowZeroing(module.parameters(), lr=0.1)
    compute = measure_compute(module, (torch.randn(4, 8),), lambda m, b: m(b[0]).sum(), repeats=3,
                              optimizer=optimizer, set_to_none=False)
    assert compute.optimizer_s >= 0.02
    assert SlowZeroing.calls and set(SlowZeroing.calls) == {False}


# ---- the step simulation -----------------------------------------------------------------------

def _toy(parameters, compute, profile=None, world_size=2, link=LINK, cap_mb=25.0):
    spec = ModelSpec("toy", tuple(parameters))
    zero = LinearCost(0.0, 0.0)
    profile = profile or Profile("toy", {"int8": MethodCost(zero, zero), "powersgd": MethodCost(zero, zero)})
    return Scenario(spec, Network(world_size, link, algorithm="ring"), profile, compute, cap_mb)


def test_one_bucket_step_is_the_sum_of_its_phases():
    # 1M fp32 elements in one 25 MiB bucket: nothing overlaps
    scenario = _toy([Parameter("w", (1000, 1000))], Compute(0.01, 0.02, 0.005))
    comm = ring_allreduce_s(LINK, 2, 4e6)  # 2*10us + 4e6 B * 1 ns = 4.02 ms
    step = simulate(scenario, Choice("none"))
    assert step.comm_s == pytest.approx(comm)
    assert step.step_s == pytest.approx(0.01 + 0.02 + comm + 0.005)
    assert step.exposed_comm_s == pytest.approx(comm)


def test_early_bucket_overlaps_backward():
    # two parameters of 1 MiB+ each -> two buckets; the second to be ready (registered first)
    # takes half of backward. The first bucket's all-reduce runs while the rest of backward does.
    a, b = Parameter("a", (300_000,), flops=1.0), Parameter("b", (300_000,), flops=1.0)
    compute = Compute(0.0, 0.02, 0.0)
    scenario = _toy([a, b], compute, cap_mb=1.0)
    assert [bk.numel for bk in ddp_buckets(scenario.model, 1.0)] == [300_000, 300_000]
    comm = ring_allreduce_s(LINK, 2, 1.2e6)  # 1.22 ms < 10 ms of remaining backward
    step = simulate(scenario, Choice("none"))
    # bucket b is hidden behind a's backward; bucket a's all-reduce starts when backward ends
    assert step.step_s == pytest.approx(0.02 + comm)


def test_host_share_of_a_collective_delays_backward_when_it_contends():
    # the early bucket's all-reduce used to hide behind backward; with its cost all host work on
    # the same cores, backward waits for it: the step grows by exactly that host time
    a, b = Parameter("a", (300_000,), flops=1.0), Parameter("b", (300_000,), flops=1.0)
    # 99% of every byte's cost is host work (the latency is not: a host link of no latency)
    host_link = LINK.with_host_share(replace(LINK, latency_us=0.0))
    assert host_link.beta_s == pytest.approx(LINK.beta_s)
    assert host_link.per_byte_s == pytest.approx(0.99 * LINK.beta_s)
    assert host_link.host_latency_us == 0
    compute = Compute(0.0, 0.02, 0.0)
    free = _toy([a, b], compute, link=host_link, cap_mb=1.0)
    contended = replace(free, host_contends=True)
    comm = ring_allreduce_s(host_link, 2, 1.2e6)
    host = comm - ring_allreduce_s(replace(host_link, per_byte_s=0.0), 2, 1.2e6)
    assert simulate(free, Choice("none")).step_s == pytest.approx(0.02 + comm)
    assert simulate(contended, Choice("none")).step_s == pytest.approx(0.02 + host + comm)
    # no host share: contention changes nothing
    plain = _toy([a, b], compute, cap_mb=1.0)
    assert simulate(replace(plain, host_contends=True), Choice("none")).step_s == \
        pytest.approx(simulate(plain, Choice("none")).step_s)


def test_host_latency_of_a_collective_is_compute_when_the_host_contends():
    # a host link with the whole latency and no cost per byte: the early bucket's all-reduce
    # (2 message steps on 2 ranks) delays backward by its 2 alphas, no more
    a, b = Parameter("a", (300_000,), flops=1.0), Parameter("b", (300_000,), flops=1.0)
    host_link = LINK.with_host_share(replace(LINK, bandwidth_gbps=1e12))
    assert host_link.host_latency_us == LINK.latency_us and host_link.beta_s == pytest.approx(LINK.beta_s)
    compute = Compute(0.0, 0.02, 0.0)
    free = _toy([a, b], compute, link=host_link, cap_mb=1.0)
    comm = ring_allreduce_s(host_link, 2, 1.2e6)
    host = comm - ring_allreduce_s(replace(host_link, latency_us=0.0, host_latency_us=0.0,
                                           per_byte_s=0.0), 2, 1.2e6)
    assert host == pytest.approx(2 * LINK.alpha_s + 1.2e6 * host_link.per_byte_s)
    assert simulate(free, Choice("none")).step_s == pytest.approx(0.02 + comm)
    assert simulate(replace(free, host_contends=True), Choice("none")).step_s == pytest.approx(0.02 + host + comm)
    with pytest.raises(ValueError, match="host_latency_us"):
        replace(LINK, host_latency_us=LINK.latency_us + 1)


def test_ranks_sharing_cores_scale_every_compute_stage_not_the_host_share():
    # 2 ranks per core: forward, backward, the hook's compress/decompress and the optimizer take
    # twice their seconds; the collective (and its host share) does not
    cost = MethodCost(LinearCost(0.0, 1e-8), LinearCost(0.0, 2e-9))
    host_link = LINK.with_host_share(replace(LINK, bandwidth_gbps=2 * LINK.bandwidth_gbps))
    alone = _toy([Parameter("w", (1000, 1000))], Compute(0.004, 0.01, 0.003), Profile("toy", {"int8": cost}),
                 link=host_link)
    shared = replace(alone, ranks_per_core=2.0)
    for scenario in (alone, replace(alone, host_contends=True)):
        slow = replace(scenario, ranks_per_core=2.0)
        for choice in (Choice("none"), Choice("int8")):
            one, two = simulate(scenario, choice), simulate(slow, choice)
            comm = one.step_s - one.compute_busy_s  # one bucket: nothing overlaps
            assert two.step_s == pytest.approx(2 * one.compute_busy_s + comm)
            assert two.compute_busy_s == pytest.approx(2 * one.compute_busy_s)
            assert two.compress_s == pytest.approx(2 * one.compress_s)
            assert two.comm_s == pytest.approx(one.comm_s)
    assert simulate(shared, Choice("int8")).wire_bytes == simulate(alone, Choice("int8")).wire_bytes


def test_a_collective_after_compute_waits_for_the_slowest_rank():
    # one bucket: forward 10 ms, backward 20, optimizer 5; a collective issued after 35 ms of
    # compute since the last step's end (optimizer + forward + backward) starts 1 ms + 10% of it later
    scenario = _toy([Parameter("w", (1000, 1000))], Compute(0.01, 0.02, 0.005))
    comm = ring_allreduce_s(LINK, 2, 4e6)
    waiting = replace(scenario, sync_wait=LinearCost(1e-3, 0.1))
    step = simulate(waiting, Choice("none"))
    assert step.step_s == pytest.approx(0.01 + 0.02 + (1e-3 + 0.1 * 0.035) + comm + 0.005)
    assert step.compute_busy_s == pytest.approx(simulate(scenario, Choice("none")).compute_busy_s)
    # shared cores: the wait follows the compute seconds the ranks actually spend (2x)
    shared = simulate(replace(waiting, ranks_per_core=2.0), Choice("none"))
    assert shared.step_s == pytest.approx(2 * 0.035 + (1e-3 + 0.1 * 0.07) + comm)


def test_the_wait_counts_the_compute_since_the_ranks_last_waited_together():
    # PowerSGD on one matrix: compress (M Q) | all-reduce(P) | compress (M^T P) | all-reduce(Q):
    # the first all-reduce waits for the step's compute so far, the second only for the compute
    # after the first (the ranks waited for it together)
    cost = MethodCost(LinearCost(1e-3, 0.0), LinearCost(0.0, 0.0))
    scenario = _toy([Parameter("w", (1000, 1000))], Compute(0.01, 0.02, 0.0), Profile("toy", {"powersgd": cost}))
    wait = LinearCost(0.0, 0.5)
    plain, waiting = (simulate(replace(scenario, sync_wait=w), Choice("powersgd")) for w in (LinearCost(0, 0), wait))
    stages, _ = SCHEMES["lowrank"].stages(gradcomp.methods.get_method("powersgd"), cost, 1_000_000,
                                       scenario.network, ((1000, 1000),), scenario.profile.average(1_000_000))
    computes = [seconds for resource, seconds in stages if resource == "compute"]
    assert len(computes) == 3 and computes[1] > 0
    first = 0.01 + 0.02 + computes[0]  # forward, backward, compress (M Q)
    assert waiting.step_s == pytest.approx(plain.step_s + wait(first) + wait(computes[1]))


def test_every_collective_after_compute_waits_but_counts_only_the_compute_since_the_last():
    # hierarchical fp16 with free compress/decompress: averaging | reduce-scatter (intra) | compress
    # | exchange between nodes | decompress | all-gather (intra): each collective follows a compute
    # stage (a fixed wait each), but only the first follows compute the ranks did apart (backward)
    zero = LinearCost(0.0, 0.0)
    scenario = _toy([Parameter("w", (1000, 1000))], Compute(0.0, 0.02),
                    Profile("toy", {"fp16": MethodCost(zero, zero)}), world_size=4)
    scenario = replace(scenario, network=Network(4, LINK, gpus_per_node=2, intra=Link("nv", 80.0, 1.0),
                                                 algorithm="ring"))
    choice = Choice("fp16", hierarchical=True)
    plain = simulate(scenario, choice).step_s
    fixed, per_compute_s = (simulate(replace(scenario, sync_wait=w), choice).step_s
                            for w in (LinearCost(2e-3, 0.0), LinearCost(0.0, 0.5)))
    assert fixed == pytest.approx(plain + 3 * 2e-3)
    assert per_compute_s == pytest.approx(plain + 0.5 * 0.02)


def test_sync_wait_must_be_a_linear_cost():
    with pytest.raises(TypeError, match="sync_wait"):
        replace(_toy([Parameter("w", (10,))], Compute(0.0, 0.01)), sync_wait=0.001)


@pytest.mark.parametrize("bad", [0.5, 0, -1, float("nan"), float("inf"), "2", None])
def test_ranks_per_core_below_one_or_not_a_number_is_named(bad):
    with pytest.raises(ValueError, match="ranks_per_core"):
        replace(_toy([Parameter("w", (10,))], Compute(0.0, 0.01)), ranks_per_core=bad)


def test_compression_work_is_on_the_critical_path():
    cost = MethodCost(LinearCost(0.0, 1e-8), LinearCost(0.0, 2e-9))
    profile = Profile("toy", {"int8": cost})
    scenario = _toy([Parameter("w", (1000, 1000))], Compute(0.0, 0.01, 0.0), profile)
    method = Choice("int8")
    n = 1_000_000
    # int8 wire bytes (gradcomp.get_method("int8").wire_bytes): q, then the scales padded to 16
    wire = n + 16 * -(-4 * (n // 256 + 1) // 16)
    gather = Network(2, LINK).allgather_s(wire)
    expected = 0.01 + n * 1e-8 + gather + n * 2 * 2e-9  # decode and sum 2 payloads
    assert simulate(scenario, method).step_s == pytest.approx(expected)


def test_a_deferred_collective_waits_for_the_next_buckets_hook():
    # two-phase's all-gather is queued by the callback that re-compresses the chunk and launched
    # by the next bucket's hook (Deferred.flush): bucket b's all-gather cannot start before a's
    # hook at 20 ms, so it no longer hides behind backward; free compression isolates the network
    a, b = Parameter("a", (300_000,), flops=1.0), Parameter("b", (300_000,), flops=1.0)
    scenario = _toy([a, b], Compute(0.0, 0.02, 0.0), cap_mb=1.0)
    method, net = gradcomp.get_method("int8"), Network(2, LINK, algorithm="ring")
    padded = SCHEMES["twophase"].padded_numel(300_000, 2, method.granule)
    to_all = net.alltoall_s(2 * method.wire_bytes(padded // 2))  # the 2 chunk payloads
    gather = net.allgather_s(method.wire_bytes(padded // 2))
    assert to_all + gather < 0.01  # without the queue, b's exchange would end inside backward
    # at 20 ms: b's all-gather (queued first), then a's all-to-all and all-gather
    assert simulate(scenario, Choice("int8", {}, "twophase")).step_s == \
        pytest.approx(0.02 + gather + to_all + gather)
    # a scheme without a queue: b's exchange is hidden, a's follows backward
    assert simulate(scenario, Choice("int8", {}, "allgather")).step_s == \
        pytest.approx(0.02 + net.allgather_s(method.wire_bytes(300_000)))


SCENARIO = make_scenario("gpt2-124m", 16, "a100", "25gbe")


@settings(max_examples=12, deadline=None)
@given(low=st.floats(0.1, 1000.0), factor=st.floats(1.5, 100.0),
       choice=st.sampled_from([Choice("none"), Choice("fp16"), Choice("int8", {}, "twophase"),
                               Choice("topk"), Choice("powersgd")]))
def test_step_time_never_rises_with_bandwidth(low, factor, choice):
    slow = simulate(SCENARIO.with_bandwidth(low), choice).step_s
    fast = simulate(SCENARIO.with_bandwidth(low * factor), choice).step_s
    assert fast <= slow * (1 + 1e-12)


def test_breakeven_bandwidth_is_where_the_verdict_flips():
    choice = Choice("powersgd")
    gbps = breakeven_gbps(SCENARIO, choice)
    none = Choice("none")

    def speedup(g):
        s = SCENARIO.with_bandwidth(g)
        return simulate(s, none).step_s / simulate(s, choice).step_s

    assert speedup(gbps * 0.99) > 1.0 > speedup(gbps * 1.01)


def test_breakeven_against_an_uncompressed_step_in_another_scenario():
    """``baseline``: the uncompressed step simulated in its own scenario (e.g. Gloo's flat ring
    beside a hierarchical hook), both at each tried bandwidth; the verdict flips where the
    choice's step in its scenario meets the baseline's step in its own."""
    choice, none = Choice("powersgd"), Choice("none")
    assert breakeven_gbps(SCENARIO, choice, baseline=SCENARIO) == breakeven_gbps(SCENARIO, choice)
    net = SCENARIO.network  # the uncompressed step over a link of half the efficiency
    baseline = replace(SCENARIO, network=replace(net, link=replace(net.link, efficiency=net.link.efficiency / 2)))
    gbps = breakeven_gbps(SCENARIO, choice, baseline=baseline)

    def speedup(g):
        return simulate(baseline.with_bandwidth(g), none).step_s / simulate(SCENARIO.with_bandwidth(g), choice).step_s

    assert speedup(gbps * 0.99) > 1.0 > speedup(gbps * 1.01)
    assert gbps > breakeven_gbps(SCENARIO, choice)  # a slower baseline: compression pays longer


def test_allgather_stops_paying_at_scale():
    choice = Choice("topk")
    world, pays_at_two = breakeven_world_size(SCENARIO, choice)
    assert pays_at_two and world is not None
    none = Choice("none")
    assert all(
        simulate(SCENARIO.with_world_size(w), none).step_s < simulate(SCENARIO.with_world_size(w), choice).step_s
        for w in (world, 2 * world))


def test_estimate_records():
    records = estimate(make_scenario("resnet50", 8, "h100", "10gbe"), crossovers=False)
    assert records[0].method == "none" and records[0].speedup == 1.0 and not records[0].pays
    labels = [r.method for r in records]
    assert {"fp16", "int8:allgather", "int8:twophase", "sign:twophase", "topk", "powersgd"} <= set(labels)
    for r in records:
        assert r.step_s >= r.comm_s - r.exposed_comm_s >= 0
        assert r.pays == (r.method != "none" and r.speedup >= r.margin == 1.05)


def test_the_verdict_has_a_margin():
    """pays only at >= margin, does not pay at <= 1 / margin, marginal between; the raw speedup
    is kept and the margin is an option."""
    from gradcomp.analysis.breakeven import verdict_class

    assert [verdict_class(s) for s in (1.05, 1.049, 1.01, 1.0, 0.99, 1 / 1.05, 0.9)] == [
        "pays", "marginal", "marginal", "marginal", "marginal", "does not pay", "does not pay"]
    assert verdict_class(1.01, margin=1.0) == "pays" and verdict_class(1.2, margin=1.25) == "marginal"
    scenario = make_scenario("resnet50", 8, "h100", "10gbe")
    choices = [Choice("fp16")]
    fp16 = estimate(scenario, choices, crossovers=False)[1]
    assert fp16.pays and fp16.verdict.startswith("pays: ")
    strict = estimate(scenario, choices, crossovers=False, margin=fp16.speedup * 1.01)[1]
    assert not strict.pays and strict.speedup == fp16.speedup
    assert strict.verdict.startswith("marginal: ") and "margin" in strict.verdict
    for bad in (0.99, float("nan"), True, "1.05"):
        with pytest.raises(ValueError, match="margin"):
            estimate(scenario, choices, crossovers=False, margin=bad)


def test_speedups_against_another_baseline():
    """``baseline``: a mixed-precision run's gradients are already fp16, so a compressor is
    judged against the fp16 exchange: the baseline comes first, none after it."""
    scenario = make_scenario("bert-large", 32, "a100", bandwidth_gbps=2.0)
    plain = {r.method: r for r in estimate(scenario, [Choice("fp16"), Choice("sign", {}, "twophase")],
                                           crossovers=False)}
    records = estimate(scenario, [Choice("sign", {}, "twophase")], crossovers=False, baseline="fp16")
    assert [r.method for r in records] == ["fp16", "none", "sign:twophase"]
    fp16, none, sign = records
    assert fp16.verdict == "baseline" and fp16.speedup == 1.0 and not fp16.pays and sign.baseline == "fp16"
    # the 16-bit baseline's gradients are 16-bit already: its exchange is charged no cast (issue 50)
    from gradcomp.analysis.breakeven import baseline_scenario

    free = baseline_scenario(scenario, Choice("fp16"))
    assert fp16.step_s == simulate(free, Choice("fp16")).step_s < plain["fp16"].step_s
    assert fp16.compress_s == simulate(scenario, Choice("none")).compress_s  # the averaging only
    assert sign.speedup == fp16.step_s / sign.step_s == pytest.approx(
        plain["sign:twophase"].speedup / plain["fp16"].speedup, rel=1e-3)
    assert none.speedup < 1 and "over fp16" in sign.verdict
    # bf16 likewise, and fp32 names the uncompressed baseline
    bf16 = estimate(scenario, [Choice("sign", {}, "twophase")], crossovers=False, baseline="bf16")
    assert bf16[0].method == "bf16" and bf16[0].step_s == simulate(
        baseline_scenario(scenario, Choice("bf16")), Choice("bf16")).step_s
    assert [r.method for r in estimate(scenario, [Choice("fp16")], crossovers=False, baseline="fp32")] == [
        "none", "fp16"]


def test_choice_validation():
    with pytest.raises(ValueError, match="unknown method 'zip'"):
        Choice("zip")
    with pytest.raises(ValueError, match="has no scheme 'twophase'"):
        Choice("topk", {}, "twophase")
    with pytest.raises(ValueError, match="ratio"):
        Choice("topk", {"ratio": 2.0})
    assert Choice.parse("INT8:twophase").label == "int8:twophase"
    assert Choice.parse("fp16").label == "fp16"


# ---- profiles ----------------------------------------------------------------------------------

def _profile():
    cost = MethodCost(LinearCost(1e-5, 2e-9), LinearCost(3e-6, 1e-9))
    return Profile("box", {"int8": cost}, Compute(0.01, 0.02, 0.003, "mlp"),
                   {"allreduce": Link("ar", 3.0, 50.0), "allgather": Link("ag", 4.0, 60.0)}, 2,
                   {"note": "x"}, LinearCost(1e-6, 1e-10))


def test_profile_round_trip(tmp_path):
    path = tmp_path / "p.json"
    _profile().save(path)
    assert Profile.load(path) == _profile()
    swept = replace(_profile(), network={**_profile().network, "reduce_scatter": Link("rs", 1.0, 70.0)})
    swept.save(path)
    assert Profile.load(path) == swept


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("format"), "'format'"),
    (lambda d: d.update(device=3), "'device'"),
    (lambda d: d.update(methods={}), "'methods'"),
    (lambda d: d["methods"].update(zip=d["methods"]["int8"]), "unknown method 'zip'"),
    (lambda d: d["methods"]["int8"]["compress"].update(fixed_s=-1.0), "fixed_s"),
    (lambda d: d["methods"]["int8"].pop("decompress"), "decompress"),
    (lambda d: d["network"].pop("allgather"), "'network'"),
    (lambda d: d["network"].update(broadcast=d["network"]["allreduce"]), "'network'"),
    (lambda d: d["network"]["allreduce"].update(bandwidth_gbps=0), "bandwidth_gbps"),
    (lambda d: d.update(world_size=1), "'world_size'"),
    (lambda d: d["compute"].update(forward_s="fast"), "forward_s"),
])
def test_malformed_profiles_are_refused(mutate, message):
    data = _profile().to_dict()
    mutate(data)
    with pytest.raises(ValueError, match=message):
        Profile.from_dict(data)


def test_profile_load_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Profile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        Profile.load(tmp_path / "bad.json")


def test_profile_network_drives_the_scenario():
    scenario = make_scenario("resnet50", 2, profile=_profile())
    assert scenario.network.link.name == "ar" and scenario.network.algorithm == "ring"
    assert scenario.profile.device == "box"
    # a custom bandwidth on a measured network keeps the measured all-gather/all-reduce ratio
    faster = make_scenario("resnet50", 2, profile=_profile(), bandwidth_gbps=30.0)
    assert faster.network.link.bandwidth_gbps == pytest.approx(30.0)
    assert faster.network.allgather_link.bandwidth_gbps == pytest.approx(40.0)
    assert scenario.network.reduce_scatter_link is None  # not swept: priced as the all-gather
    # a swept reduce-scatter prices FSDP's, scaled with the bandwidth as the all-gather is
    swept = replace(_profile(), network={**_profile().network, "reduce_scatter": Link("rs", 1.5, 70.0)})
    assert make_scenario("resnet50", 2, profile=swept).network.reduce_scatter_link.name == "rs"
    assert make_scenario("resnet50", 2, profile=swept, bandwidth_gbps=30.0).network.reduce_scatter_link \
        .bandwidth_gbps == pytest.approx(15.0)
    with pytest.raises(ValueError, match="no costs for method 'sign'"):
        simulate(scenario, Choice("sign"))


def test_scenario_rejects_impossible_numbers():
    with pytest.raises(ValueError, match="bandwidth"):
        make_scenario("resnet50", 4, bandwidth_gbps=0.0)
    with pytest.raises(ValueError, match="latency"):
        make_scenario("resnet50", 4, latency_us=-2.0)
    with pytest.raises(ValueError, match="world size"):
        make_scenario("resnet50", 0)
    with pytest.raises(ValueError, match="FLOP count"):
        make_scenario(torch.nn.Linear(4, 4), 4)
    assert math.isfinite(simulate(make_scenario(torch.nn.Linear(4, 4), 4, compute=Compute(1e-3, 2e-3)),
                                  Choice("fp16")).step_s)


def test_cli_margin_baseline_and_optimizer_time(capsys):
    """``gradcomp breakeven --margin --baseline --optimizer-ms``: the JSON keeps the raw speedup,
    the margin and the baseline; the optimizer's measured time is part of every step."""
    import json

    from gradcomp.cli import main

    argv = ["breakeven", "--model", "resnet50", "--world-size", "8", "--device", "a100", "--link", "10gbe",
            "--methods", "fp16", "--compute-ms", "30", "--json"]
    assert main(argv) == 0
    plain = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert main(argv + ["--baseline", "fp16"]) == 0
    sixteen = json.loads(capsys.readouterr().out)[0]
    assert sixteen["step_s"] < plain["fp16"]["step_s"]  # a 16-bit run's baseline: no cast charged
    assert main(argv + ["--optimizer-ms", "5", "--margin", "100", "--baseline", "fp16"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in records] == ["fp16", "none"]
    assert records[0]["step_s"] == pytest.approx(sixteen["step_s"] + 0.005)
    assert records[1]["margin"] == 100 and records[1]["baseline"] == "fp16" and not records[1]["pays"]
    assert main(argv[:-1] + ["--margin", "100"]) == 0
    out = capsys.readouterr().out
    assert "marginal" in out.split("\n")[5] and "pays at >= 100x" in out
    assert main(["breakeven", "--model", "resnet50", "--optimizer-ms", "5"]) == 2
    assert "--optimizer-ms needs --compute-ms" in capsys.readouterr().err


def test_powersgd_bucket_is_two_allreduces_of_its_own_sizes():
    """gradcomp.hooks.powersgd: P with the uncompressed tensors in one all-reduce, then Q in another;
    each priced at its own size with its own latency terms (not an even split of the bytes)."""
    from gradcomp.analysis.costmodel import Bucket, _bucket_stages, lowrank_parts
    from gradcomp.methods import get_method

    method = get_method("powersgd", rank=2)
    shapes = ((512, 256), (512,))
    p_bytes, q_bytes = lowrank_parts(method, shapes)
    assert (p_bytes, q_bytes) == (4 * (512 * 2 + 512), 4 * 256 * 2)
    scenario = make_scenario("resnet50", 16, "a100", "10gbe")
    stages, wire, _, _ = _bucket_stages(Choice("powersgd", {"rank": 2}), Bucket(shapes, 1.0), scenario)
    network = [seconds for resource, seconds in stages if resource == "network"]
    assert network == [scenario.network.allreduce_s(p_bytes), scenario.network.allreduce_s(q_bytes)]
    assert wire == p_bytes + q_bytes
    # a bucket with nothing to compress: one all-reduce
    stages, _, _, _ = _bucket_stages(Choice("powersgd", {"rank": 2}), Bucket(((512,),), 1.0), scenario)
    assert [resource for resource, _ in stages].count("network") == 1


@pytest.mark.parametrize("network", [["--node", "dgx-h100"], ["--link", "100gbe"]], ids=["dgx-h100", "100gbe"])
def test_fp16_baseline_is_charged_no_compression_on_llama(capsys, network):
    """Llama-7B on 64 H100s against a mixed-precision run (--baseline fp16): the baseline's gradients
    are 16-bit already, so its row carries the averaging only, as uncompressed fp32's does, and
    fp32 (twice the bytes) never comes out faster than it."""
    from gradcomp.cli import main

    assert main(["breakeven", "--model", "llama-7b", "--world-size", "64", "--device", "h100", *network,
                 "--baseline", "fp16", "--methods", "fp16", "--json"]) == 0
    fp16, none = json.loads(capsys.readouterr().out)
    assert (fp16["method"], none["method"]) == ("fp16", "none")
    assert fp16["compress_s"] == none["compress_s"]
    assert none["speedup"] <= 1.0 and not none["pays"] and none["verdict_kind"] != "pays"
