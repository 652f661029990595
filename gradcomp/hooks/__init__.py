"""DDP communication hooks: drop-ins for ``DistributedDataParallel.register_comm_hook``.

    from gradcomp.hooks import Int8State, int8_hook
    model.register_comm_hook(Int8State(process_group=None), int8_hook)
    state = gradcomp.hooks.register(model, "powersgd", rank=4)     # the same, in one line
"""
from __future__ import annotations

from .base import BucketResiduals, ConfigMismatchError, HookState
from .compressed import (HOOKS, SCHEMES, AllreduceState, BF16State, CompressedState, FP16State,
                         Int8State, SignState, TopKState, allreduce_hook, bf16_hook, fp16_hook,
                         int8_hook, sign_hook, topk_hook)
from .stats import HookStats

try:  # written alongside; absent in a partial checkout
    from .powersgd import PowerSGDState, powersgd_hook
except ImportError:  # pragma: no cover
    PowerSGDState = powersgd_hook = None
else:
    HOOKS["powersgd"] = (powersgd_hook, PowerSGDState)


def register(model, method: str, process_group=None, **options) -> HookState:
    """Build the state for ``method`` (a key of HOOKS) with ``options``, register its hook on the
    DDP ``model`` and return the state. ``process_group`` defaults to the model's own group."""
    if method not in HOOKS:
        raise ValueError(f"unknown hook method {method!r}; choose one of {', '.join(sorted(HOOKS))}")
    if not hasattr(model, "register_comm_hook"):
        raise TypeError(f"register expects a DistributedDataParallel model, got {type(model).__name__}")
    hook, state_cls = HOOKS[method]
    group = process_group if process_group is not None else getattr(model, "process_group", None)
    state = state_cls(group, **options).bind(model)
    model.register_comm_hook(state, hook)
    return state


__all__ = ["HOOKS", "SCHEMES", "register", "HookState", "HookStats", "BucketResiduals",
           "ConfigMismatchError", "CompressedState", "AllreduceState", "FP16State", "BF16State",
           "Int8State", "SignState", "TopKState", "allreduce_hook", "fp16_hook", "bf16_hook",
           "int8_hook", "sign_hook", "topk_hook", "PowerSGDState", "powersgd_hook"]
