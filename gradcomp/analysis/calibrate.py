"""Measure a machine: compress/decompress per method, collectives' alpha/beta, a model's step.

Each measurement is the median of ``repeats`` timed calls after warm-up calls (the first call of a
large tensor compiles the CPU fast path). Collective sweeps run on every rank of a live process
group; fits follow the formulas of :mod:`.collectives` with p ranks:
  all-reduce of M bytes:          t = 2(p-1) alpha + 2(p-1)/p M beta
  all-gather of m bytes per rank: t = (p-1) alpha + (p-1) m beta
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..comm import seconds_of
from ..methods import get_method
from .collectives import Link
from .profile import Compute, LinearCost, MethodCost, Profile

WARMUP = 2
MIN_BETA_S = 1e-15  # a flat fit (noise) still gives a finite bandwidth


def median_seconds(fn, repeats: int, warmup: int = WARMUP, summary=statistics.median,
                   device=None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` untimed calls
    (``summary=min``: the least disturbed call instead): wall seconds, or on a CUDA ``device``
    the device's seconds for the work each call enqueued (gradcomp.comm.seconds_of: CUDA events,
    not the host's launch time)."""
    for _ in range(warmup):
        fn()
    return summary([seconds_of(fn, device) for _ in range(repeats)])


def calibration_shape(numel: int) -> tuple[int, ...]:
    """The tensor timed for ``numel`` elements: rows of 1024 (a layer-like matrix for PowerSGD)."""
    return (numel // 1024, 1024) if numel % 1024 == 0 and numel >= 1024 * 8 else (numel,)


class _OneTensor(torch.nn.Module):
    """One [rows, 1024] parameter whose gradient is a fixed random tensor (loss = <param, w>)."""

    def __init__(self, numel: int, seed: int):
        super().__init__()
        shape = calibration_shape(numel)
        self.weight = torch.nn.Parameter(torch.zeros(shape))
        self.register_buffer("w", torch.randn(shape, generator=torch.Generator().manual_seed(seed)))

    def forward(self):
        return (self.weight * self.w).sum()


def _hook_seconds(ddp, name: str, backward, repeats: int, **options) -> tuple[float, float]:
    """Median (compress, decompress) seconds per step that gradcomp's ``name`` hook, registered
    on ``ddp``, records (``state.stats``) over ``repeats`` calls of ``backward()`` after WARMUP."""
    from ..hooks import register

    state = register(ddp, name, **options)
    per_step = []
    for step in range(WARMUP + repeats):
        state.stats.reset()
        backward()
        if step >= WARMUP:
            per_step.append((state.stats.totals["compress_s"], state.stats.totals["decompress_s"]))
    return statistics.median(c for c, _ in per_step), statistics.median(d for _, d in per_step)


def measure_hook_method(name: str, sizes: list[int], repeats: int = 5, group=None, **options) -> MethodCost:
    """Fit the compress and decompress seconds gradcomp's DDP hook for ``name`` records
    (``state.stats``) on one bucket of each size, with its default options (error feedback as
    the hook sets it; int8/sign by all-gather). ``group``: a process group of this rank alone,
    so that no network time mixes in."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    compress_s, decompress_s = [], []
    for n in sizes:
        ddp = DDP(_OneTensor(n, seed=n), process_group=group, bucket_cap_mb=4 * n / 2 ** 20 + 1)
        c, d = _hook_seconds(ddp, name, lambda: ddp().backward(), repeats, **options)
        compress_s.append(c)
        decompress_s.append(d)
    return MethodCost(LinearCost.fit(sizes, compress_s), LinearCost.fit(sizes, decompress_s))


def measure_hook_on_module(name: str, module: torch.nn.Module, batch, loss_fn, repeats: int = 5,
                           group=None, **options) -> MethodCost:
    """The compress and decompress seconds gradcomp's DDP hook for ``name`` records on
    ``module``'s own buckets over training steps (backward only), as a cost per parameter
    element (fixed cost 0). For methods whose cost follows the layer shapes (PowerSGD: several
    matrices, uncompressed biases, several buckets) a one-tensor sweep prices a different
    workload: measured here, the one-tensor calibration of PowerSGD on a 4-layer MLP was 0.8x
    of what the hook spends on the model itself. ``group``: as in :func:`measure_hook_method`."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(module, process_group=group)

    def backward():
        ddp.zero_grad(set_to_none=True)
        loss_fn(ddp, batch).backward()

    c, d = _hook_seconds(ddp, name, backward, repeats, **options)
    numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return MethodCost(LinearCost(0.0, c / numel), LinearCost(0.0, d / numel))


def measure_method(name: str, sizes: list[int], repeats: int = 5, group=None, model=None, **options) -> MethodCost:
    """The hook costs of ``name``: on ``model()``'s own buckets (a callable returning (module,
    batch, loss_fn)) for methods whose cost follows the layer shapes (PowerSGD), else over
    one-tensor ``sizes`` (:func:`measure_hook_method`)."""
    if model is not None and get_method(name).per_tensor:
        module, batch, loss_fn = model()
        return measure_hook_on_module(name, module, batch, loss_fn, repeats, group, **options)
    return measure_hook_method(name, sizes, repeats, group, **options)


def single_rank_groups():
    """A process group of each rank alone (collective: every rank must call it); this rank's."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def measure_average(sizes: list[int], repeats: int = 5, device=None) -> LinearCost:
    """Fit the in-place 1/world_size scaling DDP runs on every bucket (``x.mul_(0.5)``), on
    ``device`` (default the host)."""
    seconds = []
    for n in sizes:
        x = torch.ones(n, device=device)
        seconds.append(median_seconds(lambda: x.mul_(0.5), repeats, device=device))
    return LinearCost.fit(sizes, seconds)


def _link(name: str, intercept_s: float, slope_s_per_byte: float, alpha_steps: float, beta_factor: float) -> Link:
    beta = max(slope_s_per_byte / beta_factor, MIN_BETA_S)
    return Link(name, 8.0 / (beta * 1e9), intercept_s / alpha_steps * 1e6)


def fit_network(world_size: int, sizes: list[int], allreduce_s: list[float], allgather_s: list[float]) -> dict[str, Link]:
    """Links fitted to all-reduce times of ``sizes`` bytes and all-gather times of ``sizes`` bytes
    per rank, on ``world_size`` ranks."""
    p = world_size
    if p < 2:
        raise ValueError(f"a network fit needs world size >= 2, got {p}")
    ar, ag = LinearCost.fit(sizes, allreduce_s), LinearCost.fit(sizes, allgather_s)
    return {"allreduce": _link("measured-allreduce", ar.fixed_s, ar.per_element_s, 2 * (p - 1), 2 * (p - 1) / p),
            "allgather": _link("measured-allgather", ag.fixed_s, ag.per_element_s, p - 1, p - 1)}


def sweep_collectives(sizes: list[int], repeats: int = 5, group=None) -> tuple[list[float], list[float]]:
    """Median seconds of all-reduce (``sizes`` bytes, fp32) and all-gather (``sizes`` bytes per
    rank, uint8) on the current process group. Every rank must call it."""
    world = dist.get_world_size(group)
    allreduce, allgather = [], []
    for nbytes in sizes:
        x = torch.ones(max(nbytes // 4, 1))
        allreduce.append(median_seconds(lambda: dist.all_reduce(x, group=group), repeats))
        chunk = torch.ones(nbytes, dtype=torch.uint8)
        out = torch.empty(world * nbytes, dtype=torch.uint8)
        allgather.append(median_seconds(lambda: dist.all_gather_into_tensor(out, chunk, group=group), repeats))
        dist.barrier(group)
    return allreduce, allgather


def network_worker(rank: int, world_size: int, config: dict) -> dict:
    """Run inside each rank of a launched group: the collective sweep, as plain numbers."""
    allreduce, allgather = sweep_collectives(config["sizes"], config.get("repeats", 5))
    return {"sizes": config["sizes"], "allreduce_s": allreduce, "allgather_s": allgather}


def measure_compute(module: torch.nn.Module, batch, loss_fn, repeats: int = 5, name: str = "",
                    optimizer: torch.optim.Optimizer | None = None, group=None) -> Compute:
    """Median forward, backward and optimizer-step seconds of ``loss_fn(module, batch)``.

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
        optimizer.zero_grad(set_to_none=False)
        t0 = time.perf_counter()
        loss = loss_fn(module, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if i >= WARMUP:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
            step.append(t3 - t2)
    return Compute(statistics.median(forward), statistics.median(backward), statistics.median(step), name)


def calibrate(methods: list[str], sizes: list[int], repeats: int = 5, network: dict[str, Link] | None = None,
              world_size: int | None = None, compute: Compute | None = None, device: str = "cpu",
              group=None, model=None) -> Profile:
    """A Profile from the hooks' compress/decompress timings of ``methods`` (see
    :func:`measure_method`: over ``sizes``, or on ``model()``'s buckets; ``group``: a process
    group of this rank alone) plus the given measurements."""
    costs = {name: measure_method(name, sizes, repeats, group, model) for name in methods}
    notes = {"sizes": list(sizes), "repeats": repeats, "torch": torch.__version__,
             "threads": torch.get_num_threads()}
    return Profile(device, costs, compute, network, world_size if network else None, notes,
                   measure_average(sizes, repeats))


def summary(profile: Profile) -> str:
    """A short table of a profile's numbers."""
    from tabulate import tabulate

    rows = [[name, f"{c.compress.fixed_s * 1e6:.0f}", f"{c.compress.per_element_s * 1e9:.3f}",
             f"{c.decompress.fixed_s * 1e6:.0f}", f"{c.decompress.per_element_s * 1e9:.3f}"]
            for name, c in profile.methods.items()]
    text = tabulate(rows, headers=["method", "compress us", "compress ns/elem", "decompress us",
                                   "decompress ns/elem"])
    if profile.network:
        for kind, link in profile.network.items():
            text += (f"\n{kind} over {profile.world_size} ranks: alpha {link.latency_us:.1f} us, "
                     f"bandwidth {link.bandwidth_gbps:.3g} Gbit/s")
    if profile.compute:
        c = profile.compute
        text += (f"\n{c.model}: forward {c.forward_s * 1e3:.2f} ms, backward {c.backward_s * 1e3:.2f} ms, "
                 f"optimizer {c.optimizer_s * 1e3:.2f} ms")
    return text
