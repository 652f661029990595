"""Build a Scenario from names and numbers (what the CLI and the Python API take)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..checks import check_number
from . import models, presets
from .collectives import Link, Network
from .costmodel import Scenario
from .models import ModelSpec
from .profile import Compute, Profile, preset_profile
from .presets import Device

# Adam in fp32 reads parameter, gradient, m, v and writes parameter, m, v: 28 bytes per parameter.
ADAM_BYTES_PER_PARAMETER = 28
CUSTOM_LATENCY_US = 10.0


def estimated_compute(model: ModelSpec, device: Device) -> Compute:
    """Forward = FLOPs / (peak * MFU), backward = 2 x forward, optimizer = Adam's bytes / bandwidth."""
    if model.forward_flops <= 0:
        raise ValueError(f"model {model.name!r} has no FLOP count: pass its measured compute time "
                         "(compute=Compute(forward_s, backward_s), or a calibrated profile)")
    forward = model.forward_flops / (device.peak_tflops * 1e12 * device.mfu)
    optimizer = ADAM_BYTES_PER_PARAMETER * model.numel / (device.memory_gbps * 1e9)
    return Compute(forward, 2 * forward, optimizer, model.name)


def _model_spec(model) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, torch.nn.Module):
        return models.from_module(model)
    if isinstance(model, str):
        return models.model(model)
    raise TypeError(f"model must be a preset name, a ModelSpec or an nn.Module, got {type(model).__name__}")


def _link(link: str | Link | None, bandwidth_gbps: float | None, latency_us: float | None) -> Link | None:
    """The network link: a preset (or Link) with its numbers overridden, or a custom one (its
    bandwidth as achieved: efficiency 1, no transport)."""
    for name, value, low in (("bandwidth", bandwidth_gbps, "> 0"), ("latency", latency_us, ">= 0")):
        if value is not None:
            check_number("", name, value, 0, low_open=low == "> 0", finite=True)
    if link is None:
        if bandwidth_gbps is None:
            return None
        return Link("custom", bandwidth_gbps, CUSTOM_LATENCY_US if latency_us is None else latency_us)
    base = link if isinstance(link, Link) else presets.link(link)
    return replace(base, bandwidth_gbps=bandwidth_gbps if bandwidth_gbps is not None else base.bandwidth_gbps,
                   latency_us=latency_us if latency_us is not None else base.latency_us,
                   host_latency_us=min(base.host_latency_us, latency_us if latency_us is not None else base.latency_us))


def make_scenario(model, world_size: int, device: str = "h100", link: str | Link | None = None,
                  bandwidth_gbps: float | None = None, latency_us: float | None = None,
                  gpus_per_node: int = 1, algorithm: str = "auto", profile: Profile | str | Path | None = None,
                  compute: Compute | None = None, bucket_cap_mb: float | None = None,
                  intra_link: str | Link | None = None, sharded: bool = False,
                  efficiency: float | None = None, intra_gbps: float | None = None) -> Scenario:
    """A Scenario for ``model`` (preset name, ModelSpec or nn.Module) on ``world_size`` ranks.

    device: preset whose memory bandwidth prices compress/decompress and whose FLOPs price the
        step, unless ``profile`` (a calibrated Profile or its JSON path) gives measured costs.
    link / bandwidth_gbps / latency_us: the network (a preset, optionally with numbers
        overridden, or custom numbers); without any, the profile's measured network, else 100gbe.
        A preset's bandwidth is nominal: each collective kind achieves its transport's measured
        fraction of it (presets.TRANSPORTS); a custom bandwidth is taken as achieved.
    efficiency: the fraction of the link's bandwidth every collective achieves, in place of the
        transport's per-kind fractions (e.g. from the cluster's own all-reduce measurement).
    gpus_per_node > 1: ranks of a node share ``intra_link`` (a preset or Link; default the
        device's node link, e.g. nvlink4): collectives in two levels, or all over it in one node;
        ``intra_gbps``: its bandwidth instead of the preset's (as achieved: efficiency 1).
    sharded: FSDP2 with gradcomp.fsdp instead of DDP (see costmodel).
    compute: measured step phases; else the profile's (same model), else estimated from FLOPs.
    bucket_cap_mb: the DDP's ``bucket_cap_mb``; None: DDP's default (costmodel.ddp_buckets).
    """
    spec = _model_spec(model)
    dev = presets.device(device)
    if isinstance(profile, (str, Path)):
        profile = Profile.load(profile)
    costs = profile if profile is not None else preset_profile(dev)
    chosen = _link(link, bandwidth_gbps, latency_us)
    gather = reduce_scatter = alltoall = None
    if chosen is None and profile is not None and profile.network:
        chosen, gather = profile.network["allreduce"], profile.network["allgather"]
        reduce_scatter, alltoall = profile.network.get("reduce_scatter"), profile.network.get("alltoall")
    elif chosen is not None and link is None and profile is not None and profile.network:
        # custom bandwidth on a calibrated network: keep its measured efficiency and latencies
        measured = Network(profile.world_size, profile.network["allreduce"],
                           allgather_link=profile.network["allgather"],
                           reduce_scatter_link=profile.network.get("reduce_scatter"),
                           alltoall_link=profile.network.get("alltoall")).with_bandwidth(bandwidth_gbps)
        chosen, gather, reduce_scatter = measured.link, measured.allgather_link, measured.reduce_scatter_link
        alltoall = measured.alltoall_link
        if latency_us is not None:
            chosen = Link(chosen.name, chosen.bandwidth_gbps, latency_us, chosen.efficiency, chosen.per_byte_s)
    if gather is not None and algorithm == "auto":
        algorithm = "ring"  # a measured network was fitted with the ring formulas
    if chosen is None:
        chosen = presets.link("100gbe")
    if efficiency is not None:
        check_number("", "efficiency", efficiency, 0, 1, low_open=True)
    if gather is None:  # a preset or custom link: each collective kind at its achieved fraction
        kinds = presets.collective_links(chosen, efficiency)
        chosen, gather, alltoall = kinds["allreduce"], kinds["allgather"], kinds["alltoall"]
    elif efficiency is not None:
        raise ValueError("efficiency applies to a preset or custom link, not to a calibrated network")
    if (intra_link is not None or intra_gbps is not None) and gpus_per_node < 2:
        raise ValueError("an intra-node link needs gpus_per_node > 1")
    intra = None
    if gpus_per_node > 1:
        intra = intra_link if isinstance(intra_link, Link) else presets.link(intra_link or dev.node_link)
        if intra_gbps is not None:
            check_number("", "intra-node bandwidth", intra_gbps, 0, low_open=True, finite=True)
            intra = replace(intra, name="custom-intra", bandwidth_gbps=intra_gbps, efficiency=1.0, transport="")
    network = Network(world_size, chosen, gpus_per_node, intra, gather, algorithm, reduce_scatter,
                      alltoall_link=alltoall)
    if compute is None and profile is not None and profile.compute and profile.compute.model == spec.name:
        compute = profile.compute
    if compute is None:
        compute = estimated_compute(spec, dev)
    return Scenario(spec, network, costs, compute, bucket_cap_mb, sharded=sharded)
