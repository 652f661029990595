"""sign: 1 bit per element, 8 per byte, with one fp32 scale per chunk (EF-signSGD).

For each chunk of ``chunk`` elements (the last may be short): scale = mean |v| over the chunk, and
each element decodes to +scale or -scale by its sign (zero decodes to +scale). Bit i of byte j is
element 8j + i, set when the element is negative (a NaN's sign bit is ignored: it decodes to
+scale, which is NaN anyway). A chunk holding NaN/inf has a non-finite scale and decodes to
non-finite values. Scaled sign is biased; error feedback makes it converge (Karimireddy et al.,
ICML 2019). Wire bytes: ceil(n / 8) + 4 ceil(n / chunk).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .base import Method, corrected_fp32, use_triton
from .fast import cpu_fast, row_pieces

SIGN_TABLE = 1.0 - 2.0 * ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).float()
"""fp32 [256, 8]: the signs (+1 / -1) of the 8 elements a byte stands for, bit i -> column i."""


def chunk_scales(rows: torch.Tensor) -> torch.Tensor:
    """rows fp32 [m, w] (one chunk each) -> mean |v| per row, fp32 [m]."""
    return rows.abs().sum(dim=1) / rows.shape[1]


def pack_signs(negative: torch.Tensor) -> torch.Tensor:
    """bool or 0/1 uint8 [n] -> uint8 [ceil(n / 8)]: bit i of byte j = negative[8j + i] (last
    byte 0-padded)."""
    if negative.device.type == "cpu":  # numpy's packbits is a vectorized loop; same layout
        return torch.from_numpy(np.packbits(negative.numpy().view(np.bool_), bitorder="little"))
    return pack_signs_torch(negative)


def pack_signs_torch(negative: torch.Tensor) -> torch.Tensor:
    """:func:`pack_signs` in torch ops, for any device."""
    pad = -negative.numel() % 8
    bytes_ = torch.nn.functional.pad(negative.to(torch.uint8), (0, pad)).view(-1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bytes_.device)
    return (bytes_ * weights).sum(dim=1, dtype=torch.uint8)


def unpack_signs(bits: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [ceil(n / 8)] -> fp32 [n] of +1 / -1, the inverse of :func:`pack_signs`."""
    return SIGN_TABLE.to(bits.device)[bits.long()].view(-1)[:n]


def sign_encode(c: torch.Tensor, chunk: int):
    """c fp32 [n] -> (bits uint8 [ceil(n / 8)], scales fp32 [ceil(n / chunk)])."""
    scales = [chunk_scales(rows) for (rows,) in row_pieces(c.numel() // chunk, (c, chunk))]
    return pack_signs(c < 0), torch.cat(scales + [c.new_empty(0)])


def sign_decode(bits: torch.Tensor, scales: torch.Tensor, chunk: int, n: int) -> torch.Tensor:
    """(bits, scales) -> fp32 [n] of +-scale of each element's chunk."""
    signs = unpack_signs(bits, n)
    pieces = [(rows * s) for rows, s in row_pieces(n // chunk, (signs, chunk), (scales, 1))]
    return torch.cat([p.reshape(-1) for p in pieces] + [signs.new_empty(0)])


@cpu_fast
def _encode_rows(rows, negative, scales):
    # 0/1 bytes through where(): a bool store does not vectorize in inductor's CPU code
    negative.copy_(torch.where(rows < 0, 1, 0))
    scales.copy_(chunk_scales(rows))


@cpu_fast
def _decode_rows(bits, scales, out):
    """bits uint8 [m, ceil(w / 8)] (rows start on a byte), scales [m] -> out [m, w]."""
    signs = SIGN_TABLE.to(bits.device)[bits.long()].view(bits.shape[0], -1)[:, :out.shape[1]]
    out.copy_(signs * scales[:, None])


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
        negative = torch.empty(n, dtype=torch.uint8, device=c.device)
        scales = torch.empty(-(-n // self.chunk), device=c.device)
        for rows, negative_rows, scale_rows in row_pieces(
                n // self.chunk, (c, self.chunk), (negative, self.chunk), (scales, 1)):
            _encode_rows(rows, negative_rows, scale_rows.view(-1))
        payload = self._payload(x, {"bits": pack_signs(negative), "scales": scales})
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
        for bit_rows, scale_rows, out_rows in row_pieces(
                payload.numel // self.chunk, (bits, self.chunk // 8), (scales, 1), (out, self.chunk)):
            _decode_rows(bit_rows, scale_rows.view(-1), out_rows)
