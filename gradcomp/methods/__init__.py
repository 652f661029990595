"""The compression methods, by name. One module per family; each holds its math and options."""
from __future__ import annotations

from .base import Method, check_tensor
from .cast import BF16, FP16
from .powersgd import PowerSGD
from .quant import Int4, Int8
from .sign import Sign
from .topk import TopK

REGISTRY: dict[str, type[Method]] = {
    cls.name: cls for cls in (FP16, BF16, Int8, Int4, Sign, TopK, PowerSGD)
}
METHODS: tuple[str, ...] = tuple(REGISTRY)


def get_method(method: str | Method, **options) -> Method:
    """The Method for a name and options (validated), or ``method`` itself if already one."""
    if isinstance(method, Method):
        if options:
            raise ValueError(f"options {sorted(options)} given with a {method.name} Method instance; "
                             "pass them when creating it")
        return method
    if not isinstance(method, str) or method not in REGISTRY:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    cls = REGISTRY[method]
    try:
        return cls(**options)
    except TypeError:
        allowed = sorted(cls().options())
        unknown = sorted(set(options) - set(allowed))
        raise ValueError(f"{method}: unknown option(s) {unknown}; it takes {allowed}") from None


__all__ = ["METHODS", "REGISTRY", "Method", "get_method", "check_tensor",
           "FP16", "BF16", "Int8", "Int4", "Sign", "TopK", "PowerSGD"]
