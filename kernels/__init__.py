"""Fused Triton kernels, one module per method family (installed as gradcomp.kernels).

Each family of ``FAMILIES`` (cast: fp16/bf16, quant: int8/int4, sign, topk, powersgd) has
@triton.jit kernels, a launcher per operation and ``compile_cases()``.
common: configs, dtype plumbing, exact rounding; traffic: byte counting under TRITON_INTERPRET=1;
declared: every launcher's declared global-memory bytes (``*_bytes``) and the GPU tiles they use,
without triton: their one place (callers import them from ``declared``, not from the families).
aot: ahead-of-time compilation of a ``CompileCase`` (no GPU), its SASS and registers/shared memory.
gradcomp.methods dispatches CUDA tensors here (GRADCOMP_BACKEND=triton|torch forces a path); where
triton is not installed it imports only ``declared`` and runs the torch path.
See docs/kernels.md.
"""
from __future__ import annotations

import importlib

FAMILIES = ("cast", "quant", "sign", "topk", "powersgd")
"""The kernel families, one module each (``gradcomp.kernels.<family>``, with ``compile_cases()``):
the one list that tests and benchmarks iterate (:func:`families` imports them, and triton)."""


def families() -> list:
    """The family modules, imported, in :data:`FAMILIES` order."""
    return [importlib.import_module(f"{__name__}.{name}") for name in FAMILIES]
