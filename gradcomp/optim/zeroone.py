"""ZeroOneAdam: AdamW whose ranks exchange compressed momentum (1-bit Adam / 0/1 Adam style).

Phases, by step t (0-based, counting applied steps):
- warm-up (t < warmup_steps): the local gradients are averaged (fp32 all-reduce, or
  ``warmup_method`` through ``warmup_scheme``, default its first, with error feedback) and AdamW
  runs unchanged: m and v from the mean gradient.
- variance refresh (0/1 Adam): after warm-up, at exponentially spaced steps
  (warmup_steps + r, then intervals 2r, 4r, ... for ``var_refresh_interval`` r; none at or
  after ``var_freeze_step``) a step runs as in warm-up; v changes at no other step (frozen).
- compressed steps: each rank's local momentum m_r <- b1 m_r + (1 - b1) g_r; every
  ``sync_every`` steps (with ``sync_growth`` G: every step after warm-up, the interval doubling
  every G steps up to ``sync_every``, as 0/1 Adam's local-step policy) the ranks exchange m_r
  compressed with ``method`` (scaled sign by default)
  through ``scheme`` (default the two-phase compressed all-reduce: worker and server error
  buffers), and the decoded mean replaces both the shared momentum m and every m_r. On the
  steps in between (local steps) the parameters move with the last shared m, so replicas stay
  bit-identical, while m_r keeps accumulating this rank's gradients: none is lost.
  With ``local_updates="own"`` (0/1 Adam's local steps) every rank instead moves with its own
  m_r on every step after warm-up, and the exchange (every ``sync_every`` steps) sends each
  rank's parameter change since the last exchange, D_r = anchor - p_r (the anchor being the
  parameters at that exchange, weight-decayed as they would be): every rank then sets
  p = anchor - mean(D_r) and moves the anchor there. Replicas are identical after every
  exchange (and through warm-up), not on the steps in between; the compression error of D is
  carried by error feedback to the next exchange, so no sign error is applied more than once.
  A variance refresh after warm-up averages the gradient into each rank's own m_r and moves
  each rank with it; the next exchange re-synchronises. (D is already divided by d, so
  ``compress_preconditioned`` concerns the shared mode only.)
Every step: p <- p (1 - lr wd) - lr m_hat / d with d = max(sqrt(v_hat), f mean(sqrt(v_hat))) + eps
(the mean over the parameter tensor, f = ``variance_floor``: with v frozen, compressed momentum on
an element without variance, e.g. an embedding row unseen in warm-up, must not divide by eps),
and Adam's bias corrections (v's by the number of variance updates). With
``compress_preconditioned`` (default) the ranks send m_r / d rather than m_r (d is shared, so
the mean is the same): sign's per-chunk scale then fits elements of every magnitude alike. A step whose exchanged values are not finite (a
non-finite gradient on any rank) is skipped on every rank (as GradScaler skips), and counted.
"""
from __future__ import annotations

import torch

from ..checks import check_number
from ..methods import all_finite, get_method
from ..schedules import COMPRESSED, FULL, sync_interval
from .base import ExchangeOptimizer, check_flat_method

LOCAL_UPDATES = ("shared", "own")


class ZeroOneAdam(ExchangeOptimizer):
    """AdamW with a full-precision warm-up, a frozen (or rarely refreshed) variance and 1-bit
    compressed momentum exchange. ``model``: the module trained (plain, or DDP after
    :func:`gradcomp.optim.local_gradients`). Wire bytes: ``stats()``."""

    def __init__(self, params, model, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, warmup_steps: int = 100, warmup_method: str | None = None,
                 warmup_options: dict | None = None, warmup_scheme: str = "", var_refresh_interval: int = 0,
                 var_freeze_step: int | None = None, sync_every: int = 1, sync_growth: int = 0,
                 method: str = "sign", method_options: dict | None = None, scheme: str = "twophase",
                 variance_floor: float = 0.1, compress_preconditioned: bool = True,
                 local_updates: str = "shared", process_group=None):
        name = "ZeroOneAdam"
        check_number(name, "lr", lr, 0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{name}: betas must be a pair (beta1, beta2), got {betas!r}")
        for i, beta in enumerate(betas):
            check_number(name, f"betas[{i}]", beta, 0.0, 1.0, high_open=True)
        check_number(name, "eps", eps, 0.0, low_open=True)
        check_number(name, "weight_decay", weight_decay, 0.0)
        check_number(name, "warmup_steps", warmup_steps, 0, integer=True)
        check_number(name, "var_refresh_interval", var_refresh_interval, 0, integer=True)
        if var_freeze_step is not None:
            check_number(name, "var_freeze_step", var_freeze_step, 0, integer=True)
        check_number(name, "sync_every", sync_every, 1, integer=True)
        check_number(name, "sync_growth", sync_growth, 0, integer=True)
        check_number(name, "variance_floor", variance_floor, 0.0, 1.0)
        if not isinstance(compress_preconditioned, bool):
            raise ValueError(f"{name}: compress_preconditioned must be True or False, got {compress_preconditioned!r}")
        if local_updates not in LOCAL_UPDATES:
            raise ValueError(f"{name}: local_updates must be one of {LOCAL_UPDATES}, got {local_updates!r}")
        self.method = get_method(method, **(method_options or {}))
        if scheme not in self.method.schemes:
            raise ValueError(f"{name}: {self.method.name} offers schemes {self.method.schemes}, got {scheme!r}")
        check_flat_method(name, self.method, scheme)
        self.warmup_method = None if warmup_method is None else get_method(warmup_method, **(warmup_options or {}))
        if warmup_scheme and (self.warmup_method is None or warmup_scheme not in self.warmup_method.schemes):
            offered = self.warmup_method.schemes if self.warmup_method else ("fp32 all-reduce only",)
            raise ValueError(f"{name}: warmup_scheme {warmup_scheme!r} is not offered by the warm-up "
                             f"method ({', '.join(offered)})")
        if self.warmup_method is not None:
            check_flat_method(f"{name} (warmup_method)", self.warmup_method,
                              warmup_scheme or self.warmup_method.schemes[0])
        self.warmup_scheme = warmup_scheme
        self.scheme = scheme
        self.warmup_steps, self.var_refresh_interval = warmup_steps, var_refresh_interval
        self.var_freeze_step, self.sync_every, self.sync_growth = var_freeze_step, sync_every, sync_growth
        self.variance_floor, self.compress_preconditioned = variance_floor, compress_preconditioned
        self.local_updates = local_updates
        super().__init__(params, model, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay),
                         process_group)
        for group in self.param_groups:
            if tuple(group["betas"]) != tuple(betas) or group["eps"] != eps:
                raise ValueError(f"{name}: betas and eps are shared by all parameters (one flat "
                                 "state); set them per optimizer, not per param group")
        self.counters.update(variance_updates=0, since_sync=0, refresh_interval=var_refresh_interval,
                             next_refresh=warmup_steps + var_refresh_interval if var_refresh_interval else -1,
                             full_steps=0, compressed_steps=0, local_steps=0, diverged=0)
        if local_updates == "own":  # the parameters of the last exchange (all ranks alike)
            self.buffers["anchor"] = self.flat.values()

    def options(self) -> dict:
        return {**super().options(), "method": self.method.name, "method_options": self.method.options(),
                "scheme": self.scheme, "warmup_steps": self.warmup_steps,
                "warmup_method": None if self.warmup_method is None else self.warmup_method.name,
                "warmup_options": None if self.warmup_method is None else self.warmup_method.options(),
                "warmup_scheme": self.warmup_scheme,
                "var_refresh_interval": self.var_refresh_interval, "var_freeze_step": self.var_freeze_step,
                "sync_every": self.sync_every, "sync_growth": self.sync_growth,
                "variance_floor": self.variance_floor,
                "compress_preconditioned": self.compress_preconditioned, "local_updates": self.local_updates}

    def state_dict(self) -> dict:
        """As every gradcomp.optim optimizer's; with ``local_updates="own"`` also this rank's
        parameters (they differ between exchanges), which :meth:`load_state_dict` sets back:
        a resume is exact whatever the order of model and optimizer loading."""
        state = super().state_dict()
        if self.local_updates == "own":
            state["gradcomp"]["local_parameters"] = self.flat.values()
        return state

    def _check_state(self, state_dict: dict) -> dict:
        ours = super()._check_state(state_dict)  # the options, local_updates among them
        local = ours.get("local_parameters")
        if self.local_updates == "own" and (not isinstance(local, torch.Tensor) or local.numel() != self.flat.numel):
            held = list(local.shape) if isinstance(local, torch.Tensor) else local
            raise ValueError(f"ZeroOneAdam.load_state_dict: local_parameters is {held}, this optimizer's "
                             f"parameters have {self.flat.numel} elements (a truncated checkpoint, or "
                             "another model's)")
        return ours

    def load_state_dict(self, state_dict: dict) -> None:
        local = state_dict.get("gradcomp", {}).get("local_parameters")
        super().load_state_dict(state_dict)  # checks everything first (_check_state)
        if local is not None:
            self.flat.assign(local.to(self.flat.device))

    def phase(self, step: int) -> str:
        """``full`` (warm-up or variance refresh) or ``compressed`` for step ``step``."""
        c = self.counters
        refresh = (step == c["next_refresh"] and
                   (self.var_freeze_step is None or step < self.var_freeze_step))
        return FULL if step < self.warmup_steps or refresh else COMPRESSED

    def residual_sizes(self) -> dict[str, int]:
        n = self.flat.numel
        sizes = {"update" if self.local_updates == "own" else "momentum": self.sent_numel(n, self.method, self.scheme)}
        if self.warmup_method is not None:
            sizes["gradient"] = self.sent_numel(n, self.warmup_method, self.warmup_scheme)
        return sizes

    def _step(self) -> None:
        grad = self.flat.gradients()
        self.exchange.count_step(self.flat.numel)
        own = self.local_updates == "own"
        if self.phase(self.counters["step"]) == FULL:
            applied = self._full_step(grad, own)
        elif own:
            applied = self._own_step(grad)
        else:
            applied = self._shared_step(grad)
        if applied is None:  # skipped on every rank
            self.counters["skipped_steps"] += 1
            return
        c = self.counters
        c["step"] += 1
        if applied is not True:  # not yet applied: move the parameters with this momentum
            beta1 = self.param_groups[0]["betas"][0]
            update = applied / (self.buffer("denominator") * (1 - beta1 ** c["step"]))
            self.flat.apply(update, self.param_groups, "weight_decay")
            if own:
                if c["diverged"]:
                    self.flat.advance(self.buffer("anchor"), None, self.param_groups, "weight_decay")
                else:
                    self.buffer("anchor").copy_(self.flat.values())

    def _full_step(self, grad: torch.Tensor, own: bool) -> torch.Tensor | None:
        """Warm-up or variance refresh: the mean gradient updates v and the momentum (own mode:
        each rank's m_r, shared until the first local step). Returns the momentum to apply."""
        group, c = self.param_groups[0], self.counters
        beta1, beta2 = group["betas"]
        mean = self.exchange.mean(grad, self.warmup_method, self.warmup_scheme, "gradient",
                                  error_feedback=self.warmup_method is not None)
        if not bool(all_finite(mean)):
            return None
        local = self.buffer("local_momentum")
        if own:
            local.mul_(beta1).add_(mean, alpha=1 - beta1)
            if c["compressed_steps"] or c["local_steps"]:  # the ranks' momenta differ from here on
                c["diverged"] = 1
        else:
            momentum = self.buffer("momentum")
            momentum.mul_(beta1).add_(mean, alpha=1 - beta1)
            local.copy_(momentum)
        self.buffer("variance").mul_(beta2).addcmul_(mean, mean, value=1 - beta2)
        c["variance_updates"] += 1
        self._update_denominator(beta2, group["eps"])
        c["since_sync"] = 0
        c["full_steps"] += 1
        t = c["step"]
        if t == c["next_refresh"]:
            c["refresh_interval"] *= 2
            c["next_refresh"] = t + c["refresh_interval"]
        return local if own else self.buffer("momentum")

    def _shared_step(self, grad: torch.Tensor) -> torch.Tensor | None:
        """Compressed or local step of the shared mode; returns the shared momentum to apply."""
        c, beta1 = self.counters, self.param_groups[0]["betas"][0]
        momentum, local = self.buffer("momentum"), self.buffer("local_momentum")
        denominator = self.buffer("denominator")
        updated = local * beta1 + grad * (1 - beta1)
        if c["since_sync"] + 1 >= self._sync_every_now():
            sent = updated / denominator if self.compress_preconditioned else updated
            mean = self.exchange.mean(sent, self.method, self.scheme, "momentum")
            if not bool(all_finite(mean)):
                return None
            momentum.copy_(mean.mul_(denominator) if self.compress_preconditioned else mean)
            local.copy_(momentum)
            c["since_sync"] = 0
            c["compressed_steps"] += 1
        else:
            # a non-finite local gradient is dropped, on this rank only (decided on the device)
            local.copy_(torch.where(torch.isfinite(updated).all(), updated, local))
            c["since_sync"] += 1
            c["local_steps"] += 1
        return momentum

    def _own_step(self, grad: torch.Tensor) -> torch.Tensor | bool | None:
        """Compressed or local step of the own mode (0/1 Adam): a local step returns this rank's
        momentum to apply; an exchange step sets the parameters itself and returns True."""
        c, beta1 = self.counters, self.param_groups[0]["betas"][0]
        local = self.buffer("local_momentum")
        updated = local * beta1 + grad * (1 - beta1)
        if c["since_sync"] + 1 < self._sync_every_now():
            # a non-finite local gradient is dropped, on this rank only (decided on the device)
            local.copy_(torch.where(torch.isfinite(updated).all(), updated, local))
            c["since_sync"] += 1
            c["local_steps"] += 1
            c["diverged"] = 1
            return local
        update = updated / (self.buffer("denominator") * (1 - beta1 ** (c["step"] + 1)))
        moved, anchor = self.flat.values(), self.buffer("anchor").clone()
        self.flat.advance(moved, update, self.param_groups, "weight_decay")
        self.flat.advance(anchor, None, self.param_groups, "weight_decay")
        mean = self.exchange.mean(anchor - moved, self.method, self.scheme, "update")
        if not bool(all_finite(mean)):
            return None
        local.copy_(updated)
        anchor.sub_(mean)
        self.flat.assign(anchor)
        self.buffers["anchor"] = anchor
        c["since_sync"] = c["diverged"] = 0
        c["compressed_steps"] += 1
        return True

    def _sync_every_now(self) -> int:
        return sync_interval(self.counters["step"], self.warmup_steps, self.sync_every, self.sync_growth)

    def _update_denominator(self, beta2: float, eps: float) -> None:
        """denominator <- max(sqrt(v_hat), floor x mean sqrt(v_hat) of the parameter) + eps: v is
        frozen between its updates, so compressed momentum on an element whose variance is ~0
        (no gradient during warm-up: an unseen embedding row) cannot divide by ~eps."""
        root = (self.buffer("variance") / (1 - beta2 ** self.counters["variance_updates"])).sqrt_()
        if self.variance_floor:
            for p, offset in self.flat.params:
                piece = root[offset:offset + p.numel()]
                # the bound stays on the device (no host read per parameter); in float64, rounded
                # to fp32 by clamp_ as a Python float would be: the same values
                piece.clamp_(min=piece.mean().double() * self.variance_floor)
        self.buffer("denominator").copy_(root.add_(eps))
