"""sign: 1 bit per element, 8 per byte, with one fp32 scale per chunk (EF-signSGD).

For each chunk of ``chunk`` elements (a multiple of 8; the last chunk may be short): scale = mean
|v| over the chunk, and each element decodes to +scale or -scale by its sign bit: negative numbers
and -0.0 decode to -scale, +0.0 to +scale; a NaN's bit is its sign bit, and its chunk decodes to
NaN either way. A chunk holding NaN/inf has a non-finite scale and decodes to non-finite values.
A chunk of w elements takes g = ceil(w / 8) bytes in bit planes (:mod:`.bits`): bit i of byte j
is element i * g + j of the chunk. Scaled sign is biased; error feedback makes it converge
(Karimireddy et al., ICML 2019). Wire bytes: ceil(n / 8) + 4 ceil(n / chunk).

decode_sum adds the rows up in groups of 4 (``decode_group``, declared.SIGN_GROUP): each group's
decoded rows summed in row order, then each group's sum added in group order to the accumulator
(the scaled addend, else the first group's sum), in fp32, on both paths. Up to 4 rows without an
addend, this is the plain row-order sum.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import is_integer
from ..kernels import declared
from .base import Method, corrected_fp32, divided, kernel_family, use_triton
from .bits import pack_bit31, unpack_bits
from .fast import cpu_fast, row_pieces

kernels = kernel_family("sign")
"""The family's Triton launchers (gradcomp.kernels.sign), imported at their first use; read only
where :func:`~.base.use_triton` is True (never without triton)."""


def chunk_scales(rows: torch.Tensor) -> torch.Tensor:
    """rows fp32 [m, w] (one chunk each) -> mean |v| per row, fp32 [m]: the sum divided by w with
    one correctly rounded division on every device (:func:`~.base.divided`)."""
    return divided(rows.abs().sum(dim=1), rows.shape[1])


# Row functions: one chunk per row, rows fp32 [m, w], bits [m, ceil(w / 8)], scales fp32 [m, 1].

@cpu_fast
def _encode_rows(rows, words, bits, scales):
    """rows and their int32 view ``words`` (taken outside: a bitcast inside the compiled loop does
    not vectorize) -> bits (an int8 view, see bits.pack_bit31) and scales."""
    bits.copy_(pack_bit31(words))
    scales.copy_(chunk_scales(rows)[:, None])


@cpu_fast
def _decode_rows(bits, scales, out):
    """bits and scales -> out [m, w] = +-scale of the row."""
    out.copy_((1 - 2 * unpack_bits(bits, out.shape[1])).float() * scales)


@dataclass(frozen=True)
class Sign(Method):
    """Scaled 1-bit sign: ~1/8 + 4/chunk bytes per element."""

    name = "sign"
    chunk: int = 1024
    schemes = ("allgather", "twophase")
    prescales = True
    decode_group = declared.SIGN_GROUP

    def __post_init__(self):
        if not is_integer(self.chunk) or self.chunk < 8 or self.chunk % 8:
            raise ValueError(f"sign: chunk must be a positive multiple of 8 (each chunk's signs "
                             f"fill whole bytes), got {self.chunk!r}")

    @property
    def granule(self) -> int:
        return self.chunk

    def parts_layout(self, shape, dtype):
        n = math.prod(shape)
        return {"bits": (torch.uint8, (-(-n // 8),)), "scales": (torch.float32, (-(-n // self.chunk),))}

    def declared_bytes(self, shape, world=1, error_feedback=True):
        n = math.prod(shape)
        return (declared.ef_sign_bytes(n, self.chunk, 4, error_feedback),
                declared.sign_decode_sum_bytes(n, self.chunk, world, 4))

    def _compress(self, x, residual, state, scale=1.0):
        if use_triton(x) and kernels.supports(self.chunk):
            bits, scales = kernels.ef_sign(x.reshape(-1), residual, self.chunk, scale)
            return self._payload(x, {"bits": bits, "scales": scales})
        c = corrected_fp32(x, residual, scale)
        n = c.numel()
        bits = torch.empty(-(-n // 8), dtype=torch.uint8, device=c.device)
        scales = torch.empty(-(-n // self.chunk), device=c.device)
        _encode_rows.each(row_pieces(
            n // self.chunk, (c, self.chunk), (c.view(torch.int32), self.chunk),
            (bits.view(torch.int8), self.chunk // 8), (scales, 1)))
        payload = self._payload(x, {"bits": bits, "scales": scales})
        return self._feed_back(c, payload, residual)

    def _decompress_into(self, payload, out):
        bits, scales = payload.parts["bits"], payload.parts["scales"]
        _decode_rows.each(row_pieces(
            payload.numel // self.chunk, (bits, self.chunk // 8), (scales, 1), (out, self.chunk)))

    def _kernel_decode_sum(self, payloads, out, addend=None, addend_scale=1.0):
        if not kernels.supports(self.chunk):
            return False
        p, rows = payloads.parts, payloads.rows
        kernels.sign_decode_sum(p["bits"].reshape(rows, -1),
                                p["scales"].reshape(rows, -1), payloads.numel,
                                self.chunk, out.dtype, out, addend, addend_scale)
        return True
