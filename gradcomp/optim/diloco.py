"""DiLoCo: local inner steps, then an outer step on the compressed mean pseudo-gradient.

Every rank runs ``sync_every`` (H) steps of its own inner optimizer (AdamW by default) on its own
gradients (DDP's all-reduce off: :func:`gradcomp.optim.local_gradients`); the replicas drift
apart. After every H-th inner step each rank sends its pseudo-gradient D_r = anchor - p_r (the
anchor: the parameters all ranks shared after the last outer step) compressed with ``method``
through ``scheme``, with error feedback (what compression dropped is sent at the next outer
step), and every rank decodes the same mean D. The outer optimizer, SGD with (Nesterov)
momentum on the anchor, then runs

    u <- outer_momentum u + D;   anchor <- anchor - outer_lr (D + outer_momentum u)   (Nesterov)
                                 anchor <- anchor - outer_lr u                        (plain)

and every rank's parameters are set to the new anchor: the replicas are bit-identical after
every outer step, not on the inner steps in between (Douillard et al., 2023, "DiLoCo";
INTELLECT-1 sends int8 pseudo-gradients; SparseLoCo top-k with error feedback). With
outer_lr 1 and outer_momentum 0 an outer step is plain averaging of the replicas (local SGD).

Streaming form (``fragments`` F > 1, Streaming DiLoCo): the flat parameter vector is cut into
F equal ranges (``fragment_bounds``), each with its own anchor, momentum and residual; fragment
f has its outer step after inner step t when (t + 1 + f H // F) is a multiple of H
(``fragments_due``), so the F exchanges of one period are staggered over its inner steps and
each sends 1/F of the model. A fragment's replicas are identical after its own outer step.

A pseudo-gradient that decodes non-finite (a non-finite value on any rank: every rank sees
it) skips that outer step on every rank: the anchor, its momentum and the residuals stay as
they were, and every rank returns the fragment to its anchor (its inner steps are dropped). A
rank whose parameters or inner optimizer state are not finite returns every fragment to its
anchor and starts the inner optimizer afresh. The inner optimizer's param groups are this
optimizer's, so an lr scheduler on it schedules the inner learning rate.

Under ``torch.amp.GradScaler`` a rank whose gradients overflowed skips its own inner step (the
inner steps are local: no collective), and its step still counts, so every rank's outer steps
stay on schedule (gradcomp.optim.base).
"""
from __future__ import annotations

import copy

import torch

from ..checks import check_number
from ..methods import all_finite, get_method
from ..schedules import fragment_bounds, fragments_due
from .base import LIKE_PARAMETER, ExchangeOptimizer, check_flat_method, hyper_parameters


class DiLoCo(ExchangeOptimizer):
    """Inner optimizer ``inner(params, **inner_options)`` (default AdamW) for ``sync_every``
    local steps, then a Nesterov-SGD outer step on the mean pseudo-gradient sent with
    ``method`` (a registered gradcomp method, or None: fp32 all-reduce) through ``scheme``
    (default: the method's first), in ``fragments`` staggered pieces (1: the whole model at
    once). ``model``: the module trained (plain, or DDP after
    :func:`gradcomp.optim.local_gradients`). ``stats()``: raw bytes (4 per parameter per
    inner step, what DDP would send), wire bytes, outer steps (one per fragment exchange) and
    skipped outer steps."""

    collective_overflow = False  # inner steps are local: a GradScaler overflow skips this rank's only

    def __init__(self, params, model, inner=torch.optim.AdamW, inner_options: dict | None = None, *,
                 sync_every: int = 100, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, method: str | None = "int8", method_options: dict | None = None,
                 scheme: str = "", fragments: int = 1, process_group=None):
        name = "DiLoCo"
        check_number(name, "sync_every", sync_every, 1, integer=True)
        check_number(name, "outer_lr", outer_lr, 0.0, low_open=True)
        check_number(name, "outer_momentum", outer_momentum, 0.0, 1.0, high_open=True)
        check_number(name, "fragments", fragments, 1, sync_every, integer=True)
        if not isinstance(nesterov, bool):
            raise ValueError(f"{name}: nesterov must be True or False, got {nesterov!r}")
        if not (isinstance(inner, type) and issubclass(inner, torch.optim.Optimizer)):
            raise ValueError(f"{name}: inner must be a torch.optim.Optimizer class (e.g. torch.optim.AdamW), "
                             f"got {inner!r}")
        if method is None:
            if scheme:
                raise ValueError(f"{name}: scheme {scheme!r} needs a method; method None sends fp32 "
                                 "through an all-reduce")
            self.method = None
        else:
            self.method = get_method(method, **(method_options or {}))
            scheme = scheme or self.method.schemes[0]
            if scheme not in self.method.schemes:
                raise ValueError(f"{name}: {self.method.name} offers schemes {self.method.schemes}, "
                                 f"got {scheme!r}")
            check_flat_method(name, self.method, scheme)
        self.scheme = scheme
        self.sync_every, self.outer_lr, self.outer_momentum, self.nesterov, self.fragments = (
            sync_every, outer_lr, outer_momentum, nesterov, fragments)
        self.inner = inner(params, **(inner_options or {}))
        super().__init__(self.inner.param_groups, model, {}, process_group)
        self.param_groups = self.inner.param_groups  # one list: schedulers set the inner lr
        if fragments > self.flat.numel:
            raise ValueError(f"{name}: fragments must be at most the number of parameters "
                             f"({self.flat.numel}), got {fragments}")
        self.bounds = fragment_bounds(self.flat.numel, fragments)
        self.counters.update(outer_steps=0, skipped_inner_steps=0)
        self.buffers["anchor"] = self.flat.values()  # rank 0's parameters (broadcast)

    def options(self) -> dict:
        return {**super().options(), "inner": type(self.inner).__name__, "inner_defaults": self.inner.defaults,
                "sync_every": self.sync_every, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                "nesterov": self.nesterov, "method": None if self.method is None else self.method.name,
                "method_options": None if self.method is None else self.method.options(), "scheme": self.scheme,
                "fragments": self.fragments}

    def config(self, grad_scaler: str = "none") -> dict:
        """As every gradcomp.optim optimizer's (checked across ranks at the first step), with
        the inner optimizer's defaults compared as its param groups are (hyper-parameters only)."""
        config = super().config(grad_scaler)
        config["inner_defaults"] = hyper_parameters(self.inner.defaults)
        return config

    def residual_sizes(self) -> dict[str, int]:
        if self.method is None:  # fp32: no residual
            return {}
        return {f"fragment{f}": self.sent_numel(end - start, self.method, self.scheme)
                for f, (start, end) in enumerate(self.bounds)}

    def stats(self) -> dict:
        """As every gradcomp.optim optimizer's, plus ``outer_steps`` and ``skipped_inner_steps``
        (inner steps this rank skipped on a GradScaler overflow)."""
        return {**super().stats(), "outer_steps": self.counters["outer_steps"],
                "skipped_inner_steps": self.counters["skipped_inner_steps"]}

    def state_dict(self) -> dict:
        """As every gradcomp.optim optimizer's (anchor, outer momentum, residuals, counters),
        plus the inner optimizer's state and this rank's parameters (they differ between outer
        steps), which :meth:`load_state_dict` sets back: a resume is exact from any step."""
        state = super().state_dict()
        state["gradcomp"]["inner"] = copy.deepcopy(self.inner.state_dict())
        state["gradcomp"]["local_parameters"] = self.flat.values()
        return state

    def _check_state(self, state_dict: dict) -> dict:
        """As every gradcomp.optim optimizer's, plus the inner optimizer's param groups and the
        per-parameter state that has its parameter's shape, and this rank's parameters."""
        ours = super()._check_state(state_dict)
        missing = {"inner", "local_parameters"} - set(ours)
        if missing:
            raise ValueError(f"DiLoCo.load_state_dict: missing {sorted(missing)} (not a DiLoCo checkpoint, or "
                             "an incomplete one): load what DiLoCo.state_dict() saved")
        if ours["local_parameters"].numel() != self.flat.numel:
            raise ValueError(f"DiLoCo.load_state_dict: the checkpoint holds {ours['local_parameters'].numel()} "
                             f"parameters, this model has {self.flat.numel}")
        inner = ours["inner"]
        saved_groups = [len(g["params"]) for g in inner["param_groups"]]
        groups = [len(g["params"]) for g in self.inner.param_groups]
        if saved_groups != groups:
            raise ValueError(f"DiLoCo.load_state_dict: the inner optimizer's param groups hold {saved_groups} "
                             f"parameters, this one's {groups}")
        # torch maps the saved ids to the live parameters in param-group order
        saved_ids = [i for g in inner["param_groups"] for i in g["params"]]
        params = dict(zip(saved_ids, (p for g in self.inner.param_groups for p in g["params"])))
        names = dict(zip(saved_ids, self.parameter_names))
        for index, per_param in inner["state"].items():
            p = params.get(index)
            for key, value in per_param.items() if p is not None else ():
                if key in LIKE_PARAMETER and isinstance(value, torch.Tensor) and value.shape != p.shape:
                    raise ValueError(f"DiLoCo.load_state_dict: the inner optimizer's {key!r} of parameter "
                                     f"{names[index]} is {list(value.shape)}, the parameter {list(p.shape)} "
                                     "(a truncated checkpoint, or another model's)")
        return ours

    def load_state_dict(self, state_dict: dict) -> None:
        """Set back :meth:`state_dict`'s output. A checkpoint refused here (options, a missing
        part, another rank's or world size's, another model's parameters, param groups or
        state sizes) leaves this optimizer as it was."""
        ours = state_dict["gradcomp"] if isinstance(state_dict, dict) and "gradcomp" in state_dict else {}
        super().load_state_dict(state_dict)  # checks everything first (_check_state)
        self.inner.load_state_dict(ours["inner"])
        self.param_groups = self.inner.param_groups
        self.flat.assign(ours["local_parameters"].to(self.flat.device))

    def _step(self, inner: bool = True) -> None:
        """One inner step (none on a GradScaler overflow: ``inner`` False), then the outer step
        of each fragment due (see the module doc)."""
        if inner:
            self.inner.step()
        self.exchange.count_step(self.flat.numel)
        for fragment in fragments_due(self.counters["step"], self.sync_every, self.fragments):
            self._outer_step(fragment)
        self.counters["step"] += 1

    def _skip_overflow(self) -> None:
        """A GradScaler overflow on this rank: its inner step is skipped, the step still counts
        (the outer steps stay on every rank's schedule)."""
        self.counters["skipped_inner_steps"] += 1
        self._step(inner=False)

    def _outer_step(self, fragment: int) -> None:
        start, end = self.bounds[fragment]
        anchor, values = self.buffer("anchor")[start:end], self.flat.values()
        residuals = self.exchange.feedback.state_dict()  # restored if the step is skipped
        mean = self.exchange.mean(anchor - values[start:end], self.method, self.scheme, f"fragment{fragment}")
        if not bool(all_finite(mean)):  # the same decision on every rank: the mean decodes alike
            self.exchange.feedback.load_state_dict(residuals)
            self.counters["skipped_steps"] += 1
            if not (bool(all_finite(values)) and self._inner_state_finite()):  # this rank diverged
                self.inner.state.clear()
                values = self.buffer("anchor").clone()
            values[start:end] = anchor
            self.flat.assign(values)
            return
        momentum = self.buffer("outer_momentum")[start:end]
        momentum.mul_(self.outer_momentum).add_(mean)
        update = mean.add_(momentum, alpha=self.outer_momentum) if self.nesterov else momentum
        anchor.sub_(update, alpha=self.outer_lr)
        values[start:end] = anchor
        self.flat.assign(values)
        self.counters["outer_steps"] += 1

    def _inner_state_finite(self) -> bool:
        """Whether every floating tensor of this rank's inner optimizer state is finite."""
        return all(bool(all_finite(v)) for per_param in self.inner.state.values() for v in per_param.values()
                   if isinstance(v, torch.Tensor) and v.is_floating_point())
