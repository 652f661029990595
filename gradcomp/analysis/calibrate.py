"""Measure a machine: collectives' alpha/beta, a model's step, the averaging pass; fit them.

The hooks' compress/decompress timings are taken by the harness that drives them,
:mod:`gradcomp.hooks.calibrate` (a front: the analyser imports none).

Each measurement is the median of ``repeats`` timed calls after warm-up calls (the first call of a
large tensor compiles the CPU fast path). Collective sweeps run on every rank of a live process
group; fits follow the formulas of :mod:`.collectives` with p ranks:
  all-reduce of M bytes:          t = 2(p-1) alpha + 2(p-1)/p M beta
  all-gather of m bytes per rank: t = (p-1) alpha + (p-1) m beta
  reduce-scatter of M bytes in, all-to-all of M bytes sent per rank: t = (p-1) alpha + (p-1)/p M beta
On GPUs (an NCCL group, CUDA tensors) each call is timed with CUDA events: what the collective
achieves on the cluster's own links, per kind.
Alpha is measured, not extrapolated: the sweep also times each collective on its smallest size,
issued after a pause of compute as a training step issues it (:func:`measure_latency`), and the
line of each collective goes through that point.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from ..checks import check_number
from ..comm import seconds_of
from ..methods import get_method
from ..numfmt import plain
from ..payload import Payload
from .collectives import Link
from .presets import KernelRates
from .profile import Compute, LinearCost, Profile

WARMUP = 2
MIN_BETA_S = 1e-15  # a flat fit (noise) still gives a finite bandwidth
LATENCY_REPEATS = 50
LATENCY_PAUSE_S = 0.002
""":func:`measure_latency`: the calls averaged, and the compute (a busy loop) before each."""


def median_seconds(fn, repeats: int, warmup: int = WARMUP, summary=statistics.median,
                   device=None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed calls
    (``summary=min``: the least disturbed call instead): wall seconds, or on a CUDA ``device``
    the device's seconds for the work each call enqueued (gradcomp.comm.seconds_of: CUDA events,
    not the host's launch time)."""
    for _ in range(warmup):
        fn()
    return summary([seconds_of(fn, device) for _ in range(repeats)])


KERNEL_PAYLOADS = (2, 8, 64)
""":func:`measure_kernel_rates`: the payload counts of the decode-and-sums timed (bench_gpu's)."""


def measure_kernel_rates(methods, numel: int, payloads=KERNEL_PAYLOADS, repeats: int = 5,
                         device=None) -> tuple[float, dict[str, KernelRates]]:
    """(GB/s of a copy of ``numel`` fp32 elements on ``device``, each method's
    :class:`~.presets.KernelRates` there): its compress (with error feedback where its hooks keep
    it) and its decode-and-sum of each count of ``payloads`` payloads of ``numel`` elements, timed
    by :func:`median_seconds` (CUDA events on a CUDA device), as their declared bytes
    (``Method.declared_bytes``) per second over the copy's: what ``presets.H100_KERNEL_RATES``
    holds, measured as benchmarks/bench_gpu.py measures it. A method that compresses tensor by
    tensor (PowerSGD) is left out: its bytes run at the copy's speed and its fixed costs are
    priced apart (``presets.GPU_CALL_US``, ``GPU_TENSOR_US``)."""
    check_number("measure_kernel_rates", "numel", numel, 1, integer=True)
    generator = torch.Generator(device=device)
    x = torch.randn(numel, generator=generator.manual_seed(0), device=device)
    out = torch.empty_like(x)
    copy_rate = 8 * numel / median_seconds(lambda: out.copy_(x), repeats, device=device)
    rates = {}
    for name in methods:
        method = get_method(name)
        if method.per_tensor:
            continue
        feedback = method.error_feedback_default
        residual = torch.zeros_like(x) if feedback else None
        compress_s = median_seconds(lambda: method.compress(x, residual), repeats, device=device)
        decode = []
        for p in payloads:
            stacked = Payload.stack([method.compress(torch.randn(numel, generator=generator.manual_seed(row + 1),
                                                                 device=device)) for row in range(p)])
            seconds = median_seconds(lambda: method.decode_sum(stacked, out), repeats, device=device)
            decode.append((p, method.declared_bytes((numel,), p, feedback)[1] / seconds / copy_rate))
        rates[name] = KernelRates(method.declared_bytes((numel,), 1, feedback)[0] / compress_s / copy_rate,
                                  tuple(decode))
    return copy_rate / 1e9, rates


def single_rank_groups():
    """A process group of each rank alone (collective: every rank must call it); this rank's."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def in_waves(measure, cores: int | None = None):
    """``measure()`` on at most ``cores`` ranks of the default group at a time (default
    :func:`host_cores`), the others waiting in a barrier; this rank's result. Ranks that outnumber
    the host's cores then each measure on a core of their own, the cost a rank has alone (the
    model shares the cores out: ``Scenario.ranks_per_core``). ``measure`` must not use the default
    group. Every rank must call it."""
    cores = host_cores() if cores is None else cores
    if cores < 1:
        raise ValueError(f"in_waves: cores must be >= 1, got {cores}")
    rank, result = dist.get_rank(), None
    for wave in range(-(-dist.get_world_size() // cores)):
        if rank // cores == wave:
            result = measure()
        dist.barrier()
    return result


def ranks_per_core(ranks: int, cpus: int | None) -> float:
    """Ranks per core of a host of ``cpus`` cores running ``ranks`` ranks, at least 1
    (``Scenario.ranks_per_core``); 1 when ``cpus`` is unknown (None or 0: launches recorded before
    the ranks calibrated in turn, whose calibration ran on every rank at once)."""
    return max(1.0, ranks / cpus) if cpus else 1.0


def measure_sync_wait(works, segments: int = 10, group=None) -> LinearCost:
    """Seconds a collective issued right after compute waits beyond that compute, every rank at
    once (``Scenario.sync_wait``): for each of ``works`` (callables of different lengths),
    ``segments`` rounds of ``work()`` then a one-element all-reduce, less the same all-reduces back
    to back and the rank's own seconds in ``work``; averaged over the ranks and fitted as a line
    in the work's seconds (clipped at 0). Every rank must call it; every rank gets the same line."""
    flag = torch.zeros(1)

    def rounds(work) -> tuple[float, float]:
        dist.barrier(group)
        own, start = 0.0, time.perf_counter()
        for _ in range(segments):
            began = time.perf_counter()
            work()
            own += time.perf_counter() - began
            dist.all_reduce(flag, group=group)
        return time.perf_counter() - start, own

    back_to_back, _ = rounds(lambda: None)
    points = []
    for work in works:
        work()  # warm-up
        total, own = rounds(work)
        points += [own / segments, (total - back_to_back - own) / segments]
    mean = torch.tensor(points, dtype=torch.float64)
    dist.all_reduce(mean, group=group)
    mean /= dist.get_world_size(group)
    return LinearCost.fit(mean[0::2].tolist(), mean[1::2].tolist())


def measure_average(sizes: list[int], repeats: int = 5, device=None) -> LinearCost:
    """Fit the in-place 1/world_size scaling DDP runs on every bucket (``x.mul_(0.5)``), on
    ``device`` (default the host)."""
    seconds = []
    for n in sizes:
        x = torch.ones(n, device=device)
        seconds.append(median_seconds(lambda: x.mul_(0.5), repeats, device=device))
    return LinearCost.fit(sizes, seconds)


def _link(name: str, cost: LinearCost, alpha_steps: float, beta_factor: float) -> Link:
    beta = max(cost.per_element_s / beta_factor, MIN_BETA_S)
    return Link(name, 8.0 / (beta * 1e9), cost.fixed_s / alpha_steps * 1e6)


def fit_network(world_size: int, sizes: list[int], allreduce_s: list[float], allgather_s: list[float],
                reduce_scatter_s: list[float] | None = None,
                latency_s: dict[str, float] | None = None, latency_bytes: int = 0,
                alltoall_s: list[float] | None = None) -> dict[str, Link]:
    """Links fitted to all-reduce times of ``sizes`` bytes and all-gather times of ``sizes`` bytes
    per rank, on ``world_size`` ranks; with ``reduce_scatter_s`` (reduce-scatters of ``sizes``
    bytes in total) also a ``reduce_scatter`` link, fitted to (p-1) alpha + (p-1)/p M beta, and
    with ``alltoall_s`` (all-to-alls of ``sizes`` bytes sent per rank) an ``alltoall`` link, alike.
    ``latency_s``: seconds of each collective on ``latency_bytes`` issued after compute
    (:func:`measure_latency`, keyed ``allreduce``, ``allgather``, ``reduce_scatter``; 0 bytes:
    one element): each line goes through that point, so only beta is fitted and alpha is the
    intercept it implies over the collective's message steps; a collective without one is fitted
    both ways (alpha: the intercept, clipped at 0)."""
    p = world_size
    if p < 2:
        raise ValueError(f"a network fit needs world size >= 2, got {p}")
    latency_s = latency_s or {}

    def fit(kind: str, seconds: list[float]) -> LinearCost:
        through = (latency_bytes, latency_s[kind]) if kind in latency_s else None
        return LinearCost.fit(sizes, seconds, through)

    links = {"allreduce": _link("measured-allreduce", fit("allreduce", allreduce_s), 2 * (p - 1), 2 * (p - 1) / p),
             "allgather": _link("measured-allgather", fit("allgather", allgather_s), p - 1, p - 1)}
    if reduce_scatter_s is not None:
        links["reduce_scatter"] = _link("measured-reduce-scatter", fit("reduce_scatter", reduce_scatter_s),
                                        p - 1, (p - 1) / p)
    if alltoall_s is not None:
        links["alltoall"] = _link("measured-alltoall", fit("alltoall", alltoall_s), p - 1, (p - 1) / p)
    return links


def fit_sweep(world_size: int, sweep: dict) -> dict[str, Link]:
    """:func:`fit_network` of a sweep as :func:`network_worker` records it (``sizes``,
    ``allreduce_s``, ``allgather_s``, ``reduce_scatter_s``, ``latency_s``, ``latency_bytes``); a
    sweep recorded before the reduce-scatter was timed prices it as its all-reduce (Gloo's costs
    at least that), one recorded before the latency was its fitted intercept, one recorded before
    ``latency_bytes`` measured it on one element; one recorded before the all-to-all was timed
    has no ``alltoall`` link (priced as the all-gather)."""
    return fit_network(world_size, sweep["sizes"], sweep["allreduce_s"], sweep["allgather_s"],
                       sweep.get("reduce_scatter_s", sweep["allreduce_s"]), sweep.get("latency_s"),
                       sweep.get("latency_bytes", 0), sweep.get("alltoall_s"))


def _collectives(nbytes: int, group=None, device=None) -> dict:
    """A call per swept collective on ``nbytes`` (at least one element) on ``device`` (default
    the host): ``allreduce`` of ``nbytes`` (fp32), ``allgather`` of ``nbytes`` per rank (uint8),
    ``reduce_scatter`` of ``nbytes`` in (fp32, as the hierarchical hook and FSDP issue it),
    ``alltoall`` of ``nbytes`` sent per rank in all (uint8, p equal parts: the two-phase scheme's
    first phase and FSDP's compressed rows)."""
    from ..comm import all_gather_into, reduce_scatter_into

    world = dist.get_world_size(group)
    x = torch.ones(max(nbytes // 4, 1), device=device)
    chunk = torch.ones(max(nbytes, 1), dtype=torch.uint8, device=device)
    out = torch.empty(world * chunk.numel(), dtype=torch.uint8, device=device)
    whole = torch.ones(world * max(nbytes // (4 * world), 1), device=device)
    shard = torch.empty(whole.numel() // world, device=device)
    sent = torch.ones(world * max(nbytes // world, 1), dtype=torch.uint8, device=device)
    received = torch.empty_like(sent)
    return {"allreduce": lambda: dist.all_reduce(x, group=group),
            "allgather": lambda: all_gather_into(out, chunk, group=group),
            "reduce_scatter": lambda: reduce_scatter_into(shard, whole, group=group),
            "alltoall": lambda: dist.all_to_all_single(received, sent, group=group)}


def _compute_for(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` (a stand-in for a step's compute)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure_latency(group=None, nbytes: int = 0, repeats: int = LATENCY_REPEATS,
                    pause_s: float = LATENCY_PAUSE_S, collectives=None, device=None) -> dict[str, float]:
    """Mean seconds of each collective on ``nbytes`` (``collectives``: the calls by kind, default
    :func:`_collectives` of ``nbytes``; 0: one element), each call issued after ``pause_s`` of
    compute on this rank, as a training step issues its collectives: the threads that carry a
    collective sleep meanwhile, and the call pays their waking. A mean, not a median: a step pays
    it once per collective, and the waking is 0.2 or about 4 ms by chance). On a CUDA ``device``
    each call is timed with CUDA events (the device's seconds). Every rank must call it."""
    calls = collectives if collectives is not None else _collectives(nbytes, group, device)
    latency = {}
    for kind, call in calls.items():
        for _ in range(WARMUP):
            call()
        seconds = []
        for _ in range(repeats):
            _compute_for(pause_s)
            seconds.append(seconds_of(call, device))
        latency[kind] = statistics.mean(seconds)
    return latency


def sweep_collectives(sizes: list[int], repeats: int = 5, group=None, device=None) -> dict:
    """Median seconds of all-reduce, all-gather, reduce-scatter and all-to-all of ``sizes``
    bytes (:func:`_collectives`, on ``device``: default the host; CUDA for an NCCL group) on the
    current process group, as ``{"allreduce_s", "allgather_s", "reduce_scatter_s",
    "alltoall_s"}`` lists, and the same collectives on the smallest size each issued after compute
    (``latency_s``: :func:`measure_latency` of ``latency_bytes``): the arguments of
    :func:`fit_network`. The swept calls run back to back, with the threads that carry them
    awake; training issues its collectives after compute. Every rank must call it."""
    swept = {"allreduce_s": [], "allgather_s": [], "reduce_scatter_s": [], "alltoall_s": []}
    for nbytes in sizes:
        for kind, call in _collectives(nbytes, group, device).items():
            swept[f"{kind}_s"].append(median_seconds(call, repeats, device=device))
        dist.barrier(group)
    swept["latency_bytes"] = min(sizes)
    swept["latency_s"] = measure_latency(group, swept["latency_bytes"], device=device)
    return swept


def network_worker(rank: int, world_size: int, config: dict) -> dict:
    """Run inside each rank of a launched group: the collective sweep, as plain numbers."""
    return {"sizes": config["sizes"], **sweep_collectives(config["sizes"], config.get("repeats", 5))}


def measure_compute(module: torch.nn.Module, batch, loss_fn, repeats: int = 5, name: str = "",
                    optimizer: torch.optim.Optimizer | None = None, group=None,
                    set_to_none: bool = True) -> Compute:
    """Median forward, backward and optimizer seconds of ``loss_fn(module, batch)``; the
    optimizer's are ``optimizer.step()`` and then ``optimizer.zero_grad(set_to_none=set_to_none)``
    (a step's update phase; with ``set_to_none=False``, as the emulated-link harness trains, the
    zeroing writes every gradient).

    With ``group`` (a process group of this rank alone) the module runs wrapped in DDP on it, so
    the times include DDP's own work (autograd hooks, copies into and out of the buckets) but no
    network. The default optimizer is SGD with momentum 0.9, as the emulated-link harness trains.
    """
    if group is not None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(module, process_group=group)
    optimizer = optimizer or torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9)
    forward, backward, step = [], [], []
    for i in range(repeats + WARMUP):
        t0 = time.perf_counter()
        loss = loss_fn(module, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        t3 = time.perf_counter()
        if i >= WARMUP:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            step.append(t3 - t2)
    return Compute(statistics.median(forward), statistics.median(backward), statistics.median(step), name)


def summary(profile: Profile, nominal: Link | None = None) -> str:
    """A short table of a profile's numbers; with ``nominal`` (a preset link), each measured
    collective's bandwidth as a fraction of that link's nominal bandwidth too."""
    from tabulate import tabulate

    rows = [[name, f"{c.compress.fixed_s * 1e6:.0f}", f"{c.compress.per_element_s * 1e9:.3f}",
             f"{c.decompress.fixed_s * 1e6:.0f}", f"{c.decompress.per_element_s * 1e9:.3f}"]
            for name, c in profile.methods.items()]
    text = tabulate(rows, headers=["method", "compress fixed us", "compress ns/elem", "decompress fixed us",
                                   "decompress ns/elem"])
    text += ("\nfixed us: the per-call intercept of a least-squares line over the sizes, clipped at 0 "
             "(0: the cost is all per element at these sizes; PowerSGD timed on --model's own "
             "buckets is per element by construction)")
    if profile.network:
        for kind, link in profile.network.items():
            text += (f"\n{kind} over {profile.world_size} ranks: alpha {link.latency_us:.1f} us, "
                     f"bandwidth {plain(link.bandwidth_gbps)} Gbit/s")
            if nominal is not None:
                text += f" ({link.achieved_gbps / nominal.bandwidth_gbps:.2f} of {nominal.name}'s " \
                        f"{plain(nominal.bandwidth_gbps, 4)})"
    if profile.compute:
        c = profile.compute
        text += (f"\n{c.model}: forward {c.forward_s * 1e3:.2f} ms, backward {c.backward_s * 1e3:.2f} ms, "
                 f"optimizer {c.optimizer_s * 1e3:.2f} ms")
    return text
