"""sign: 1 bit per element, 8 per byte, with one fp32 scale per chunk (EF-signSGD).

For each chunk of ``chunk`` elements (the last may be short): scale = mean |v| over the chunk, and
each element decodes to +scale or -scale by its sign (zero decodes to +scale). Bit i of byte j is
element 8j + i, set when the element's sign bit is set: negative numbers and -0.0 (which decodes
to -scale); a NaN's bit is its sign bit, and its chunk decodes to NaN either way. A chunk holding NaN/inf has a non-finite scale and decodes to
non-finite values. Scaled sign is biased; error feedback makes it converge (Karimireddy et al.,
ICML 2019). Wire bytes: ceil(n / 8) + 4 ceil(n / chunk).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Method, corrected_fp32, use_triton
from .bits import BIT_TABLE, pack_bit31
from .fast import cpu_fast, row_pieces

SIGN_TABLE = 1.0 - 2.0 * BIT_TABLE.float()
"""fp32 [256, 8]: the signs (+1 / -1) of the 8 elements a byte stands for, bit i -> column i."""


def chunk_scales(rows: torch.Tensor) -> torch.Tensor:
    """rows fp32 [m, w] (one chunk each) -> mean |v| per row, fp32 [m]."""
    return rows.abs().sum(dim=1) / rows.shape[1]


def sign_bits(v: torch.Tensor) -> torch.Tensor:
    """v fp32 [..., w] -> uint8 [..., ceil(w / 8)]: bit i of byte j is the sign bit of
    v[..., 8j + i] (the last byte's missing elements count as +0), read through an int32 view.
    """
    return pack_bit31(v.contiguous().view(torch.int32))


def unpack_signs(bits: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [ceil(n / 8)] -> fp32 [n] of +1 / -1, the inverse of :func:`sign_bits`."""
    return SIGN_TABLE.to(bits.device)[bits.long()].view(-1)[:n]


def sign_encode(c: torch.Tensor, chunk: int):
    """c fp32 [n] -> (bits uint8 [ceil(n / 8)], scales fp32 [ceil(n / chunk)])."""
    scales = [chunk_scales(rows) for (rows,) in row_pieces(c.numel() // chunk, (c, chunk))]
    return sign_bits(c), torch.cat(scales + [c.new_empty(0)])


def sign_decode(bits: torch.Tensor, scales: torch.Tensor, chunk: int, n: int) -> torch.Tensor:
    """(bits, scales) -> fp32 [n] of +-scale of each element's chunk."""
    signs = unpack_signs(bits, n)
    pieces = [(rows * s) for rows, s in row_pieces(n // chunk, (signs, chunk), (scales, 1))]
    return torch.cat([p.reshape(-1) for p in pieces] + [signs.new_empty(0)])


@cpu_fast
def _encode_rows(rows, words, bits, scales):
    """rows fp32 [m, w] (rows start on a byte) and their int32 view ``words`` (taken outside: a
    bitcast inside the compiled loop does not vectorize) -> bits [m, ceil(w / 8)], scales [m, 1]."""
    bits.copy_(pack_bit31(words))
    scales.copy_(chunk_scales(rows)[:, None])


@cpu_fast
def _decode_rows(bits, scales, out):
    """bits uint8 [m, ceil(w / 8)] (rows start on a byte), scales [m, 1] -> out [m, w]."""
    signs = SIGN_TABLE.to(bits.device)[bits.long()].view(bits.shape[0], -1)[:, :out.shape[1]]
    out.copy_(signs * scales)


@dataclass(frozen=True)
class Sign(Method):
    """Scaled 1-bit sign: ~1/8 + 4/chunk bytes per element."""

    name = "sign"
    chunk: int = 1024

    def __post_init__(self):
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"sign: chunk must be an integer >= 1, got {self.chunk!r}")

    def wire_bytes(self, numel, shape=None, dtype=torch.float32):
        return -(-numel // 8) + 4 * -(-numel // self.chunk)

    def _compress(self, x, residual, state):
        if use_triton(x):
            from ..kernels.sign import ef_sign, supports
            if supports(self.chunk):
                bits, scales = ef_sign(x.reshape(-1), residual, self.chunk)
                return self._payload(x, {"bits": bits, "scales": scales})
        c = corrected_fp32(x, residual)
        n = c.numel()
        if self.chunk % 8:  # chunks do not start on a byte: the reference encode
            bits, scales = sign_encode(c, self.chunk)
        else:
            bits = torch.empty(-(-n // 8), dtype=torch.uint8, device=c.device)
            scales = torch.empty(-(-n // self.chunk), device=c.device)
            _encode_rows.each(row_pieces(
                n // self.chunk, (c, self.chunk), (c.view(torch.int32), self.chunk),
                (bits, self.chunk // 8), (scales, 1)))
        payload = self._payload(x, {"bits": bits, "scales": scales})
        return self._feed_back(c, payload, residual)

    def _decompress_into(self, payload, out):
        bits, scales = payload.parts["bits"], payload.parts["scales"]
        if use_triton(out):
            from ..kernels.sign import sign_decode_sum, supports
            if supports(self.chunk):
                sign_decode_sum(bits.view(1, -1), scales.view(1, -1), payload.numel, self.chunk,
                                out.dtype, out)
                return
        if self.chunk % 8:  # chunks do not start on a byte: the reference decode
            out.copy_(sign_decode(bits, scales, self.chunk, payload.numel))
            return
        _decode_rows.each(row_pieces(
            payload.numel // self.chunk, (bits, self.chunk // 8), (scales, 1), (out, self.chunk)))
