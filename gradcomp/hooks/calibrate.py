"""The calibration harness: times gradcomp's own DDP hooks on this machine and fits their
compress and decode seconds into a :class:`gradcomp.analysis.Profile`.

It drives the hooks (a front), so it lives beside them: the analyser (gradcomp.analysis,
including its pure measurements in :mod:`gradcomp.analysis.calibrate`) never imports a hook.
Used by ``gradcomp calibrate`` and the emulated-link harness (gradcomp.emulate).
"""
from __future__ import annotations

import statistics

import torch

from ..analysis.calibrate import WARMUP, measure_average
from ..analysis.collectives import Link
from ..analysis.profile import Compute, LinearCost, MethodCost, Profile
from ..methods import get_method
from . import register


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
                           group=None, bucket_cap_mb: float | None = None, **options) -> MethodCost:
    """The compress and decompress seconds gradcomp's DDP hook for ``name`` records on
    ``module``'s own buckets over training steps (backward only), as a cost per parameter
    element (fixed cost 0). For methods whose cost follows the layer shapes (PowerSGD: several
    matrices, uncompressed biases, several buckets) a one-tensor sweep prices a different
    workload: measured here, the one-tensor calibration of PowerSGD on a 4-layer MLP was 0.8x
    of what the hook spends on the model itself. ``group``: as in :func:`measure_hook_method`;
    ``bucket_cap_mb``: DDP's (None: its default), as the training it prices buckets."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(module, process_group=group,
              **({} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}))

    def backward():
        ddp.zero_grad(set_to_none=True)
        loss_fn(ddp, batch).backward()

    c, d = _hook_seconds(ddp, name, backward, repeats, **options)
    numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return MethodCost(LinearCost(0.0, c / numel), LinearCost(0.0, d / numel))


def measure_method(name: str, sizes: list[int], repeats: int = 5, group=None, model=None,
                   bucket_cap_mb: float | None = None, **options) -> MethodCost:
    """The hook costs of ``name``: on ``model()``'s own buckets (a callable returning (module,
    batch, loss_fn); DDP's ``bucket_cap_mb``) for methods whose cost follows the layer shapes
    (PowerSGD), else over one-tensor ``sizes`` (:func:`measure_hook_method`)."""
    if model is not None and get_method(name).per_tensor:
        module, batch, loss_fn = model()
        return measure_hook_on_module(name, module, batch, loss_fn, repeats, group, bucket_cap_mb, **options)
    return measure_hook_method(name, sizes, repeats, group, **options)


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
