"""The frame of every exchange-owning optimizer: checks, flat state, statistics, checkpoints, the
first-step check that every rank is configured alike, and ``torch.amp.GradScaler``.

- **Configuration across ranks.** At construction every rank compares its parameters (count,
  names, shapes, dtypes) before rank 0's are broadcast. At its first ``step()`` (and again at the first after a
  ``load_state_dict``) every rank compares :meth:`ExchangeOptimizer.config` with
  :func:`gradcomp.consistency.check_consistent`: the optimizer's options (method and its
  options, scheme, warm-up...), every param group's hyper-parameters (lr, betas, eps,
  weight_decay, momentum..., as torch resolved them, so a default written out on one rank
  compares equal to the same default left implicit on another), the parameters' names, shapes
  and dtypes, the step counter and whether a GradScaler drives it. Ranks configured differently
  would send mismatched collectives (a hang or a Gloo abort) or silently diverge (another lr);
  instead every rank raises ``ConfigMismatchError`` naming each differing key. The check runs at
  the first step, not at construction: a scheduler sets the first step's lr, and whether a
  GradScaler drives the optimizer is known only then. Later changes (a scheduler moving lr alike
  on every rank) are not compared again.
- **GradScaler.** ``_step_supports_amp_scaling`` makes ``GradScaler.step`` call ``step()`` on
  every rank, overflow or not, with ``found_inf`` and ``grad_scale`` set on the optimizer
  (torch's contract for optimizers that handle scaling). An optimizer whose every step may
  exchange (``collective_overflow``: ZeroOneAdam, DGC) all-reduces the overflow flag (MAX), so
  every rank skips the same steps, and writes the agreed flag back into the scaler (followed
  with :meth:`ExchangeOptimizer.follow_scaler`) so that ``scaler.update()`` changes the scale
  alike on every rank: DDP's all-reduced inf does the same for a plain optimizer. Without
  ``follow_scaler`` such an optimizer refuses at its first step. DiLoCo's inner steps are local:
  each rank skips its own overflowed inner step (no collective) and its outer steps stay on
  schedule. Gradients are unscaled in place (by the fp32 reciprocal of the scale computed in
  fp64, as ``GradScaler.unscale_``) before the step reads them.
- **Checkpoints.** ``state_dict()`` also records the rank, the world size and the parameters'
  names, shapes and dtypes; ``load_state_dict`` checks all of it, every flat buffer's length and
  the residuals' sizes against the live optimizer before it changes anything (ValueError naming
  what differs and what to do).
"""
from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from ..consistency import check_consistent
from ..feedback import ErrorFeedback
from ..hooks.stats import HookStats
from ..methods import METHODS, get_method
from ..schemes import FLAT_SCHEMES, SCHEMES
from .exchange import Exchange, FlatParameters, broadcast_parameters, check_local

IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Param-group entries that choose how torch computes a step, not what it computes; a rank may
resolve them differently (its device), so they are not compared across ranks."""

LIKE_PARAMETER = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                            "grad_avg", "acc_delta", "sum", "ax", "prev", "exp_inf", "step_size"})
"""Per-parameter state entries of torch's optimizers that have their parameter's shape (checked
when DiLoCo loads its inner optimizer's state)."""


def canonical(value):
    """``value`` as compared across ranks: numbers as Python numbers with integral floats as ints
    (``lr=1`` and ``lr=1.0`` alike), one-element tensors as their number, tuples as lists,
    dtypes as their names, anything else its repr."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return canonical(value.item())
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, int):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    return repr(value)


def hyper_parameters(group: dict) -> dict:
    """A param group's (or an optimizer's defaults') entries that must match across ranks."""
    return {k: canonical(v) for k, v in group.items() if k != "params" and k not in IMPLEMENTATION_KEYS}


def check_flat_method(owner: str, method, scheme: str) -> None:
    """Refuse a method/scheme the optimizers cannot send (they exchange one flat vector)."""
    if scheme in FLAT_SCHEMES:
        return
    usable = [name for name in METHODS if any(s in FLAT_SCHEMES for s in get_method(name).schemes)]
    raise ValueError(f"{owner}: method {method.name!r} exchanges tensor by tensor (scheme {scheme!r}), but "
                     f"the gradcomp optimizers send one flat vector through {', '.join(FLAT_SCHEMES)}; use "
                     f"one of {', '.join(usable)} (PowerSGD: the DDP hook gradcomp.hooks.PowerSGDState)")


class ExchangeOptimizer(torch.optim.Optimizer):
    """A torch optimizer that exchanges gradient information itself (see gradcomp.optim).

    Subclasses keep their state in flat fp32 vectors (``self.buffers``, in the order of
    ``self.flat``) and plain counters (``self.counters``); residuals live in
    ``self.exchange.feedback``. ``state_dict()`` holds all of it, so a resumed run is bit-exact.
    ``stats()``: raw and wire bytes over the run (as the DDP hooks count them), the ratio, and
    the steps skipped because the exchanged values were not finite or a GradScaler overflowed.
    Subclasses implement ``_step()`` (one step on the gradients in ``.grad``); ``step()`` runs
    the first-step configuration check and the GradScaler protocol (module doc) around it.
    """

    _step_supports_amp_scaling = True  # GradScaler.step calls step() on every rank (module doc)
    collective_overflow = True  # a GradScaler overflow on any rank skips the step on every rank

    def __init__(self, params, model, defaults: dict, process_group=None):
        super().__init__(params, defaults)
        check_local(model)
        self.process_group = process_group
        self.flat = FlatParameters(self.param_groups)
        module = getattr(model, "module", model)  # DDP's or the plain module's names alike
        names = {id(p): name for name, p in module.named_parameters()}
        self.parameter_names = [names.get(id(p), f"<parameter {i}>") for i, (p, _) in enumerate(self.flat.params)]
        self.exchange = Exchange(process_group)
        if dist.is_initialized() and self.exchange.world_size > 1:
            # before the broadcast, which other parameters would turn into a Gloo abort or a hang
            check_consistent(self._parameters_config(), process_group, self.flat.device,
                             f"the parameters of gradcomp.optim.{type(self).__name__}",
                             "every rank must build the same model and pass it the same parameters")
        broadcast_parameters([p for p, _ in self.flat.params], process_group)
        self.buffers: dict[str, torch.Tensor] = {}
        self.counters: dict[str, int] = {"step": 0, "skipped_steps": 0}
        self._checked = False  # the configuration check across ranks (first step, again after a load)
        self._scaler = None

    def options(self) -> dict:
        """The options that must match for a checkpoint to load (subclasses extend)."""
        return {"optimizer": type(self).__name__, "numel": self.flat.numel}

    # ---- configuration across ranks ---------------------------------------------------------
    def parameter_layout(self) -> list:
        """[name, shape, dtype] of every parameter, in the flat order."""
        return [[name, list(p.shape), str(p.dtype)] for name, (p, _) in zip(self.parameter_names, self.flat.params)]

    def _parameters_config(self) -> dict:
        """The parameters as compared across ranks: count, elements, and a digest of their names,
        shapes and dtypes (in param-group order)."""
        layout = json.dumps(self.parameter_layout())
        return {"parameters": len(self.flat.params), "numel": self.flat.numel,
                "parameter names, shapes and dtypes (digest)": hashlib.sha256(layout.encode()).hexdigest()[:16]}

    def config(self, grad_scaler: str = "none") -> dict:
        """What must be equal on every rank at the first step: :meth:`options`, each param
        group's hyper-parameters (``param_groups[i].lr``, ...), the parameters (count and a
        digest of names, shapes and dtypes; also checked at construction), the step counter and
        ``grad_scaler`` (how a GradScaler drives this optimizer). Values are :func:`canonical`."""
        config = {**self.options(), **self._parameters_config(), "step": self.counters["step"],
                  "grad_scaler": grad_scaler, "param_groups": len(self.param_groups)}
        for i, group in enumerate(self.param_groups):
            config.update((f"param_groups[{i}].{k}", v) for k, v in hyper_parameters(group).items())
        return canonical(config)

    def _check_configuration(self, grad_scaler: str) -> None:
        if self._checked:
            return
        if dist.is_initialized() and self.exchange.world_size > 1:
            check_consistent(self.config(grad_scaler), self.process_group, self.flat.device,
                             f"gradcomp.optim.{type(self).__name__}",
                             "every rank must build it with the same options and param-group "
                             "hyper-parameters over the same parameters, and step it alike")
        self._checked = True

    # ---- the step ----------------------------------------------------------------------------
    def follow_scaler(self, scaler) -> ExchangeOptimizer:
        """Step under ``scaler`` (a ``torch.amp.GradScaler``), the usual way
        (``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``): an overflow on
        any rank skips the step on every rank and every rank's scaler sees it (module doc).
        Needed by ZeroOneAdam and DGC; DiLoCo's inner steps are local and need no scaler of
        its own (accepted, no effect). Returns this optimizer."""
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"{type(self).__name__}.follow_scaler expects a torch.amp.GradScaler, "
                            f"got {type(scaler).__name__}")
        self._scaler = scaler
        return self

    def step(self, closure=None):
        """One step (the subclass's ``_step``), after the first-step configuration check; under
        ``GradScaler.step``: the overflow decision, then the gradients unscaled (module doc)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        scaled = found_inf is not None  # set by GradScaler.step (torch's _step_supports_amp_scaling)
        mode = "none" if not scaled else (
            "GradScaler, followed" if self.collective_overflow and self._scaler is not None else "GradScaler")
        self._check_configuration(mode)
        if scaled:
            if self._overflowed(found_inf):
                self._skip_overflow()
                return loss
            if grad_scale is not None:  # None: the caller ran scaler.unscale_(opt) already
                self._unscale(grad_scale)
        self._step()
        return loss

    def _step(self) -> None:
        raise NotImplementedError

    def _skip_overflow(self) -> None:
        """A step a GradScaler overflow skipped (on every rank): nothing changes but the count."""
        self.counters["skipped_steps"] += 1

    def _overflowed(self, found_inf: torch.Tensor) -> bool:
        """Whether this step overflowed: on any rank (``collective_overflow``, the agreed flag
        written back into the followed scaler), else on this one."""
        if not self.collective_overflow:
            return bool(torch.as_tensor(found_inf).item())
        name, scaler = type(self).__name__, self._scaler
        if scaler is None:
            raise RuntimeError(
                f"{name} is stepped by torch.amp.GradScaler, whose skip decision is per rank: after an "
                "overflow on one rank that rank would skip alone and the ranks would fall out of step "
                f"(a hang at the next exchange). Call opt.follow_scaler(scaler) once before training: "
                f"{name} then all-reduces the overflow flag, so every rank skips the same steps and "
                "every scaler backs off alike (docs/convergence.md, 'GradScaler')")
        states = getattr(scaler, "_per_optimizer_states", {})
        if id(self) not in states:
            raise RuntimeError(f"{name}.step was called by a GradScaler other than the one given to "
                               "follow_scaler; follow the scaler that steps this optimizer")
        per_device = states[id(self)].get("found_inf_per_device", {})
        flag = torch.as_tensor(found_inf).detach().reshape(1).to(torch.float32, copy=True)
        if dist.is_initialized() and self.exchange.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        for device_flag in per_device.values():  # what scaler.update() reads: alike on every rank
            device_flag.copy_(flag.reshape(()).to(device_flag.device))
        return bool(flag.item())

    def _unscale(self, grad_scale: torch.Tensor) -> None:
        """Every ``.grad`` times the fp32 reciprocal of ``grad_scale`` (computed in fp64, as
        GradScaler.unscale_: exact for its power-of-2 scales)."""
        inverse = grad_scale.double().reciprocal().float()
        grads = [p.grad for p, _ in self.flat.params if p.grad is not None]
        if grads:
            with torch.no_grad():  # one call for every gradient (one launch per device on CUDA)
                torch._foreach_mul_(grads, inverse.to(grads[0].device))

    # ---- state and statistics -----------------------------------------------------------------
    def buffer(self, name: str) -> torch.Tensor:
        """The flat fp32 state vector ``name`` (created as zeros)."""
        if name not in self.buffers:
            self.buffers[name] = self.flat.zeros()
        return self.buffers[name]

    def stats(self) -> dict:
        return {**self.exchange.stats.summary(), "skipped_steps": self.counters["skipped_steps"]}

    def position(self) -> tuple[int, int]:
        """(rank, world size) in this optimizer's group; (0, 1) without torch.distributed."""
        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def residual_sizes(self) -> dict[str, int]:
        """The sizes the flat residuals (by name) must have (subclasses: their exchange names)."""
        return {}

    def sent_numel(self, numel: int, method, scheme: str) -> int:
        """Elements ``method`` sends through ``scheme`` (default its first) for a vector of
        ``numel``, padding included: the size of its worker residual."""
        scheme = scheme or method.schemes[0]
        return SCHEMES[scheme].padded_numel(numel, self.position()[1], method.granule)

    def state_dict(self) -> dict:
        state = super().state_dict()
        rank, world_size = self.position()
        state["gradcomp"] = {"options": self.options(), "counters": dict(self.counters),
                             "buffers": {k: v.clone() for k, v in self.buffers.items()},
                             "exchange": self.exchange.state_dict(),
                             "rank": rank, "world_size": world_size, "parameters": self.parameter_layout()}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Set back :meth:`state_dict`'s output, saved by this rank of a run of the same world
        size over the same parameters; everything is checked (:meth:`_check_state`) before
        anything changes, so a refused checkpoint leaves this optimizer as it was. The
        configuration check across ranks runs again at the next step."""
        ours = self._check_state(state_dict)
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "gradcomp"})
        self.counters = dict(ours["counters"])
        self.buffers = {k: v.clone().to(self.flat.device) for k, v in ours["buffers"].items()}
        self.exchange.load_state_dict(ours["exchange"])
        self._checked = False

    def _check_state(self, state_dict: dict) -> dict:
        """Raise ValueError unless ``state_dict`` fits this optimizer (subclasses extend); its
        gradcomp part. Changes nothing."""
        name = f"{type(self).__name__}.load_state_dict"
        ours = state_dict.get("gradcomp") if isinstance(state_dict, dict) else None
        if ours is None:
            raise ValueError(f"{name}: not a gradcomp.optim checkpoint (no 'gradcomp' entry)")
        missing = {"options", "counters", "buffers", "exchange"} - set(ours)
        if missing:
            raise ValueError(f"{name}: the checkpoint is missing {sorted(missing)}")
        if ours.get("world_size") is not None:  # checkpoints of older versions hold no position
            rank, world_size = self.position()
            if ours["world_size"] != world_size:
                raise ValueError(
                    f"{name}: the checkpoint was saved by a run of world size {ours['world_size']}, this "
                    f"run has {world_size}; residuals and local state are per rank and do not carry "
                    f"over to another world size: resume with {ours['world_size']} ranks, or start this "
                    "optimizer afresh (skip load_state_dict)")
            if ours["rank"] != rank:
                raise ValueError(
                    f"{name}: the checkpoint holds rank {ours['rank']}'s state, this process is rank "
                    f"{rank}; save opt.state_dict() on every rank and load each rank's own")
        if ours["options"] != self.options():
            raise ValueError(f"{name}: checkpoint options {ours['options']} differ from this optimizer's "
                             f"{self.options()}; build the optimizer as the checkpointed run did")
        if ours.get("parameters") is not None:
            saved, live = ours["parameters"], self.parameter_layout()
            if len(saved) != len(live):
                raise ValueError(f"{name}: the checkpoint holds {len(saved)} parameters, this optimizer "
                                 f"{len(live)}; load the checkpoint of this model")
            for i, (s, l) in enumerate(zip(saved, live)):
                if list(s) != l:
                    raise ValueError(f"{name}: parameter {i} is {s[0]} {s[1]} {s[2]} in the checkpoint, "
                                     f"{l[0]} {l[1]} {l[2]} here; load the checkpoint of this model")
        groups = state_dict.get("param_groups", [])
        saved_groups = [len(g["params"]) for g in groups]
        live_groups = [len(g["params"]) for g in self.param_groups]
        if saved_groups != live_groups:
            raise ValueError(f"{name}: the checkpoint's param groups hold {saved_groups} parameters, "
                             f"this optimizer's {live_groups}; build the param groups as the checkpointed "
                             "run did")
        missing = set(self.counters) - set(ours["counters"])
        if missing:
            raise ValueError(f"{name}: the checkpoint's counters lack {sorted(missing)} (saved by another "
                             "optimizer or gradcomp version); start this optimizer afresh")
        for key, vector in ours["buffers"].items():
            if not isinstance(vector, torch.Tensor) or vector.dim() != 1 or vector.numel() != self.flat.numel:
                size = list(vector.shape) if isinstance(vector, torch.Tensor) else type(vector).__name__
                raise ValueError(f"{name}: state buffer {key!r} is {size}, this optimizer's parameters "
                                 f"have {self.flat.numel} elements (a truncated checkpoint, or another "
                                 "model's)")
        feedback, stats = ErrorFeedback(), HookStats()  # load into fresh ones: refused here if broken
        try:
            feedback.load_state_dict(ours["exchange"]["feedback"])
            stats.load_state_dict(ours["exchange"]["stats"])
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{name}: the checkpoint's exchange state is unreadable ({error!r})") from error
        for key, size in self.residual_sizes().items():
            held = ours["exchange"]["feedback"]["entries"].get(key, {}).get("residual")
            if held is not None:
                held = held.numel()
                if held != size:
                    raise ValueError(f"{name}: residual {key!r} holds {held} elements, this optimizer "
                                     f"sends {size} (a truncated checkpoint, or another model's)")
        return ours
