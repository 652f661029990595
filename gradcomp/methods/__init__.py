"""The compression methods, by name. One module per family; each holds everything method-specific
(options, payload layout, wire bytes, schemes, decode-and-sum, kernels and their bytes)."""
from __future__ import annotations

from .base import Method, all_finite, check_tensor
from .cast import BF16, FP16
from .powersgd import PowerSGD
from .quant import Int4, Int8
from .registry import (METHODS, REGISTRY, SCHEME_NAMES, UNCOMPRESSED, get_method, on_rank,
                       register_method, unregister_method)
from .sign import Sign
from .topk import TopK

for _cls in (FP16, BF16, Int8, Int4, Sign, TopK, PowerSGD):
    register_method(_cls)

__all__ = ["METHODS", "REGISTRY", "SCHEME_NAMES", "UNCOMPRESSED", "Method", "get_method", "on_rank", "register_method",
           "unregister_method", "check_tensor", "all_finite", "FP16", "BF16", "Int8", "Int4", "Sign", "TopK",
           "PowerSGD"]
