"""The contract every compression method fulfils, and the checks all of them share."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from ..payload import Payload

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
BACKENDS = ("auto", "torch", "triton")


def check_tensor(x) -> None:
    """Raise a TypeError naming the problem unless ``x`` is a floating-point torch.Tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"gradcomp compresses floating-point tensors (float32, float16, bfloat16, float64); "
            f"got dtype {x.dtype}"
        )


def backend() -> str:
    """The backend forced by ``GRADCOMP_BACKEND`` (``torch`` or ``triton``), else ``auto``."""
    value = os.environ.get("GRADCOMP_BACKEND", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"GRADCOMP_BACKEND must be one of {BACKENDS}, got {value!r}")
    return value


def use_triton(x: torch.Tensor) -> bool:
    """True when ``x`` goes to the Triton kernels: CUDA tensors, or GRADCOMP_BACKEND=triton."""
    chosen = backend()
    if chosen == "auto":
        return x.is_cuda
    return chosen == "triton"


def finite_residual(corrected: torch.Tensor, decoded: torch.Tensor, residual: torch.Tensor) -> None:
    """residual <- corrected - decoded where that is finite, else 0 (in place, fp32).

    A non-finite gradient must reach the optimizer (the payload carries it) but must never be
    carried into the next step by the error-feedback memory.
    """
    diff = corrected.reshape(residual.shape) - decoded.reshape(residual.shape).float()
    torch.where(torch.isfinite(diff), diff, torch.zeros((), device=diff.device), out=residual)


@dataclass(frozen=True)
class Method:
    """A compressor: ``compress`` a tensor into a :class:`Payload` and ``decompress`` it back.

    Subclasses are frozen dataclasses whose fields are the method's options; ``__post_init__``
    validates them. ``summable`` says whether the payloads of several ranks may be summed part by
    part on the wire (an all-reduce) instead of being gathered and decoded one by one.
    """

    name: ClassVar[str]
    summable: ClassVar[bool] = False

    def compress(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 state: dict | None = None) -> Payload:
        """Compress ``x`` (+ ``residual`` if given: error feedback).

        residual: fp32 tensor with x's number of elements, updated in place to what was owed but
            not sent: (x + residual) - decompress(payload), zero where that is not finite.
        state: the method's per-tensor memory kept by ErrorFeedback (PowerSGD's warm-start Q,
            a step counter for stochastic rounding); None for a stateless call.
        """
        check_tensor(x)
        if residual is not None and (residual.dtype != torch.float32 or residual.numel() != x.numel()
                                     or residual.device != x.device):
            raise ValueError(
                f"residual must be float32 with {x.numel()} elements on {x.device}, got "
                f"{residual.dtype}[{residual.numel()}] on {residual.device}"
            )
        return self._compress(x, residual, state if state is not None else {})

    def decompress(self, payload: Payload) -> torch.Tensor:
        """The dense tensor of ``payload.shape`` and ``payload.dtype``."""
        if payload.method != self.name:
            raise ValueError(f"a {payload.method!r} payload cannot be decoded by method {self.name!r}")
        return self._decompress(payload)

    def wire_bytes(self, numel: int, shape: tuple | None = None, dtype=torch.float32) -> int:
        """Bytes a payload of a tensor with ``numel`` elements (and ``shape``) puts on the wire."""
        raise NotImplementedError

    def options(self) -> dict:
        """The method's options as a dict (what ``gradcomp.compress(x, name, **options)`` takes)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _payload(self, x: torch.Tensor, parts: dict) -> Payload:
        return Payload(self.name, x.shape, x.dtype, parts, self.options())

    def _compress(self, x, residual, state) -> Payload:
        raise NotImplementedError

    def _decompress(self, payload: Payload) -> torch.Tensor:
        raise NotImplementedError


def corrected_fp32(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """x flattened to fp32, plus the residual when error feedback is on (a new tensor)."""
    flat = x.reshape(-1).float()
    return flat if residual is None else flat + residual.reshape(-1)
