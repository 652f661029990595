"""The frame of every exchange-owning optimizer: checks, flat state, statistics, checkpoints."""
from __future__ import annotations

import torch

from .exchange import Exchange, FlatParameters, broadcast_parameters, check_local


class ExchangeOptimizer(torch.optim.Optimizer):
    """A torch optimizer that exchanges gradient information itself (see gradcomp.optim).

    Subclasses keep their state in flat fp32 vectors (``self.buffers``, in the order of
    ``self.flat``) and plain counters (``self.counters``); residuals live in
    ``self.exchange.feedback``. ``state_dict()`` holds all of it, so a resumed run is bit-exact.
    ``stats()``: raw and wire bytes over the run (as the DDP hooks count them), the ratio, and
    the steps skipped because the exchanged values were not finite.
    """

    def __init__(self, params, model, defaults: dict, process_group=None):
        super().__init__(params, defaults)
        check_local(model)
        self.process_group = process_group
        broadcast_parameters([p for g in self.param_groups for p in g["params"]], process_group)
        self.flat = FlatParameters(self.param_groups)
        self.exchange = Exchange(process_group)
        self.buffers: dict[str, torch.Tensor] = {}
        self.counters: dict[str, int] = {"step": 0, "skipped_steps": 0}

    def options(self) -> dict:
        """The options that must match for a checkpoint to load (subclasses extend)."""
        return {"optimizer": type(self).__name__, "numel": self.flat.numel}

    def buffer(self, name: str) -> torch.Tensor:
        """The flat fp32 state vector ``name`` (created as zeros)."""
        if name not in self.buffers:
            self.buffers[name] = self.flat.zeros()
        return self.buffers[name]

    def stats(self) -> dict:
        return {**self.exchange.stats.summary(), "skipped_steps": self.counters["skipped_steps"]}

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["gradcomp"] = {"options": self.options(), "counters": dict(self.counters),
                             "buffers": {k: v.clone() for k, v in self.buffers.items()},
                             "exchange": self.exchange.state_dict()}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        ours = state_dict.pop("gradcomp", None)
        if ours is None:
            raise ValueError(f"{type(self).__name__}.load_state_dict: not a gradcomp.optim checkpoint "
                             "(no 'gradcomp' entry)")
        if ours["options"] != self.options():
            raise ValueError(f"{type(self).__name__}.load_state_dict: checkpoint options "
                             f"{ours['options']} differ from this optimizer's {self.options()}")
        super().load_state_dict(state_dict)
        self.counters = dict(ours["counters"])
        self.buffers = {k: v.clone().to(self.flat.device) for k, v in ours["buffers"].items()}
        self.exchange.load_state_dict(ours["exchange"])
