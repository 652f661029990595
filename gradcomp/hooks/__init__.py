"""DDP communication hooks: drop-ins for ``DistributedDataParallel.register_comm_hook``.

    from gradcomp.hooks import Int8State, int8_hook
    model.register_comm_hook(Int8State(process_group=None), int8_hook)
    state = gradcomp.hooks.register(model, "powersgd", matrix_rank=4)   # the same, in one line

Every registered method has a hook: its first scheme's (``Method.schemes``), or the one named by
``scheme=``; ``HOOKS`` lists them, derived from the method registry. ``register(model, "auto")``
measures the link and the methods' costs while training and chooses (:mod:`.auto`).
"""
from __future__ import annotations

from collections.abc import Mapping

from ..consistency import ConfigMismatchError
from ..methods import METHODS, UNCOMPRESSED, get_method
from ..methods.powersgd import PowerSGD
from .auto import AutoState, auto_hook
from .base import HookState
from .compressed import (AllreduceState, BF16State, CompressedState, FP16State, Int4State,
                         Int8State, SignState, TopKState, allreduce_hook, bf16_hook, compressed_hook,
                         fp16_hook, int4_hook, int8_hook, method_hook, sign_hook, state_class,
                         topk_hook)
from .hierarchical import HierarchicalState, hierarchical_hook
from .powersgd import PowerSGDState, powersgd_hook
from .stats import HookStats


def hook_for(method: str):
    """(hook, state class) of ``"none"`` (``UNCOMPRESSED``: :func:`allreduce_hook`, fp32
    uncompressed), ``"auto"`` or a registered method."""
    if method == UNCOMPRESSED:
        return allreduce_hook, AllreduceState
    if method == "auto":
        return auto_hook, AutoState
    spec = get_method(method) if method in METHODS else None
    if spec is None:
        raise ValueError(f"unknown hook method {method!r}; choose auto or one of {', '.join(HOOKS)}")
    if spec.per_tensor:
        if not isinstance(spec, PowerSGD):
            raise ValueError(f"{method}: the lowrank scheme's hook is PowerSGD's own (powersgd_hook)")
        return powersgd_hook, PowerSGDState
    return compressed_hook, state_class(method)


class _Hooks(Mapping):
    """``HOOKS[name]`` -> (hook, state class), for "none" and every registered method."""

    def __getitem__(self, method):
        if method != UNCOMPRESSED and method not in METHODS:
            raise KeyError(method)
        return hook_for(method)

    def __iter__(self):
        return iter((UNCOMPRESSED, *METHODS))

    def __len__(self) -> int:
        return 1 + len(METHODS)


HOOKS: Mapping = _Hooks()


def register(model, method: str, process_group=None, *, hierarchical: bool = False,
             **options) -> HookState:
    """Build the state for ``method`` (a key of HOOKS) with ``options``, register its hook on the
    DDP ``model`` and return the state. ``process_group`` defaults to the model's own group.
    ``hierarchical``: reduce exactly inside each node and compress only between nodes
    (:mod:`.hierarchical`; ``node_size=`` defaults to LOCAL_WORLD_SIZE)."""
    if hierarchical:
        hook, state_cls, options = hierarchical_hook, HierarchicalState, {"method": method, **options}
    else:
        hook, state_cls = hook_for(method)
    if not hasattr(model, "register_comm_hook"):
        raise TypeError(f"register expects a DistributedDataParallel model, got {type(model).__name__}")
    group = process_group if process_group is not None else getattr(model, "process_group", None)
    state = state_cls(group, **options).bind(model)
    model.register_comm_hook(state, hook)
    return state


__all__ = ["HOOKS", "register", "hook_for", "HookState", "HookStats",
           "ConfigMismatchError", "CompressedState", "AllreduceState", "FP16State", "BF16State",
           "Int8State", "Int4State", "SignState", "TopKState", "state_class", "allreduce_hook",
           "compressed_hook", "method_hook", "fp16_hook", "bf16_hook", "int8_hook", "int4_hook",
           "sign_hook", "topk_hook", "PowerSGDState", "powersgd_hook", "HierarchicalState",
           "hierarchical_hook", "AutoState", "auto_hook"]
