"""Small models and a DDP training loop shared by the hook tests (run inside run_ranks workers).

Every batch is a deterministic function of (step, rank), so a run can be repeated, split at a
checkpoint, or compared across hooks.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

IMAGE_SHAPE = (3, 8, 8)
CLASSES = 10


class MixedNet(nn.Module):
    """4-D conv weights, 1-D biases and norm weights, two linear layers (~2.6k parameters).

    frozen: a layer used in forward whose parameters do not require grad (DDP skips them).
    unused: a layer never used in forward (needs ``find_unused_parameters=True``).
    """

    def __init__(self, with_unused: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, CLASSES)
        self.frozen = nn.Linear(CLASSES, CLASSES)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(5, 5) if with_unused else None

    def forward(self, x):
        x = F.avg_pool2d(F.relu(self.norm(self.conv(x))), 2).flatten(1)
        return self.frozen(self.fc2(F.relu(self.fc1(x))))


def build_model(seed: int = 0, dtype: torch.dtype = torch.float32, with_unused: bool = False) -> nn.Module:
    """A MixedNet with parameters drawn from ``seed`` (identical on every rank)."""
    torch.manual_seed(seed)
    return MixedNet(with_unused).to(dtype)


def make_ddp(model: nn.Module, bucket_cap_mb: float = 0.004, **ddp_options) -> DDP:
    """DDP on CPU/Gloo with small buckets (the default 0.004 MB gives MixedNet several buckets)."""
    return DDP(model, bucket_cap_mb=bucket_cap_mb, **ddp_options)


def batch(step: int, rank: int, size: int = 4, dtype: torch.dtype = torch.float32):
    """Inputs [size, 3, 8, 8] and integer labels [size], a function of (step, rank) only."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, *IMAGE_SHAPE, generator=gen).to(dtype)
    y = torch.randint(CLASSES, (size,), generator=gen)
    return x, y


def train_steps(ddp: DDP, optimizer, steps: int, rank: int, start: int = 0, accumulate: int = 1,
                on_step=None) -> list[float]:
    """``steps`` optimizer steps of cross-entropy on :func:`batch`; the losses (floats).

    accumulate: micro-batches per step; all but the last run under ``ddp.no_sync()``.
    on_step(step): called after each optimizer step.
    """
    dtype = next(ddp.module.parameters()).dtype
    losses = []
    for step in range(start, start + steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            x, y = batch(step * accumulate + micro, rank, dtype=dtype)
            context = ddp.no_sync() if micro < accumulate - 1 else nullcontext()
            with context:
                loss = F.cross_entropy(ddp(x).float(), y)
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        if on_step is not None:
            on_step(step)
    return losses


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters concatenated (fp32 copy), for comparing replicas and runs."""
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def flat_grads(model: nn.Module) -> torch.Tensor:
    """All gradients that exist, concatenated (fp32 copy)."""
    return torch.cat([p.grad.detach().float().reshape(-1) for p in model.parameters() if p.grad is not None])


class FakeBucket:
    """A duck-typed torch.distributed.GradBucket over one flat buffer, to call hooks directly."""

    def __init__(self, buffer: torch.Tensor, index: int = 0, last: bool = True, params=None):
        self._buffer, self._index, self._last = buffer, index, last
        self._params = params if params is not None else [torch.zeros(buffer.numel())]

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def parameters(self):
        return self._params

    def gradients(self):
        return [self._buffer]


def random_buckets_step(hook, state, step: int, rank: int, world: int, sizes, params, sent, owed) -> None:
    """Call ``hook`` directly on one FakeBucket per size with seeded gradients that differ by
    rank, all before waiting on any; add each bucket's true mean over ranks to ``owed[i]`` and
    what the hook returned to ``sent[i]`` (for error-feedback conservation checks)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    futures = []
    for index, n in enumerate(sizes):
        grad = torch.randn(n, generator=gen) * (1 + rank)
        mean = grad / world
        dist.all_reduce(mean)
        owed[index] += mean
        futures.append(hook(state, FakeBucket(grad, index, index == len(sizes) - 1, params[index])))
    for index, future in enumerate(futures):
        sent[index] += future.wait()
