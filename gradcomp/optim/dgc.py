"""DGC: SGD with momentum whose ranks exchange the top-k of their momentum-corrected velocity
(Deep Gradient Compression, Lin et al., ICLR 2018).

Per step on each rank, with local gradient g (plus ``weight_decay`` x parameter, as SGD):
  local clipping      g <- g min(1, clip_norm / (sqrt(p) |g|))      (``clip_norm``; p ranks)
  momentum            u <- momentum u + g
  velocity            v <- v + u / p;  send the top-k of v (``gradcomp`` topk, all-gathered)
  masking             v and u <- 0 where sent (the residual of error feedback is v; u is masked
                      so that sent momentum is not applied again: momentum-factor masking)
  update              x <- x - lr (sum over ranks of the sent values)
Sparsity warm-up: the density falls geometrically from ``initial_density`` to ``density`` over
``warmup_steps`` steps. A step whose gathered values are not finite is skipped on every rank.
"""
from __future__ import annotations

import math

import torch

from ..checks import check_number
from ..methods import all_finite, get_method
from ..schedules import dgc_density
from .base import ExchangeOptimizer


class DGC(ExchangeOptimizer):
    """SGD with momentum, momentum correction, local clipping, momentum-factor masking and sparsity
    warm-up; the exchange is top-k (``selector`` exact or threshold) all-gathered. ``model``: the
    module trained (plain, or DDP after :func:`gradcomp.optim.local_gradients`)."""

    def __init__(self, params, model, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 *, density: float = 0.001, warmup_steps: int = 0, initial_density: float = 0.25,
                 clip_norm: float | None = None, selector: str = "exact", process_group=None):
        name = "DGC"
        check_number(name, "lr", lr, 0.0)
        check_number(name, "momentum", momentum, 0.0, 1.0, high_open=True)
        check_number(name, "weight_decay", weight_decay, 0.0)
        check_number(name, "density", density, 0.0, 1.0, low_open=True)
        check_number(name, "initial_density", initial_density, 0.0, 1.0, low_open=True)
        check_number(name, "warmup_steps", warmup_steps, 0, integer=True)
        if clip_norm is not None:
            check_number(name, "clip_norm", clip_norm, 0.0, low_open=True)
        get_method("topk", ratio=density, selector=selector)  # validates the selector
        self.density, self.initial_density, self.warmup_steps = density, initial_density, warmup_steps
        self.clip_norm, self.selector = clip_norm, selector
        super().__init__(params, model, dict(lr=lr, momentum=momentum, weight_decay=weight_decay),
                         process_group)
        for group in self.param_groups:
            if group["momentum"] != momentum:
                raise ValueError(f"{name}: momentum is shared by all parameters (one flat state); "
                                 "set it per optimizer, not per param group")

    def options(self) -> dict:
        return {**super().options(), "density": self.density, "initial_density": self.initial_density,
                "warmup_steps": self.warmup_steps, "clip_norm": self.clip_norm, "selector": self.selector}

    def density_at(self, step: int) -> float:
        """Fraction of the elements sent at ``step`` (0-based): the sparsity warm-up schedule."""
        return dgc_density(step, self.density, self.warmup_steps, self.initial_density)

    def residual_sizes(self) -> dict[str, int]:
        return {"velocity": self.flat.numel}

    def _step(self) -> None:
        c = self.counters
        grad = self.flat.gradients()
        self.exchange.count_step(self.flat.numel)
        if any(group["weight_decay"] for group in self.param_groups):
            values = self.flat.values()
            for group, (start, end) in zip(self.param_groups, self.flat.ranges):
                if group["weight_decay"]:
                    grad[start:end].add_(values[start:end], alpha=group["weight_decay"])
        if self.clip_norm is not None:
            limit = self.clip_norm / math.sqrt(self.exchange.world_size)
            norm = grad.norm().double()  # on the device: no host read
            # a non-finite norm leaves g alone (the exchange carries it); the factor is rounded to
            # fp32 by mul_ as a Python float would be: the same values as reading the norm
            grad.mul_(torch.where(norm > limit, limit / norm, 1.0))
        momentum = self.buffer("momentum")
        updated = momentum * self.param_groups[0]["momentum"] + grad
        method = get_method("topk", ratio=self.density_at(c["step"]), selector=self.selector)
        total = self.exchange.mean(updated, method, "allgather", "velocity")
        if not bool(all_finite(total)):
            c["skipped_steps"] += 1
            return
        sent = method.decompress(self.exchange.last_payload,  # counted, not read: no host sync
                                 dropped=self.exchange.stats.dropped_counter(1, total.device)) != 0
        momentum.copy_(updated.masked_fill_(sent, 0.0))
        c["step"] += 1
        self.flat.apply(total, self.param_groups, None)  # the sum of the sent u / p: the mean
