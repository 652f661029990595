"""What the "auto" hook (gradcomp.hooks.auto) measures at run time: the compress and decode
costs of its methods on this device (measured once, cached per device and torch/triton version,
averaged over the ranks so that every rank prices alike) and the link, fitted from a probe of
all-reduces and all-gathers. The planning over these numbers is gradcomp.analysis.auto.
"""
from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from .. import comm
from ..methods import UNCOMPRESSED, get_method
from ..payload import Payload
from .calibrate import fit_network, measure_average, median_seconds
from .collectives import Network
from .profile import LinearCost, MethodCost, Profile

PROBE_BYTES = (4096, 65536, 524288)
"""All-reduce / all-gather sizes of the start-up link probe: latency points and one above tbf's
256 KiB burst, so that an emulated link cannot hide the rate."""
COLD_BYTES = 64 << 20  # cost measurements cycle through this many bytes of inputs (past the caches)


# ---- compress and decode costs, cached ----------------------------------------------------------

def device_name(device: torch.device) -> str:
    """``cpu`` or the accelerator's name (``NVIDIA H100 80GB HBM3``)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


COST_FORMAT = 2
"""In the cost cache's file name: a cache measured another way (format 1: PowerSGD on flat
tensors) is not read."""


def cost_cache_path(device: torch.device) -> Path:
    """``$XDG_CACHE_HOME/gradcomp/costs<format>-<device>-torch<v>-triton<v>.json`` (``~/.cache``
    without XDG_CACHE_HOME): the measured costs of one device under one torch and triton."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "none"
    slug = re.sub(r"[^A-Za-z0-9.+]+", "_", device_name(device))
    return root / "gradcomp" / f"costs{COST_FORMAT}-{slug}-torch{torch.__version__}-triton{triton}.json"


def timing_shape(numel: int, per_tensor: bool) -> tuple[int, ...]:
    """The shape a method's costs are timed at for ``numel`` elements: flat, or for a per-tensor
    method the matrix [side, numel // side] with side = isqrt(numel) (at most side - 1 elements
    fewer)."""
    if not per_tensor:
        return (numel,)
    side = max(math.isqrt(numel), 1)
    return (side, numel // side)


def measure_method_cost(method: str, sizes, world_size: int, device: torch.device,
                        repeats: int = 5) -> MethodCost:
    """Median seconds of ``method``'s compress (with error feedback when its hooks keep it) and of
    decode-and-sum of one and of ``world_size`` payloads, at each of ``sizes`` elements, fitted
    per element: ``decompress`` per payload, ``output_per_element_s`` for writing the result.
    Each call reads other tensors than the last (COLD_BYTES in all), as a hook reads a bucket
    backward has just written, not one left in cache by the previous call. A per-tensor method
    (PowerSGD) is timed on square-ish matrices of about each size (:func:`timing_shape`): on a
    flat tensor it would send the values uncompressed and cost a copy."""
    m = get_method(method)
    shapes = [timing_shape(n, m.per_tensor) for n in sizes]
    sizes = [math.prod(shape) for shape in shapes]
    compress_s, one_s, many_s = [], [], []
    for n, shape in zip(sizes, shapes):
        copies = max(2, min(16, COLD_BYTES // (4 * n)))
        xs = [torch.randn(shape, device=device) for _ in range(copies)]
        residuals = [torch.zeros(shape, device=device) if m.error_feedback_default else None for _ in range(copies)]
        outs = [torch.empty(shape, device=device) for _ in range(copies)]
        payloads = [m.compress(x) for x in xs]
        ones = [p.as_rows() for p in payloads]
        manys = [Payload.stack([p] * world_size) for p in payloads]
        turn = iter(range(1 << 62))

        def timed(fn):  # device seconds (CUDA events on CUDA, not the host's launch time)
            return median_seconds(lambda: fn(next(turn) % copies), repeats, device=device)
        compress_s.append(timed(lambda i: m.compress(xs[i], residuals[i], {})))
        one_s.append(timed(lambda i: m.decode_sum(ones[i], outs[i])))
        many_s.append(timed(lambda i: m.decode_sum(manys[i], outs[i])))
    one, many = LinearCost.fit(sizes, one_s), LinearCost.fit(sizes, many_s)
    per_payload = (max(many.per_element_s - one.per_element_s, 0.0) / (world_size - 1)
                   if world_size > 1 else one.per_element_s)
    return MethodCost(LinearCost.fit(sizes, compress_s), LinearCost(one.fixed_s, per_payload),
                      max(one.per_element_s - per_payload, 0.0))


def device_costs(methods, sizes, world_size: int, device: torch.device, cache: Path | None = None,
                 repeats: int = 5) -> Profile:
    """The costs of ``methods`` (and of averaging a bucket) on ``device``: read from ``cache``
    (default :func:`cost_cache_path`), the missing ones measured at ``sizes`` elements
    (:func:`measure_method_cost`) and written back, so a restart measures nothing."""
    path = Path(cache) if cache is not None else cost_cache_path(device)
    known, average = {}, None
    if path.exists():
        try:
            cached = Profile.load(path)
            known, average = dict(cached.methods), cached.average
        except ValueError:  # a corrupt or older file: measure again
            pass
    missing = [m for m in methods if m != UNCOMPRESSED and m not in known]
    for name in missing:
        known[name] = measure_method_cost(name, sizes, world_size, device, repeats)
    if average is None:
        average = measure_average(list(sizes), repeats, device)
    profile = Profile(device_name(device), known, notes={"source": "gradcomp.analysis.auto",
                                                         "sizes": list(sizes)}, average=average)
    if missing or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
        os.replace(temporary, path)  # ranks sharing a cache never read half a file
    return profile


def agreed_costs(profile: Profile, device: torch.device, group=None) -> Profile:
    """``profile``'s coefficients averaged over the group's ranks (one all-reduce on ``device``,
    the group's: NCCL takes only tensors on its GPU), so that every rank prices choices alike.
    Every rank must hold the same methods."""
    names = sorted(profile.methods)
    values = [profile.average.fixed_s, profile.average.per_element_s]
    for name in names:
        c = profile.methods[name]
        values += [c.compress.fixed_s, c.compress.per_element_s, c.decompress.fixed_s,
                   c.decompress.per_element_s, c.output_per_element_s]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    v = (t / dist.get_world_size(group)).tolist()
    costs = {name: MethodCost(LinearCost(*v[2 + 5 * i:4 + 5 * i]), LinearCost(*v[4 + 5 * i:6 + 5 * i]),
                              v[6 + 5 * i]) for i, name in enumerate(names)}
    return replace(profile, methods=costs, average=LinearCost(v[0], v[1]))


# ---- the link -----------------------------------------------------------------------------------

PROBE_SLOW_S = 0.05
"""A probe collective that took this long (the slowest rank's) is timed twice, not ``repeats``
times: on a slow link the probe's largest collectives would take seconds (and, many ranks
sending at once into a shallow queue, stall on TCP retransmissions)."""


def probe_network(device: torch.device, group=None, sizes=PROBE_BYTES, repeats: int = 5) -> Network:
    """The group's links fitted (ring formulas, gradcomp.analysis.calibrate.fit_network) to the
    fastest of ``repeats`` (twice when one took PROBE_SLOW_S or more) all-reduces and
    all-gathers of each of ``sizes`` bytes on ``device`` (the group's; on CUDA timed with CUDA
    events: an NCCL collective returns at enqueue), after one untimed call of each collective at
    the first size, the slowest rank's, so every rank fits the same numbers and runs the same
    collectives."""
    p = dist.get_world_size(group)

    def seconds(run, warm_up: bool) -> float:
        if warm_up:
            run()
        first = torch.tensor([comm.seconds_of(run, device)], dtype=torch.float64, device=device)
        dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)  # every rank decides alike
        more = repeats - 1 if float(first) < PROBE_SLOW_S else min(repeats - 1, 1)
        return min([float(first)] + [comm.seconds_of(run, device) for _ in range(more)])

    timings = []
    for nbytes in sizes:  # all-reduces first, then all-gathers
        x = torch.ones(max(nbytes // 4, 1), device=device)
        timings.append(seconds(lambda: dist.all_reduce(x, group=group), nbytes == sizes[0]))
    for nbytes in sizes:
        chunk = torch.ones(nbytes, dtype=torch.uint8, device=device)
        out = torch.empty(p * nbytes, dtype=torch.uint8, device=device)
        timings.append(seconds(lambda: comm.all_gather_into(out, chunk, group=group), nbytes == sizes[0]))
    t = torch.tensor(timings, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    links = fit_network(p, list(sizes), t[:len(sizes)].tolist(), t[len(sizes):].tolist())
    return Network(p, links["allreduce"], allgather_link=links["allgather"], algorithm="ring")
