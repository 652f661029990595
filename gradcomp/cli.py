"""The ``gradcomp`` command: one subcommand per task.

    gradcomp breakeven --model gpt2-1.5b --world-size 64 --device h100 --link 100gbe
    gradcomp breakeven --model resnet50 --link 10gbe --sweep bandwidth --plot sweep.png
    gradcomp calibrate --model mlp --out profile.json  # then: gradcomp breakeven --profile profile.json

A subcommand is a (configure, run) pair in SUBCOMMANDS: ``configure(parser)`` adds its arguments,
``run(args)`` does the work and returns the exit status. Bad input ends with a one-line error
and status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from .methods import UNCOMPRESSED
from .numfmt import plain
from .progress import Progress, stage

SUBCOMMANDS: dict = {}


def subcommand(name: str, help: str):
    """Register ``configure`` (decorated) with its ``run`` as subcommand ``name``."""
    def wrap(configure):
        SUBCOMMANDS[name] = (help, configure)
        return configure
    return wrap


def _option_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_options(items: list[str]) -> dict[str, dict]:
    """``["topk.ratio=0.001", "powersgd.rank=8"]`` -> {"topk": {"ratio": 0.001}, "powersgd": {"rank": 8}}."""
    options: dict[str, dict] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        method, dot, option = key.partition(".")
        if not sep or not dot or not method or not option:
            raise ValueError(f"--set takes method.option=value (e.g. topk.ratio=0.001), got {item!r}")
        options.setdefault(method.strip().lower(), {})[option.strip()] = _option_value(value.strip())
    return options


def parse_choices(methods: str | None, options: dict[str, dict], hierarchical: bool = False,
                  sharded: bool = False):
    """The Choices named by ``--methods`` (comma-separated [hier:]method[:scheme]), all when None;
    with ``hierarchical`` each compressed one also in its hierarchical form; ``sharded``: the
    methods FSDP can use; uncompressed ``none`` always first (the baseline)."""
    from dataclasses import replace

    from .analysis import Choice, default_choices
    from .analysis.costmodel import HIERARCHICAL_PREFIX
    from .schemes import SCHEMES

    if methods:
        choices = []
        for name in (n.strip().lower() for n in methods.split(",") if n.strip()):
            method = name.removeprefix(HIERARCHICAL_PREFIX).partition(":")[0]
            choices.append(Choice.parse(name, options.get(method)))
        if hierarchical:
            choices += [replace(c, hierarchical=True) for c in choices
                        if not c.hierarchical and c.method != UNCOMPRESSED and not SCHEMES[c.scheme].per_tensor
                        and replace(c, hierarchical=True) not in choices]
    else:
        choices = [replace(c, options=options.get(c.method, {}))
                   for c in default_choices(hierarchical, sharded)]
    if not any(c.method == UNCOMPRESSED for c in choices):
        choices.insert(0, Choice(UNCOMPRESSED))
    named = {c.method for c in choices}
    stray = sorted(set(options) - named)
    if stray:
        raise ValueError(f"--set names method(s) {stray} that are not analysed ({', '.join(sorted(named))})")
    return choices


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _level_values(flag):
    """``12.5`` (no level) or ``intra=150,inter=11``: {level or None: value > 0}, one line errors."""
    def parse(text):
        values = {}
        for item in (part.strip() for part in str(text).split(",")):
            level, sep, number = item.rpartition("=")
            level = level.strip().lower() if sep else None
            if level not in (None, "intra", "inter"):
                raise argparse.ArgumentTypeError(f"levels are intra= and inter=, got {item!r}")
            if level in values or (None in values or (values and level is None)):
                raise argparse.ArgumentTypeError(f"give each level once (a bare number is the inter level), got {text!r}")
            values[level] = _positive(float)(number.strip())
        return values
    return parse


def _non_negative(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


# ---- breakeven ----------------------------------------------------------------------------------

@subcommand("breakeven", "predict step time and speedup of every compressor on a model and network")
def configure_breakeven(p: argparse.ArgumentParser):
    from .analysis import DEVICES, LINKS, MODELS, NODES

    p.add_argument("--model", help=f"preset model: {', '.join(MODELS)}; or a harness workload "
                                   "(gradcomp.emulate.WORKLOADS, package.module:factory) (default: the profile's)")
    p.add_argument("--world-size", type=_positive(int),
                   help="number of ranks (default: the profile's measured group, else 8)")
    p.add_argument("--device", help=f"preset device: {', '.join(DEVICES)} (default: the node's, else h100)")
    p.add_argument("--node", help=f"preset node: {', '.join(NODES)}; sets the device, --gpus-per-node, "
                                  "--intra-link and the default --link")
    p.add_argument("--link", help=f"preset link: {', '.join(LINKS)} (default: the profile's network, else 100gbe)")
    p.add_argument("--bandwidth-gbps", type=_positive(float),
                   help="link bandwidth per rank, Gbit/s: nominal with --link (each collective achieves its "
                        "transport's measured fraction), achieved without")
    p.add_argument("--efficiency", type=_positive(float),
                   help="the fraction of the link's bandwidth every collective achieves (0-1], in place of the "
                        "transport's measured fractions (e.g. your all-reduce's bus bandwidth / the line rate)")
    p.add_argument("--latency-us", type=_non_negative, help="link latency (alpha), microseconds")
    p.add_argument("--busbw", type=_level_values("--busbw"), metavar="GBPS",
                   help="nccl-tests all_reduce_perf bus bandwidth (its busbw column, GB/s) at the model's message "
                        "size (--busbw-mb; default: a full DDP bucket, 25 MiB or --bucket-mb): over all ranks (a bare number, "
                        "or inter=GBPS), inside one node (intra=GBPS), or both (intra=150,inter=11); fits the achieved "
                        "link the model's collectives use")
    p.add_argument("--busbw-mb", type=_positive(float),
                   help="the message size (MB, 1e6 bytes) --busbw was read at (default: a full DDP bucket, 26.2 MB or "
                        "--bucket-mb)")
    p.add_argument("--allreduce-ms", type=_level_values("--allreduce-ms"), metavar="MS",
                   help="a measured all-reduce of the model's whole gradient (fp32, or 16-bit with --baseline fp16/"
                        "bf16), ms: over all ranks (a bare number, or inter=MS) or inside one node (intra=MS); fits "
                        "the achieved link as --busbw does")
    p.add_argument("--gpus-per-node", type=_positive(int),
                   help="ranks per node sharing the device's node link (two-level collectives; default 1)")
    p.add_argument("--intra-link", help="preset link inside a node (default: the device's, e.g. nvlink4)")
    p.add_argument("--intra-gbps", type=_positive(float),
                   help="achieved bandwidth inside a node per rank, Gbit/s, instead of the preset's")
    p.add_argument("--hierarchical", action="store_true",
                   help="also show each method compressing only between nodes (hier:..., "
                        "gradcomp.hooks.hierarchical); needs --gpus-per-node > 1")
    p.add_argument("--sharded", action="store_true",
                   help="FSDP2 (gradcomp.fsdp) instead of DDP: parameter all-gathers plus a "
                        "compressed reduce-scatter")
    p.add_argument("--algorithm", default="auto", help="all-reduce: auto, ring, tree, two-level")
    p.add_argument("--methods", help="comma-separated method[:scheme], e.g. fp16,int8:twophase,powersgd")
    p.add_argument("--set", action="append", default=[], metavar="METHOD.OPTION=VALUE",
                   help="a method option, e.g. topk.ratio=0.001 (repeatable)")
    p.add_argument("--profile", help="a JSON profile written by `gradcomp calibrate`")
    p.add_argument("--implementation", metavar="FAMILY:COMPRESSOR[:memory]",
                   help="price another implementation's compressor as its code runs it, from the device preset "
                        "(gradcomp.analysis.implementations): grace-tf:topk, grace-tf:signsgd, grace-tf:u8bit, "
                        "grace-tf:powersgd (:memory with its error feedback), deepspeed-2020:onebit (1-bit Adam's "
                        "2020 compressed all-reduce). It prices the gradcomp method that sends the same bytes (topk, "
                        "int8, int8, powersgd; sign)")
    p.add_argument("--compute-ms", type=_positive(float),
                   help="measured forward+backward ms per step (split 1:2), instead of the FLOP estimate")
    p.add_argument("--optimizer-ms", type=_non_negative,
                   help="measured optimizer ms per step, after the exchange (with --compute-ms; default 0)")
    p.add_argument("--overlap-ms", type=_non_negative,
                   help="ms of --compute-ms that the exchange can overlap: the last backward (default 2/3 of it, "
                        "as DDP overlaps backward; 0 for a framework that exchanges after backward, e.g. "
                        "DeepSpeed's fp16 engine and 1-bit Adam)")
    p.add_argument("--margin", type=_positive(float), default=None,
                   help="the verdict says pays only at a speedup of at least this, does not pay at most its "
                        "inverse, marginal between (default 1.05)")
    p.add_argument("--baseline", default="none",
                   help="the choice speedups are measured against (default none = fp32: fp32 all-reduce; fp16 or "
                        "bf16 for a mixed-precision run whose gradients are already 16-bit: no cast charged)")
    p.add_argument("--quality", metavar="FILE",
                   help="your own quality evidence (JSON rows, docs/breakeven.md): its steps factors override "
                        "gradcomp's measured table")
    p.add_argument("--optimizer-family", choices=["adamw", "sgd"],
                   help="the optimizer your run trains with, which picks the nearest measured setting (default: "
                        "adamw for transformer presets, sgd for ResNet/VGG ones, none otherwise)")
    p.add_argument("--bucket-mb", type=_positive(float), default=None,
                   help="DDP's bucket_cap_mb, MB (default: DDP's own, a 1 MB first bucket then 25)")
    p.add_argument("--sweep", choices=["bandwidth"], help="step time against bandwidth, with crossovers")
    p.add_argument("--sweep-gbps", default="0.1,1000", help="sweep range lo,hi in Gbit/s (default 0.1,1000)")
    p.add_argument("--plot", default="gradcomp-sweep.png",
                   help="PNG written by --sweep when matplotlib is installed (default gradcomp-sweep.png)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--optimizers", help="also gradcomp.optim optimizers, comma-separated: zeroone,dgc,diloco "
                                        "(bytes and step time over --run-steps, warm-up included)")
    p.add_argument("--run-steps", type=_positive(int), default=1000,
                   help="run length the optimizers' warm-up is amortised over (default 1000)")
    p.add_argument("--optimizer-set", action="append", default=[], metavar="OPTIMIZER.OPTION=VALUE",
                   help="an optimizer option, e.g. zeroone.warmup_steps=32 (repeatable)")
    return run_breakeven


def _scenario_from_args(args):
    from .analysis import MODELS, Compute, Profile, from_module, make_scenario, node, presets

    profile = Profile.load(args.profile) if args.profile else None
    model = args.model
    if model is None:
        if profile is None or profile.compute is None or not profile.compute.model:
            raise ValueError("--model is required: give a preset (--model gpt2-1.5b), or a profile "
                             "measured with one (gradcomp calibrate --model mlp --out profile.json)")
        model = profile.compute.model
    compute = None
    for flag, value in (("--optimizer-ms", args.optimizer_ms), ("--overlap-ms", args.overlap_ms)):
        if value is not None and not args.compute_ms:
            raise ValueError(f"{flag} needs --compute-ms (the measured forward+backward)")
    if args.compute_ms:
        overlap = 2 * args.compute_ms / 3 if args.overlap_ms is None else args.overlap_ms
        if overlap > args.compute_ms:
            raise ValueError(f"--overlap-ms ({plain(overlap, 6)}) cannot exceed "
                             f"--compute-ms ({plain(args.compute_ms, 6)})")
        compute = Compute((args.compute_ms - overlap) / 1e3, overlap / 1e3, (args.optimizer_ms or 0.0) / 1e3,
                          str(model))
    if model not in MODELS:  # a workload the harness can build (e.g. one a profile was measured on)
        from .emulate import WORKLOADS, workload

        if model not in WORKLOADS and ":" not in model:
            raise ValueError(f"unknown model {model!r}; choose a preset ({', '.join(MODELS)}) or a "
                             f"workload ({', '.join(WORKLOADS)}, or package.module:factory)")
        model = from_module(workload(model, 1)[0], model)
    world_size = args.world_size or (profile.world_size if profile is not None and profile.world_size else 8)
    device, link, gpus_per_node, intra_link = args.device, args.link, args.gpus_per_node, args.intra_link
    bandwidth = args.bandwidth_gbps
    if args.node:
        preset = node(args.node)
        device, gpus_per_node, intra_link = device or preset.device, gpus_per_node or preset.gpus, \
            intra_link or preset.intra
        if link is None and args.bandwidth_gbps is None and profile is None:
            link = preset.inter
            if preset.gpus_per_nic > 1:  # a NIC shared by several GPUs: each rank's share of it
                bandwidth = presets.link(link).bandwidth_gbps / preset.gpus_per_nic
    gpus_per_node = gpus_per_node or 1
    if args.hierarchical and args.sharded:
        raise ValueError("--hierarchical (a DDP hook) and --sharded (FSDP) exclude each other")
    if args.hierarchical and gpus_per_node < 2:
        raise ValueError("--hierarchical needs --gpus-per-node > 1")
    scenario = make_scenario(model, world_size, device or "h100", link, bandwidth,
                             args.latency_us, gpus_per_node, args.algorithm, profile, compute,
                             args.bucket_mb, intra_link=intra_link, sharded=args.sharded,
                             efficiency=args.efficiency, intra_gbps=args.intra_gbps)
    if getattr(args, "implementation", None):
        from .analysis import implementations

        if profile is not None:
            raise ValueError("--implementation prices another implementation from the device preset; "
                             "--profile gives measured costs: give one of them")
        implementation = implementations.parse(args.implementation)
        options = parse_options(args.set).get(implementation.method, {})
        scenario = implementations.apply(scenario, implementation, presets.device(device or "h100"), options)
    scenario, args.measured_links = _measured_links(args, scenario)
    return scenario


def _measured_links(args, scenario):
    """``--busbw`` and ``--allreduce-ms`` fitted to the levels they measure (gradcomp.analysis.linkfit):
    (the scenario with those levels at their achieved bandwidth, {level: Measured})."""
    from dataclasses import replace

    from .analysis import linkfit
    from .analysis.costmodel import DDP_BUCKET_CAP_MB

    busbw, allreduce = getattr(args, "busbw", None) or {}, getattr(args, "allreduce_ms", None) or {}
    if getattr(args, "busbw_mb", None) is not None and not busbw:
        raise ValueError("--busbw-mb needs --busbw (the bus bandwidth read at that size)")
    if not (busbw or allreduce):
        return scenario, {}
    net = scenario.network

    def level_of(level):
        if level is None:
            return "intra" if net.single_node else "inter"
        if level == "intra" and net.intra is None:
            raise ValueError("an intra= measurement needs --gpus-per-node > 1 (or --node)")
        if level == "inter" and net.single_node:
            raise ValueError(f"all {net.world_size} ranks are inside one node: there is no inter-node level "
                             "(give the measurement as intra= or a bare number)")
        return level

    busbw = {level_of(k): v for k, v in busbw.items()}
    allreduce = {level_of(k): v for k, v in allreduce.items()}
    for flag, value, level in (("--bandwidth-gbps", args.bandwidth_gbps, "inter"),
                               ("--efficiency", args.efficiency, "inter"),
                               ("--intra-gbps", args.intra_gbps, "intra")):
        if value is not None and (level in busbw or level in allreduce):
            which = "--busbw" if level in busbw else "--allreduce-ms"
            raise ValueError(f"{which} measures the {level} link that {flag} also sets: give one of them")
    grad_bytes = scenario.model.numel * (2 if args.baseline.strip().lower() in ("fp16", "bf16") else 4)
    bucket_bytes = min((args.bucket_mb or DDP_BUCKET_CAP_MB) * 2 ** 20, grad_bytes)  # DDP's message: a full bucket
    busbw_bytes = args.busbw_mb * 1e6 if getattr(args, "busbw_mb", None) else bucket_bytes
    measured = {}
    for level in ("intra", "inter"):  # the intra level first: the inter fit runs over it
        ranks = (net.node_size if level == "intra" and net.two_level else net.world_size)
        fits = []
        if level in busbw:
            seconds = linkfit.busbw_seconds(busbw[level], busbw_bytes, ranks)
            what = (f"--busbw {plain(busbw[level], 6)} {linkfit.BUSBW_UNIT} at {plain(busbw_bytes / 1e6, 4)} MB")
            fits.append(linkfit.Measured(level, what, busbw_bytes, seconds, ranks,
                                         linkfit.fit_level(net, level, busbw_bytes, seconds)))
        if level in allreduce:
            seconds = allreduce[level] / 1e3
            what = f"--allreduce-ms {plain(allreduce[level], 6)} of {plain(grad_bytes / 1e6, 4)} MB"
            fits.append(linkfit.Measured(level, what, grad_bytes, seconds, ranks,
                                         linkfit.fit_level(net, level, grad_bytes, seconds)))
        if not fits:
            continue
        if len(fits) == 2 and max(f.gbps for f in fits) > 1.25 * min(f.gbps for f in fits):
            raise ValueError(f"{fits[0].what} and {fits[1].what} contradict each other on the {level} link: "
                             f"{plain(fits[0].gbps)} against {plain(fits[1].gbps)} Gbit/s achieved (more than 1.25x "
                             "apart); check both, or give one")
        fit = fits[-1]  # both agreeing: the all-reduce of the model's own gradients
        net = linkfit.with_level(net, level, fit.gbps)
        measured[level] = replace(fit, what=" and ".join(f.what for f in fits)) if len(fits) == 2 else fit
    return replace(scenario, network=net), measured


def _link_sources(args, scenario) -> dict:
    """Per level the run uses (``intra``, ``inter``): where its achieved bandwidth comes from:
    ``measured`` (--busbw, --allreduce-ms: linkfit.Measured's record), ``stated`` (--bandwidth-gbps
    without a preset link, --efficiency, --intra-gbps, a calibrated profile) or ``preset`` (a preset
    link at its transport's fraction of nominal: a guess)."""
    net, measured = scenario.network, getattr(args, "measured_links", {}) or {}
    used = []
    if net.intra is not None and (net.two_level or net.single_node):
        used.append(("intra", net.intra, net.intra, net.intra))
    if not net.single_node:
        used.append(("inter", net.link, net.allgather_link or net.link, net.alltoall_link or net.allgather_link or net.link))
    out = {}
    for level, link, gather, alltoall in used:
        if level in measured:
            out[level] = measured[level].to_dict() | {"link": link.name, "latency_us": link.latency_us}
        elif link.transport and not (level == "inter" and args.efficiency is not None):
            out[level] = {"level": level, "source": "preset", "link": link.name, "transport": link.transport,
                          "nominal_gbps": link.bandwidth_gbps, "latency_us": link.latency_us,
                          "fractions": {"allreduce": link.efficiency, "allgather": gather.efficiency,
                                        "alltoall": alltoall.efficiency}}
        else:
            given = ("--intra-gbps" if level == "intra" else "--efficiency" if args.efficiency is not None else
                     "the profile's calibration" if args.profile and args.bandwidth_gbps is None else "--bandwidth-gbps")
            out[level] = {"level": level, "source": "stated", "given": given, "link": link.name,
                          "achieved_gbps": link.achieved_gbps, "latency_us": link.latency_us}
    return out


def _links_text(links: dict) -> str:
    """One line: each level's achieved bandwidth and whether it is measured, stated or a preset's guess."""
    parts = []
    for level, info in links.items():
        if info["source"] == "measured":
            parts.append(f"{level} measured: {info['given']} on {info['ranks']} ranks -> "
                         f"{plain(info['achieved_gbps'], 4)} "
                         f"Gbit/s achieved per rank, every collective ({plain(info['latency_us'])} us latency kept)")
        elif info["source"] == "preset":
            parts.append(f"{level} a preset guess: {info['link']} {plain(info['nominal_gbps'], 4)} Gbit/s nominal x"
                         f"{plain(info['fractions']['allreduce'])} ({info['transport']}'s typical fraction; measure it: "
                         "--busbw, --allreduce-ms)")
        else:
            parts.append(f"{level} as given ({info['given']}): {plain(info['achieved_gbps'], 4)} Gbit/s achieved")
    return "links: " + "; ".join(parts)


def _link_flips(args, scenario, choices, margin, baseline, evidence, methods) -> dict:
    """Where a level is a preset's guess with a published spread (linkfit.PLAUSIBLE_FRACTIONS), the
    verdicts at both ends of it; each record whose verdict differs within it is rewritten to say
    so (``verdict_kind`` "depends on the link", ``verdict_range`` the ends), the others get
    ``verdict_range`` too. Returns {method: record} of the rewritten ones."""
    from dataclasses import replace

    from .analysis import estimate, linkfit

    ranged = {level: linkfit.PLAUSIBLE_FRACTIONS[info["transport"]]
              for level, info in methods[0]["links"].items()
              if info["source"] == "preset" and info["transport"] in linkfit.PLAUSIBLE_FRACTIONS}
    if not ranged:
        return {}
    ends = {}
    for end in ("low", "high"):
        net = scenario.network
        for level, spread in ranged.items():
            net = linkfit.with_fraction(net, [level], getattr(spread, end))
        ends[end] = {r.method: r for r in estimate(replace(scenario, network=net), choices, crossovers=False,
                                                   margin=margin, baseline=baseline, quality=evidence)}
    range_text = "; ".join(f"{level} x{plain(s.low, 6)}-{plain(s.high, 6)} of nominal on "
                           f"{methods[0]['links'][level]['transport']}: "
                           f"{s.source}" for level, s in ranged.items())
    flips = {}
    for m in methods:
        low, high = ends["low"][m["method"]], ends["high"][m["method"]]
        m["verdict_range"] = {"levels": list(ranged), "fractions": {lvl: [s.low, s.high] for lvl, s in ranged.items()},
                              "low": low.verdict_kind, "high": high.verdict_kind,
                              "sources": {lvl: s.source for lvl, s in ranged.items()}}
        if m["verdict_kind"] == "baseline" or len({low.verdict_kind, m["verdict_kind"], high.verdict_kind}) == 1:
            continue
        fractions = ", ".join(f"{lvl} x{plain(s.low, 6)}-{plain(s.high, 6)}" for lvl, s in ranged.items())
        m["verdict_at_preset"], m["verdict_kind"], m["pays"] = m["verdict"], "depends on the link", False
        m["verdict"] = (f"depends on the link: {low.verdict_kind} at the low end, {high.verdict_kind} at the high "
                        f"end ({fractions} of nominal), {m['verdict_at_preset'].split(':')[0]} at the preset's guess")
        m["range_text"] = range_text
        flips[m["method"]] = m
    return flips


def _sweep_grid(text: str, points: int = 25) -> list[float]:
    import numpy

    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--sweep-gbps takes lo,hi in Gbit/s, got {text!r}") from None
    if not 0 < lo < hi or not math.isfinite(hi):
        raise ValueError(f"--sweep-gbps needs 0 < lo < hi, got {text!r}")
    return numpy.geomspace(lo, hi, points).tolist()


def _achieved(link, gather=None, alltoall=None) -> str:
    """``x0.5 all-reduce`` or ``x0.93 all-reduce, 0.96 all-to-all``: the fraction of the nominal
    bandwidth each collective kind achieves, those that differ from the all-reduce's named."""
    text = f"x{plain(link.efficiency)} all-reduce"
    for name, other in (("all-gather", gather), ("all-to-all", alltoall)):
        if other is not None and other.efficiency != link.efficiency and other.bandwidth_gbps == link.bandwidth_gbps:
            text += f", {plain(other.efficiency)} {name}"
    return text


def _describe(scenario) -> str:
    """One line: the model, ranks, links (nominal Gbit/s, the achieved fractions, latency), compute."""
    n, c = scenario.network, scenario.compute
    if n.intra is not None and n.single_node:
        where = f" in one node over {n.intra.name} {plain(n.intra.bandwidth_gbps, 4)} Gbit/s {_achieved(n.intra)}"
    elif n.two_level:
        where = (f" ({n.gpus_per_node} per node over {n.intra.name} {plain(n.intra.bandwidth_gbps, 4)} Gbit/s "
                 f"{_achieved(n.intra)})")
    else:
        where = ""
    link = "" if n.single_node else (
        f", link {n.link.name} {plain(n.link.bandwidth_gbps, 4)} Gbit/s "
        f"{_achieved(n.link, n.allgather_link, n.alltoall_link)} {plain(n.link.latency_us)} us")
    return (f"{scenario.model.name} ({scenario.model.numel / 1e6:.1f}M parameters) on {n.world_size} ranks"
            f"{where}{', FSDP2' if scenario.sharded else ''}, {scenario.profile.device}{link}; compute "
            f"{(c.forward_s + c.backward_s) * 1e3:.1f} ms fwd+bwd")


def _evidence(args, scenario):
    from .analysis.quality import Evidence, optimizer_family

    family = args.optimizer_family or optimizer_family(scenario.model.name)
    return Evidence.load(family, args.quality)


def _step_source(args, scenario) -> str:
    """Where the step times come from: the kernels' and network's costs, and the compute."""
    costs = f"profile {args.profile} (measured)" if args.profile else f"preset {scenario.profile.device}"
    if getattr(args, "implementation", None):
        from .analysis import implementations

        impl = implementations.parse(args.implementation)
        costs += (f", {impl.method} priced as {args.implementation}'s ops (estimated from its code: "
                  "gradcomp.analysis.implementations)")
    if args.compute_ms:
        compute = "--compute-ms (measured)"
    elif args.profile and scenario.compute is not None and scenario.compute.model == scenario.model.name and \
            scenario.profile.compute is scenario.compute:
        compute = "the profile's (measured)"
    else:
        compute = "FLOPs at the device's peak x MFU (estimated)"
    return f"costs: {costs}; compute: {compute}"


def _factor_text(record) -> str:
    from .analysis.breakeven import missing_quality

    if record.get("verdict_kind") == "baseline":
        return "1 (target)"
    if record.get("steps_factor_reached") is None:
        return missing_quality(record.get("quality") or {})
    if not record["steps_factor_reached"]:
        return f">{plain(record['steps_factor_within'])} (not reached)"
    return f"{record['steps_factor']:.2f}"


def _to_target_text(record) -> str:
    value = record.get("time_to_target")
    return "-" if value is None else f"{value:.2f}"


def _short_verdict(verdict: str) -> str:
    return verdict.split(":")[0]


def _evidence_lines(records, label_key: str) -> list[str]:
    """One line per distinct piece of evidence: which rows it serves, where it was measured, its
    factor, the files; the rows with none together."""
    from .analysis.breakeven import loss_gap_text

    groups: dict = {}
    unmeasured = []
    for r in records:
        q = r.get("quality") or {}
        if q.get("source") in (None, "baseline", "reference"):
            continue
        if q["source"] == "none":
            unmeasured.append(r[label_key])
            continue
        key = (q["source"], q["row"]["config"], q["row"].get("workload"), q.get("note", ""))
        groups.setdefault(key, (q, []))[1].append(r[label_key])
    lines = []
    for (source, config, _, note), (q, labels) in groups.items():
        f = q["steps_factor"]
        factor = (f"unresolved ({q['unresolved']})" if q.get("unresolved") else
                  f"{f['value']:.2f}x the steps" if f["reached"] else f"target not reached within {plain(f['within'])}x")
        spread = q.get("spread") or {}
        seeds = f", {spread['reached']} of {spread['of']} seeds reached" if spread.get("of", 1) > 1 else ""
        gap = q.get("final_gap")
        gap_text = loss_gap_text(gap)
        where = q["files"][0].rsplit("/", 1)[0] if q.get("files") else ""
        lines.append(f"  {', '.join(labels)}: {factor}{seeds}{gap_text}; {source}: {config}, {q['description']}"
                     + (f" ({where})" if where else "") + (f"; {note}" if note else ""))
    if unmeasured:
        lines.append(f"  {', '.join(unmeasured)}: quality unmeasured (no recorded run of the setting; "
                     "--quality FILE gives yours)")
    return lines


def run_breakeven(args) -> int:
    from tabulate import tabulate

    from .analysis import Choice, estimate, simulate
    from .analysis.breakeven import (DEFAULT_MARGIN, _Comparison, baseline_name, baseline_scenario,
                                     breakeven_gbps, check_margin, judge, parse_baseline)

    scenario = _scenario_from_args(args)
    margin = check_margin(DEFAULT_MARGIN if args.margin is None else args.margin)
    options = parse_options(args.set)
    baseline = parse_baseline(args.baseline, options.get(args.baseline.strip().lower().partition(":")[0]))
    choices = parse_choices(args.methods, options, args.hierarchical, args.sharded)
    if baseline not in choices:
        choices.insert(0, baseline)
    evidence = _evidence(args, scenario)
    step_source = _step_source(args, scenario)
    base_name = baseline_name(baseline)
    base_scenario = baseline_scenario(scenario, baseline)
    if args.sweep:
        return _run_sweep(args, scenario, base_scenario, baseline, choices, evidence, margin, step_source)
    records = estimate(scenario, choices, margin=margin, baseline=baseline, quality=evidence)
    optimizers = _optimizer_estimates(scenario, args, baseline, base_scenario)
    links = _link_sources(args, scenario)
    methods = [r.to_dict() | {"step_source": step_source, "links": links} for r in records]
    flips = _link_flips(args, scenario, choices, margin, baseline, evidence, methods)
    opt_records = None
    if optimizers is not None:
        from .analysis.breakeven import judge_optimizer

        opt_records = []
        for o in optimizers:
            j = judge_optimizer(o.optimizer, o.options, o.speedup, margin, evidence, base_name,
                                scenario.network.link.bandwidth_gbps)
            opt_records.append(o.to_dict() | j.fields() | {
                "verdict": j.text, "pays": j.kind == "pays", "baseline": baseline.label, "baseline_name": base_name,
                "step_source": step_source})
    if args.json:
        print(json.dumps(methods if opt_records is None else {"methods": methods, "optimizers": opt_records},
                         indent=2))
        return 0
    print(_describe(scenario))
    print(_links_text(links))
    exact = any(r.exact_bytes for r in records)  # hierarchical intra-node, FSDP parameter gathers
    rows = [[r.method, f"{r.wire_bytes / 2 ** 20:.1f}", *([f"{r.exact_bytes / 2 ** 20:.1f}"] if exact else []),
             f"{r.exposed_comm_s * 1e3:.1f}", f"{r.compress_s * 1e3:.2f}", f"{r.step_s * 1e3:.1f}",
             f"{r.speedup:.2f}", _factor_text(m), _to_target_text(m),
             "" if r.verdict == "baseline" or r.method == UNCOMPRESSED or r.steps_factor_reached is False else
             _crossover_text(r.breakeven_gbps),
             _world_size_text(r), m["verdict"] if m["method"] in flips else _short_verdict(r.verdict)]
            for r, m in zip(records, methods)]
    print(tabulate(rows, headers=["method", "wire MiB", *(["exact MiB"] if exact else []), "exposed ms",
                                  "compress ms", "step ms", "step x", "steps x", "to target x", "pays below Gbit/s",
                                  "verdict flips at ranks", "verdict"], disable_numparse=True))
    if opt_records:
        print(f"\noptimizers that own the exchange (after backward, not overlapped), over {args.run_steps} steps:")
        print(tabulate([[o["optimizer"], ", ".join(f"{k}={v}" for k, v in o["options"].items()),
                         f"{o['wire_bytes_per_step'] / 2 ** 20:.2f}", f"{o['ratio']:.1f}", f"{o['comm_s'] * 1e3:.1f}",
                         f"{o['compress_s'] * 1e3:.2f}", f"{o['step_s'] * 1e3:.1f}", f"{o['speedup']:.2f}",
                         _factor_text(o), _to_target_text(o), _short_verdict(o["verdict"])] for o in opt_records],
                       headers=["optimizer", "options", "wire MiB/step", "ratio", "comm ms", "compress ms",
                                "step ms", "step x", "steps x", "to target x", "verdict"], disable_numparse=True))
    print(f"\nsteps factors (steps to reach the baseline's held-out loss / the baseline's steps), "
          f"optimizer family {evidence.family or 'unknown (--optimizer-family)'}:")
    print("\n".join(_evidence_lines(methods, "method") + _evidence_lines(opt_records or [], "optimizer")))
    if evidence.user and evidence.user.get("null"):  # what the user's calibration resolves
        from .emulate.quality import null_text

        print(f"  {evidence.user_path}: {null_text(evidence.user['null'])}")
    if evidence.user:  # the target its factors are against (a calibration widens it to its null's gap)
        from .analysis.quality import TARGET_TOLERANCE, tolerance_text

        tolerance = evidence.user.get("target_tolerance", TARGET_TOLERANCE)
        print(f"  {evidence.user_path}: target the uncompressed run's final held-out loss {tolerance_text(tolerance)}")
    if not (args.sharded or args.hierarchical):
        from .analysis.auto import auto_plan, format_auto_plan

        print("\nwhat the auto hook would choose (gradcomp.hooks.register(model, \"auto\")):")
        plan = auto_plan(scenario)
        print(format_auto_plan(scenario, plan=plan))
        by_label = {c.label: c for c in choices}
        base_s = simulate(base_scenario, baseline).step_s
        for label in dict.fromkeys(r["choice"] for r in plan):
            if label == UNCOMPRESSED:
                continue
            choice = by_label.get(label) or Choice.parse(label)
            j = judge(choice, base_s / plan[0]["step_s"], margin, evidence, False, base_name,
                      scenario.network.link.bandwidth_gbps)
            text = j.text.replace("step ", "the plan's step ", 1)
            print(f"  {label} on time to target: {text}")
        print(_auto_given_optimizer_text(evidence.family))
    if flips:
        print(f"\nthe verdict depends on the link where it differs within the achieved fractions published clusters "
              f"reached ({flips[next(iter(flips))]['range_text']}): measure the link (--busbw or --allreduce-ms)")
    print(f"\nstep x: step time, over {base_name} (--baseline {baseline.label}); steps x: steps to the baseline's "
          f"held-out loss over its steps;\nto target x: time to target (step time x steps x), over the baseline's; "
          f"verdict on time to target: pays at >= {plain(margin)}x,\ndoes not pay at <= {plain(1 / margin)}x, marginal "
          f"between (--margin); never pays without quality evidence; pays below: where time to target\n"
          f"(step time when unmeasured) crosses the baseline's; step times from {step_source}")
    return 0


def _auto_given_optimizer_text(family: str | None) -> str:
    """What auto weighs besides the plan above when it is given the optimizer (every method), and
    which of those gradcomp's measured runs refuse under ``family`` (either family when None)."""
    from .analysis.auto import OPT_IN, policy_choices, refused_by_evidence

    refused = refused_by_evidence(policy_choices(OPT_IN), family)
    weighed = [m for m in OPT_IN if m not in refused]
    text = (f"  given the optimizer (register(model, \"auto\", optimizer=opt)) auto also weighs {', '.join(OPT_IN)}: "
            f"gradcomp's measured runs refuse {', '.join(refused) or 'none of them'} "
            f"{f'under {family}' if family else 'under either optimizer family'}")
    if weighed:
        text += (f"; {', '.join(weighed)} {'is' if len(weighed) == 1 else 'are'} taken only while the noise ratio "
                 f"measured on your model is within the budget")
    return text


def _run_sweep(args, scenario, base_scenario, baseline, choices, evidence, margin, step_source) -> int:
    """``--sweep bandwidth``: step time and time to target per bandwidth, crossovers, the plot."""
    from tabulate import tabulate

    from .analysis import simulate, sweep_bandwidth
    from .analysis.breakeven import _Comparison, baseline_name, breakeven_gbps, judge, missing_quality

    grid = _sweep_grid(args.sweep_gbps)
    steps = sweep_bandwidth(scenario, choices, grid)
    steps[baseline.label] = [simulate(base_scenario.with_bandwidth(g), baseline).step_s for g in grid]
    compare = _Comparison(scenario, None if base_scenario is scenario else base_scenario, against=baseline)
    base_name = baseline_name(baseline)
    factors, quality, crossovers, notes = {}, {}, {}, {}
    for c in choices:
        if c == baseline:
            factors[c.label], quality[c.label] = 1.0, {"source": "baseline"}
            continue
        j = judge(c, 1.0, margin, evidence, scenario.sharded, base_name, scenario.network.link.bandwidth_gbps)
        f = j.factor
        quality[c.label] = j.evidence
        factors[c.label] = None if f is None else (f.value if f.reached else None)
        if c.method == UNCOMPRESSED:
            continue
        if f is not None and not f.reached:
            crossovers[c.label], notes[c.label] = None, f"target not reached within {plain(f.within)}x steps"
        else:
            crossovers[c.label] = breakeven_gbps(scenario, c, comparison=compare,
                                                 threshold=f.value if f is not None else 1.0)
            notes[c.label] = "time to target" if f is not None else f"per step, quality {missing_quality(j.evidence)}"
    to_target = {label: None if factors.get(label) is None else [s * factors[label] for s in values]
                 for label, values in steps.items()}
    if args.json:
        print(json.dumps({"bandwidth_gbps": grid, "step_s": steps, "breakeven_gbps": crossovers,
                          "steps_factor": factors, "time_to_target_s": to_target, "crossover_on": notes,
                          "quality": quality, "baseline": baseline.label, "step_source": step_source}, indent=2))
        return 0
    print(_describe(scenario))
    rows = [[f"{plain(g)}"] + [f"{steps[label][i] * 1e3:.1f}" for label in steps] for i, g in enumerate(grid)]
    print(tabulate(rows, headers=["Gbit/s"] + [f"{label} ms" for label in steps], disable_numparse=True))
    print()
    print(tabulate([[label, "unmeasured" if quality[label].get("source") == "none" else
                     "unresolved" if quality[label].get("unresolved") else
                     (f"{factors[label]:.2f}" if factors[label] is not None else "not reached"),
                     _crossover_text(g, grid) if not (notes[label].startswith("target")) else "never",
                     notes[label]] for label, g in crossovers.items()],
                   headers=["method", "steps x", "pays below Gbit/s", "on"], disable_numparse=True))
    _plot(grid, to_target_or_steps(steps, to_target), crossovers, args.plot, _describe(scenario), notes,
          link=_your_link(scenario))
    return 0


def _your_link(scenario) -> tuple[float, str]:
    """(Gbit/s on the sweep's axis, label) of the link the command was given: the sweep varies the
    link's nominal bandwidth, each collective keeping its achieved fraction."""
    link = scenario.network.link
    achieved = "" if link.efficiency == 1 else f", x{plain(link.efficiency)} achieved"
    return link.bandwidth_gbps, f"your link: {link.name} {plain(link.bandwidth_gbps, 4)} Gbit/s{achieved}"


def to_target_or_steps(steps: dict, to_target: dict) -> dict:
    """Per label, time to target per baseline step (step x factor) where the factor is known, else
    the step time."""
    return {label: to_target[label] if to_target.get(label) is not None else values for label, values in steps.items()}


def _optimizer_estimates(scenario, args, baseline=None, baseline_scenario=None):
    """gradcomp.optim estimates for ``--optimizers`` (None when not asked for), their speedups
    against ``baseline``'s step."""
    if not args.optimizers:
        if args.optimizer_set:
            raise ValueError("--optimizer-set needs --optimizers")
        return None
    from .analysis.optim import estimate_optimizer

    names = [n.strip().lower() for n in args.optimizers.split(",") if n.strip()]
    options = parse_options(args.optimizer_set)
    stray = sorted(set(options) - set(names))
    if stray:
        raise ValueError(f"--optimizer-set names optimizer(s) {stray} not in --optimizers ({', '.join(names)})")
    return [estimate_optimizer(scenario, name, args.run_steps, baseline=baseline,
                               baseline_scenario=baseline_scenario, **options.get(name, {}))
            for name in names]


def _world_size_text(record) -> str:
    if record.verdict == "baseline" or record.method == UNCOMPRESSED or record.steps_factor_reached is False:
        return ""
    if record.breakeven_world_size is None:
        return "no flip"
    return f"{'stops' if record.pays_below_world_size else 'starts'} at {record.breakeven_world_size}"


def _crossover_text(gbps: float | None, grid: list[float] | None = None) -> str:
    """A crossover (Gbit/s, None: never) for a table: "every bandwidth" at the top of the
    crossover search's range (it still pays there); in the sweep's table (``grid``) marked when
    it lies outside the swept range (the crossover search is not bounded by the sweep)."""
    from .analysis.breakeven import GBPS_RANGE

    if gbps is None:
        return "never"
    if gbps >= GBPS_RANGE[1]:
        return "every bandwidth"
    if grid is None:
        return plain(gbps)
    if gbps > grid[-1]:
        return f"{plain(gbps)} (beyond the sweep's {plain(grid[-1])})"
    if gbps < grid[0]:
        return f"{plain(gbps)} (below the sweep's {plain(grid[0])})"
    return f"{plain(gbps)}"


def _sweep_figure(plt, grid, steps, crossovers, title, notes=None, link=None):
    """Time to target per baseline step (step time x steps factor; the step time where the
    factor is unknown, ``notes`` saying so in the legend) against bandwidth per method, log-log;
    each crossover inside the sweep a dotted vertical line in its method's colour, labelled;
    ``link`` ((Gbit/s, label), the user's own link) a solid black vertical line, labelled."""
    notes = notes or {}
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {}
    for label, values in steps.items():
        note = notes.get(label, "")
        shown = f"step time; {note}" if note.startswith("target") else note  # no time to target to draw
        line, = ax.plot(grid, [v * 1e3 for v in values], label=f"{label} ({shown})" if note else label,
                        linestyle="-" if label == UNCOMPRESSED else ":" if note.startswith(("per", "target")) else "--")
        colours[label] = line.get_color()
    for label, g in crossovers.items():
        if g is not None and grid[0] <= g <= grid[-1]:
            ax.axvline(g, color=colours.get(label, "grey"), linewidth=0.8, linestyle=":",
                       label=f"{label} pays below {plain(g)} Gbit/s")
    if link is not None:
        ax.axvline(link[0], color="black", linewidth=1.5, label=link[1])
    ax.set(xscale="log", yscale="log", xlabel="link bandwidth (nominal), Gbit/s",
           ylabel="time to target per baseline step, ms" if notes else "step time, ms")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8, framealpha=1)
    fig.tight_layout()
    return fig


def _plot(grid, steps, crossovers, path, title, notes=None, link=None) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: install gradcomp[plots] for matplotlib)")
        return
    fig = _sweep_figure(plt, grid, steps, crossovers, title, notes, link)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")


# ---- calibrate ----------------------------------------------------------------------------------

@subcommand("calibrate", "measure compress/decompress, network alpha/beta and model compute; write a profile "
                         "(--quality: measure each method's steps factor on your workload; write quality rows)")
def configure_calibrate(p: argparse.ArgumentParser):
    from .methods import METHODS  # the hooks' methods (gradcomp.hooks.HOOKS), without importing the hooks

    p.add_argument("--out", default=None, help="profile path (default gradcomp-profile.json; with --quality the "
                                               "quality file, default gradcomp-quality.json)")
    q = p.add_argument_group("quality (--quality)", "train --model under the uncompressed all-reduce and each "
                             "candidate hook on local Gloo ranks; the steps each needs to reach the uncompressed "
                             "run's held-out loss (+1%, or + its null's spread), for gradcomp breakeven --quality FILE")
    q.add_argument("--quality", action="store_true",
                   help="measure quality instead of timing: --model is mlp, gpt, resnet20 or package.module:factory")
    q.add_argument("--candidates", nargs="+", metavar="METHOD",
                   help="method[:scheme][,option=value...] each, e.g. fp16 topk,ratio=0.01 topk,ratio=0.01,ef=false "
                        "powersgd,rank=4 (default: fp16 int8 sign topk powersgd); the uncompressed run always")
    q.add_argument("--steps", type=_positive(int), help="training steps per run (default 100)")
    q.add_argument("--seeds", type=int, nargs="+", help="seeds, each a run of every candidate (default 0 1)")
    q.add_argument("--eval-every", type=_positive(int), help="steps between held-out evaluations (default steps/10)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated methods whose hooks to time (default all)")
    p.add_argument("--sizes", default="65536,262144,1048576,4194304",
                   help="tensor sizes in elements for compress timing")
    p.add_argument("--repeats", type=_positive(int), default=5, help="timed repeats per point (median)")
    p.add_argument("--world-size", type=int, default=2,
                   help="Gloo ranks to spawn for the network sweep when not under torchrun (0: skip); with "
                        "--quality the ranks each run trains on (default 2)")
    p.add_argument("--network-sizes", default="4096,65536,1048576,8388608",
                   help="message sizes in bytes for the all-reduce / all-gather / reduce-scatter sweeps")
    p.add_argument("--model", help="time forward/backward of a workload, and PowerSGD's hook on its "
                                   "own buckets: a name from gradcomp.emulate.WORKLOADS or "
                                   "package.module:factory")
    p.add_argument("--batch-size", type=_positive(int), default=None,
                   help="batch size for --model (default 32; with --quality per rank, the workload's default)")
    p.add_argument("--device-name", default="cpu", help="name stored in the profile (default cpu); with "
                                                           "--backend nccl, the preset device whose fixed costs "
                                                           "(launches, PowerSGD's calls and matrices) the profile "
                                                           "takes (e.g. h100); its kernels' speed is measured")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                   help="the collectives swept: gloo (CPU tensors; spawned ranks or torchrun), or nccl (under "
                        "torchrun, one GPU per rank, CUDA-event timing: what your GPUs' links achieve per "
                        "collective)")
    p.add_argument("--link", help="a preset link (e.g. 100gbe) to print each measured collective's fraction of")
    p.add_argument("--kernel-numel", type=_positive(int), default=1 << 25,
                   help="with --backend nccl: elements of the tensor whose compress and decode-sums of 2, 8 and "
                        "64 payloads rank 0 times against a device copy (default 33554432)")
    return run_calibrate


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what} takes comma-separated integers, got {text!r}") from None
    if len(values) < 2 or min(values) < 1:
        raise ValueError(f"{what} needs at least two sizes >= 1, got {text!r}")
    return values


def _in_process_group(backend: str = "gloo") -> bool:
    """True under torchrun (or inside any initialized process group); joins torchrun's group
    with ``backend``."""
    import os

    import torch.distributed as dist

    if not dist.is_initialized() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    return dist.is_initialized()


def _nccl_device():
    """This rank's GPU for an NCCL sweep (torchrun's LOCAL_RANK); ValueError without CUDA or torchrun."""
    import os

    import torch

    if not torch.cuda.is_available():
        raise ValueError("--backend nccl needs CUDA GPUs (one per rank)")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError("--backend nccl runs under torchrun (e.g. torchrun --nproc-per-node 8 -m gradcomp.cli "
                         "calibrate --backend nccl ...), one rank per GPU")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def _measure_network(world_size: int, sizes: list[int], repeats: int, backend: str = "gloo"):
    """(links, world size) from a collective sweep: on the live process group when there is one
    (``nccl``: on this rank's GPU, CUDA-event timing), else on ``world_size`` spawned Gloo ranks
    (0: skipped, (None, None))."""
    import torch.distributed as dist

    from .analysis import calibrate
    from .emulate import launch_ranks

    device = _nccl_device() if backend == "nccl" else None
    if _in_process_group(backend):
        world = dist.get_world_size()
        if world < 2:
            return None, None
        sweep = calibrate.sweep_collectives(sizes, repeats, device=device)
        return calibrate.fit_sweep(world, {"sizes": sizes, **sweep}), world
    if world_size == 0:
        return None, None
    result = launch_ranks("gradcomp.analysis.calibrate:network_worker", world_size,
                          {"sizes": sizes, "repeats": repeats})[0]
    return calibrate.fit_sweep(world_size, result), world_size


def _rank_alone_group():
    """A process group of this process alone, for timing hooks without a network: a new group
    inside a process group (a collective call), else a one-rank Gloo group on 127.0.0.1."""
    import torch.distributed as dist

    from .analysis import calibrate
    from .emulate import LOOPBACK, free_port

    if _in_process_group():
        return calibrate.single_rank_groups()
    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{free_port()}", rank=0, world_size=1)
    return dist.group.WORLD


QUALITY_DEFAULTS = {"candidates": ["fp16", "int8", "sign", "topk", "powersgd"], "steps": 100, "seeds": [0, 1]}


def run_calibrate_quality(args) -> int:
    """``gradcomp calibrate --quality``: the quality file of --model's candidates."""
    import os

    from .emulate import quality as qc

    if not args.model:
        raise ValueError(f"--quality needs --model: {', '.join(qc.WORKLOADS)} or package.module:factory")
    if args.backend != "gloo" or _launched():
        raise ValueError("--quality trains on local Gloo ranks it starts itself: run it without torchrun and "
                         "without --backend nccl")
    if args.world_size < 2:
        raise ValueError(f"--quality trains on --world-size ranks, at least 2; got {args.world_size}")
    seeds = args.seeds if args.seeds is not None else QUALITY_DEFAULTS["seeds"]
    if any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must be distinct integers >= 0, got {' '.join(map(str, seeds))}")
    steps = args.steps or QUALITY_DEFAULTS["steps"]
    if args.eval_every is not None and args.eval_every > steps:
        raise ValueError(f"--eval-every ({args.eval_every}) must not exceed --steps ({steps})")
    candidates = [qc.Candidate.parse(c) for c in (args.candidates or QUALITY_DEFAULTS["candidates"])]
    stage(f"loading {args.model}")
    keywords = qc.workload(args.model, args.batch_size, args.world_size)
    description = keywords.pop("description", args.model)
    out = args.out or "gradcomp-quality.json"
    if os.path.isdir(out):
        raise ValueError(f"--out {out} is a folder; give the quality file's path")
    runs = (2 + len([c for c in candidates if c.method != "none"])) * len(seeds)  # the baseline and the null too
    print(f"calibrating {args.model} ({description}): {runs} runs of {steps} steps on {args.world_size} Gloo ranks",
          file=sys.stderr)
    stage(f"training {runs} runs of {steps} steps")
    table = qc.calibrate_quality(**keywords, candidates=candidates, steps=steps, seeds=seeds,
                                 world_size=args.world_size, eval_every=args.eval_every, workload=args.model,
                                 out=out, progress=lambda text: stage(f"training: {text}"))
    print(f"quality file written to {out} ({table['calibration']['seconds']:.0f} s)")
    print(qc.summary(table))
    family = table["calibration"]["optimizer_family"]
    use = f" --optimizer-family {family}" if family else ""
    print(f"use it: gradcomp breakeven --quality {out}{use} ...")
    return 0


def _launched() -> bool:
    import os

    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_calibrate(args) -> int:
    """Measure and write the profile; in a process group every rank measures, rank 0 writes."""
    import os
    from dataclasses import replace

    import torch.distributed as dist

    from .analysis import calibrate, preset_profile, presets
    from .emulate import workload
    from .hooks.calibrate import calibrate as calibrate_hooks

    if args.quality:
        return run_calibrate_quality(args)
    stray = [flag for flag, value in (("--candidates", args.candidates), ("--steps", args.steps),
                                      ("--seeds", args.seeds), ("--eval-every", args.eval_every)) if value is not None]
    if stray:
        raise ValueError(f"{', '.join(stray)} apply to --quality")
    args.out = args.out or "gradcomp-profile.json"
    args.batch_size = args.batch_size or 32
    if args.world_size < 0 or args.world_size == 1:
        raise ValueError(f"--world-size must be 0 (skip the network) or >= 2, got {args.world_size}")
    # a profile describes a long run: the CPU fast path compiled from the first call (gradcomp.methods.fast)
    os.environ.setdefault("GRADCOMP_CPU_COMPILE_AFTER_S", "0")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    sizes = _int_list(args.sizes, "--sizes")
    nominal = presets.link(args.link) if args.link else None
    if args.backend == "nccl":
        if args.model:
            raise ValueError("--backend nccl measures the network and the kernels only: time your training step "
                             "and pass gradcomp breakeven --compute-ms (fixed costs come from --device-name's preset)")
        gpu = presets.device(args.device_name)
    stage(f"sweeping the network ({args.backend})")
    network, world = _measure_network(args.world_size, _int_list(args.network_sizes, "--network-sizes"),
                                      args.repeats, args.backend)
    if args.backend == "nccl":
        if network is None:
            raise ValueError("--backend nccl needs at least 2 ranks under torchrun")
        if dist.get_rank() == 0:
            copy_gbps, rates = calibrate.measure_kernel_rates(methods, args.kernel_numel, repeats=args.repeats,
                                                              device=_nccl_device())
            gpu = replace(gpu, memory_gbps=copy_gbps, kernel_rates={**gpu.kernel_rates, **rates})
            profile = replace(preset_profile(gpu), network=network, world_size=world,
                              notes={"source": f"NCCL sweep on {world} ranks; kernels timed on this GPU against its "
                                               f"copy ({copy_gbps:.0f} GB/s, {args.kernel_numel} elements); "
                                               f"fixed costs: preset {gpu.name}"})
            profile.save(args.out)
            print(f"profile written to {args.out}")
            print(calibrate.summary(profile, nominal))
        return 0
    group = _rank_alone_group()
    compute = None
    if args.model:
        stage(f"timing {args.model}'s forward, backward and optimizer step")
        module, batch, loss = workload(args.model, args.batch_size)
        compute = calibrate.measure_compute(module, batch, loss, repeats=args.repeats, name=args.model, group=group)
    model = (lambda: workload(args.model, args.batch_size)) if args.model else None
    stage(f"timing the hooks of {len(methods)} methods (their first calls compile the CPU fast path)")
    profile = calibrate_hooks(methods, sizes, args.repeats, network, world, compute, args.device_name, group,
                              model)
    if dist.get_rank() != 0:
        return 0
    profile.save(args.out)
    print(f"profile written to {args.out}")
    print(calibrate.summary(profile, nominal))
    return 0


@subcommand("demo", "end to end: compress real gradients, train with every DDP hook, ask the analyser")
def configure_demo(p: argparse.ArgumentParser):
    p.add_argument("--steps", type=_positive(int), default=60, help="DDP training steps per hook (default 60)")

    def run(args) -> int:
        from . import demo

        demo.main(args.steps)
        return main(demo.BREAKEVEN_ARGV)

    return run


# ---- entry point --------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """A parser whose errors are one line ("gradcomp breakeven: error: ..."), exit status 2, no
    usage block (``--help`` prints it); subcommands' parsers are of this class too."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gradcomp", allow_abbrev=False, description="gradient compression for PyTorch DDP")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, configure) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        p.set_defaults(run=configure(p))
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with Progress(f"gradcomp {args.command}", quiet=getattr(args, "json", False)):
            return args.run(args)
    except (ValueError, TypeError) as exc:
        print(f"gradcomp {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
