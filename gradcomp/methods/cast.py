"""fp16 / bf16: cast each element to a 16-bit float (2 bytes per element on the wire).

Finite values beyond the format's range saturate to its largest finite value (+-65504 for fp16)
instead of becoming inf; with error feedback the clipped excess is kept in the residual and sent
later. NaN and inf stay NaN and inf. The ``scale`` option multiplies before the cast and decompress
divides it back out (a wire scale: not ``compress``'s ``scale`` argument, which the DDP hooks pass
as 1/world_size so that the payloads' sum is the mean and cannot overflow, and which is not undone).
Rounding is round-to-nearest-even, as torch's ``.to(float16/bfloat16)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import check_number
from ..kernels import declared
from .base import Method, corrected_fp32, divided, kernel_family, use_triton
from .fast import cpu_fast

kernels = kernel_family("cast")
"""The family's Triton launchers (gradcomp.kernels.cast), imported at their first use; read only
where :func:`~.base.use_triton` is True (never without triton)."""


def saturating_cast(c: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """(c * scale) cast to ``dtype``, finite values clamped to its range; NaN/inf kept."""
    limit = torch.finfo(dtype).max
    v = c * scale
    # |v| == inf rather than isinf: the same test, and one inductor vectorizes on the CPU
    return torch.where(v.abs() == math.inf, v, v.clamp(-limit, limit)).to(dtype)


def widen(values: torch.Tensor, scale: float) -> torch.Tensor:
    """The inverse of :func:`saturating_cast`: values in fp32, divided by ``scale`` (rounded to
    fp32) with one correctly rounded division (:func:`~.base.divided`), on every device."""
    return divided(values.float(), scale)


@cpu_fast
def _cast_into(c: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    out.copy_(saturating_cast(c, scale, out.dtype))


@cpu_fast
def _widen_into(values: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    out.copy_(widen(values, scale))


@dataclass(frozen=True)
class _Cast(Method):
    scale: float = 1.0
    schemes = ("allreduce",)
    error_feedback_default = False  # as torch's fp16_compress_hook
    prescales = True
    wire_dtype = torch.float16

    def __post_init__(self):
        check_number(self.name, "scale", self.scale, 0, low_open=True, finite=True)

    def parts_layout(self, shape, dtype):
        return {"values": (self.wire_dtype, (math.prod(shape),))}

    def declared_bytes(self, shape, world=1, error_feedback=True):
        n = math.prod(shape)
        return declared.ef_cast_bytes(n, 4, error_feedback), declared.cast_decode_sum_bytes(n, world, 4)

    def _compress(self, x, residual, state, scale=1.0):
        if use_triton(x):
            values = kernels.ef_cast(x.reshape(-1), residual, float(self.scale), self.wire_dtype,
                                     scale)
            return self._payload(x, {"values": values})
        c = corrected_fp32(x, residual, scale)
        values = torch.empty(c.numel(), dtype=self.wire_dtype, device=c.device)
        _cast_into(c, float(self.scale), values)
        return self._feed_back(c, self._payload(x, {"values": values}), residual)

    def _decompress_into(self, payload, out):
        _widen_into(payload.parts["values"].view(-1), float(self.scale), out)

    def _kernel_decode_sum(self, payloads, out, addend=None, addend_scale=1.0):
        values = payloads.parts["values"].reshape(payloads.rows, -1).contiguous()
        kernels.cast_decode_sum(values, float(self.scale), out.dtype, out, addend, addend_scale)
        return True


@dataclass(frozen=True)
class FP16(_Cast):
    """IEEE half: 10-bit mantissa, range +-65504 (saturated), 2 bytes per element."""

    name = "fp16"
    wire_dtype = torch.float16


@dataclass(frozen=True)
class BF16(_Cast):
    """bfloat16: 7-bit mantissa, fp32's range, 2 bytes per element."""

    name = "bf16"
    wire_dtype = torch.bfloat16
