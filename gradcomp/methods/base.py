"""The contract every compression method fulfils, and the checks all of them share."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from ..payload import Payload
from .fast import cpu_fast

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


@cpu_fast
def finite_residual(corrected: torch.Tensor, decoded: torch.Tensor, residual: torch.Tensor) -> None:
    """residual <- corrected - decoded where that is finite, else 0 (in place, fp32).

    A non-finite gradient must reach the optimizer (the payload carries it) but must never be
    carried into the next step by the error-feedback memory. ``decoded`` may be ``residual``.
    """
    diff = corrected.reshape(residual.shape) - decoded.reshape(residual.shape).float()
    residual.copy_(torch.where(torch.isfinite(diff), diff, 0.0))


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

        residual: contiguous fp32 tensor with x's number of elements, updated in place to what was
            owed but not sent: (x + residual) - decoded, zero where that is not finite, where
            decoded is the payload decoded in fp32 (before any cast to x's dtype).
        state: the method's per-tensor memory kept by ErrorFeedback (PowerSGD's warm-start Q,
            a step counter for stochastic rounding); None for a stateless call.
        """
        check_tensor(x)
        if residual is not None and (
                not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32
                or residual.numel() != x.numel() or residual.device != x.device
                or not residual.is_contiguous()):
            got = (f"{residual.dtype}[{residual.numel()}] on {residual.device}"
                   if isinstance(residual, torch.Tensor) else type(residual).__name__)
            raise ValueError(f"residual must be a contiguous float32 tensor with {x.numel()} "
                             f"elements on {x.device}, got {got}")
        return self._compress(x, residual, state if state is not None else {})

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        """The dense tensor of ``payload.shape`` and ``payload.dtype``.

        out: optional contiguous floating-point tensor with ``payload.numel`` elements to write the
            result into (e.g. a DDP bucket); it is returned. Its dtype may differ from the
            payload's (the fp32 decode is cast on store).
        """
        if not isinstance(payload, Payload):
            raise TypeError(f"decompress expects a gradcomp.Payload, got {type(payload).__name__}")
        if payload.method != self.name:
            raise ValueError(f"a {payload.method!r} payload cannot be decoded by method {self.name!r}")
        if payload.options != self.options():
            raise ValueError(f"{self.name}: payload was made with options {payload.options}, "
                             f"this method has {self.options()}")
        if out is None:
            out = torch.empty(payload.shape, dtype=payload.dtype, device=payload.device)
        else:
            check_tensor(out)
            if out.numel() != payload.numel or not out.is_contiguous() or out.device != payload.device:
                raise ValueError(f"out must be a contiguous tensor with {payload.numel} elements on "
                                 f"{payload.device}, got {list(out.shape)} on {out.device}")
        self._decompress_into(payload, out.view(-1))
        return out

    def wire_bytes(self, numel: int, shape: tuple | None = None, dtype=torch.float32) -> int:
        """Bytes a payload of a tensor with ``numel`` elements (and ``shape``) puts on the wire."""
        raise NotImplementedError

    def options(self) -> dict:
        """The method's options as a dict (what ``gradcomp.compress(x, name, **options)`` takes)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _payload(self, x: torch.Tensor, parts: dict) -> Payload:
        return Payload(self.name, x.shape, x.dtype, parts, self.options())

    def _feed_back(self, corrected: torch.Tensor, payload: Payload,
                   residual: torch.Tensor | None) -> Payload:
        """Error feedback after an encode: residual <- corrected - fp32 decode (finite only).

        The payload is decoded straight into the residual's memory, then subtracted in place:
        no dense temporary. Returns ``payload``.
        """
        if residual is not None:
            decoded = residual.view(-1)
            self._decompress_into(payload, decoded)
            finite_residual(corrected, decoded, decoded)
        return payload

    def _compress(self, x, residual, state) -> Payload:
        raise NotImplementedError

    def _decompress_into(self, payload: Payload, out: torch.Tensor) -> None:
        """Write the decoded values into ``out`` (1-D, contiguous, ``payload.numel`` elements)."""
        raise NotImplementedError


def corrected_fp32(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """x flattened to fp32, plus the residual when error feedback is on (a new tensor)."""
    flat = x.reshape(-1).float()
    return flat if residual is None else flat + residual.reshape(-1)
