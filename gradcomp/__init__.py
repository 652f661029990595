"""gradcomp: gradient compression for PyTorch data-parallel training.

    p = gradcomp.compress(x, "int8")      # -> Payload; p.nbytes is what crosses the wire
    y = gradcomp.decompress(p)            # x's shape and dtype
    ef = gradcomp.ErrorFeedback(); ef.compress("w", g, "sign")
"""
from __future__ import annotations

import torch

from . import schemes  # noqa: F401  (hands the scheme names to the method registry)
from .feedback import ErrorFeedback
from .methods import METHODS, Method, get_method, register_method, unregister_method
from .payload import Payload

__version__ = "0.1.0"


def compress(x: torch.Tensor, method: str | Method = "int8", **options) -> Payload:
    """Compress ``x`` with ``method`` (a name in METHODS, with its options) into a Payload."""
    return get_method(method, **options).compress(x)


def decompress(payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense tensor a Payload stands for (its original shape and dtype), or written into
    ``out`` (contiguous, floating point, ``payload.numel`` elements) and returned."""
    if not isinstance(payload, Payload):
        raise TypeError(f"decompress expects a gradcomp.Payload, got {type(payload).__name__}")
    return get_method(payload.method, **payload.options).decompress(payload, out)


_SUBPACKAGES = ("analysis", "fsdp", "hooks", "integrations", "optim")


def __getattr__(name: str):
    """Import a subpackage on first use (PEP 562): ``gradcomp.hooks``, ``gradcomp.optim``, ...
    work after a plain ``import gradcomp`` while the import itself stays cheap."""
    if name in _SUBPACKAGES:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'gradcomp' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SUBPACKAGES))


__all__ = ["compress", "decompress", "Payload", "ErrorFeedback", "METHODS", "Method", "get_method",
           "register_method", "unregister_method"]
