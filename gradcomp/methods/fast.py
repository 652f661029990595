"""The fast CPU path: a method's elementwise math, written once in torch, compiled for big tensors.

Eager torch runs a chain of ops, each a full pass over memory (an int8 encode is ~7 passes).
``torch.compile`` fuses the same function into one C++/OpenMP loop per output on the CPU, so the
math that defines a method is also its fast path; small tensors, where compile time and dispatch
dominate, stay eager. ``GRADCOMP_CPU_COMPILE=0`` turns compilation off (eager everywhere),
``GRADCOMP_CPU_COMPILE_MIN`` sets the size threshold in elements (default 1M).
"""
from __future__ import annotations

import functools
import os

import torch


def _compile_threshold() -> int | None:
    if os.environ.get("GRADCOMP_CPU_COMPILE", "1").strip() in ("0", "false", "no", "off"):
        return None
    return int(os.environ.get("GRADCOMP_CPU_COMPILE_MIN", 1 << 20))


def cpu_fast(fn):
    """Decorate a pure tensor function: compiled for CPU tensors of >= threshold elements."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args):
        nonlocal compiled
        threshold = _compile_threshold()
        if threshold is None or x.is_cuda or x.numel() < threshold:
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(x, *args)

    wrapper.eager = fn
    return wrapper
