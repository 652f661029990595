"""int8 / int4: block quantization with one fp32 absmax scale per block.

For each block of ``block`` elements (the last may be short) with absmax a and L = 127 (int8)
or 7 (int4):  scale = a / L,  q = clamp(round(v * (L / a)), -L, L)  (q = 0 where a = 0),
decoded as q * scale. Round-to-nearest is half-to-even (|error| <= scale / 2); stochastic rounding
is q = floor(v * L / a + u), u ~ U[0, 1) drawn from a generator seeded by (seed, step), so it is
unbiased and reproducible. A block holding NaN/inf gets scale NaN and decodes to NaN.

Wire bytes: int8 n + 4 ceil(n / block); int4 ceil(n / 2) + 4 ceil(n / block), two values per
byte: element 2i in the low nibble, 2i + 1 in the high nibble, each stored as q + 8.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Method, corrected_fp32, finite_residual
from .fast import cpu_fast


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """flat [n] zero-padded to a multiple of block, viewed [ceil(n / block), block]."""
    pad = -flat.numel() % block
    return (F.pad(flat, (0, pad)) if pad else flat).view(-1, block)


@cpu_fast
def quantize_blocks(c: torch.Tensor, block: int, levels: int, noise: torch.Tensor | None):
    """c fp32 [n] -> (q fp32 [n] holding integers in [-levels, levels], scales fp32 [nblocks])."""
    n = c.numel()
    b = _blocks(c, block)
    amax = b.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    t = b * inv[:, None]
    if noise is None:
        q = torch.round(t)
    else:
        q = torch.floor(t + _blocks(noise, block))
    q = torch.where(finite[:, None], q.clamp(-levels, levels), torch.zeros_like(q))
    scales = torch.where(finite, amax / levels, torch.full_like(amax, float("nan")))
    return q.reshape(-1)[:n], scales


@cpu_fast
def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """q [n] (any integer or float dtype), scales [nblocks] -> fp32 [n] = q * scale of its block."""
    n = q.numel()
    return (_blocks(q.float(), block) * scales[:, None]).reshape(-1)[:n]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [n] integers in [-7, 7] (any dtype) -> uint8 [ceil(n / 2)], low nibble first."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = F.pad(u, (0, 1), value=8)
    pairs = u.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [ceil(n / 2)] -> int8 [n] in [-8, 7], the inverse of :func:`pack_int4`."""
    lo = (packed & 0xF).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=1).reshape(-1)[:n]


@dataclass(frozen=True)
class _BlockQuant(Method):
    block: int = 256
    stochastic: bool = False
    seed: int = 0
    levels = 127

    def __post_init__(self):
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 2:
            raise ValueError(f"{self.name}: block must be an integer >= 2, got {self.block!r}")
        if self.name == "int4" and self.block % 2:
            raise ValueError(f"int4: block must be even (two values per byte), got {self.block}")
        if not isinstance(self.stochastic, bool):
            raise ValueError(f"{self.name}: stochastic must be True or False, got {self.stochastic!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"{self.name}: seed must be an integer >= 0, got {self.seed!r}")

    def _noise(self, c: torch.Tensor, state: dict) -> torch.Tensor | None:
        if not self.stochastic:
            return None
        step = state.get("step", 0)
        state["step"] = step + 1
        gen = torch.Generator(device=c.device).manual_seed(self.seed + 1_000_003 * step)
        return torch.rand(c.numel(), generator=gen, device=c.device)

    def _compress(self, x, residual, state):
        c = corrected_fp32(x, residual)
        q, scales = quantize_blocks(c, self.block, self.levels, self._noise(c, state))
        if residual is not None:
            finite_residual(c, dequantize_blocks(q, scales, self.block), residual)
        return self._payload(x, {"q": self._encode(q), "scales": scales})

    def _decompress(self, payload):
        q = self._decode(payload.parts["q"], payload.numel)
        flat = dequantize_blocks(q, payload.parts["scales"], payload.options["block"])
        return flat.to(payload.dtype).view(payload.shape)


@dataclass(frozen=True)
class Int8(_BlockQuant):
    """int8 in [-127, 127] with an fp32 absmax scale per block: ~1 + 4/block bytes per element."""

    name = "int8"
    levels = 127

    def wire_bytes(self, numel, shape=None, dtype=torch.float32):
        return numel + 4 * -(-numel // self.block)

    def _encode(self, q):
        return q.to(torch.int8)

    def _decode(self, q, n):
        return q


@dataclass(frozen=True)
class Int4(_BlockQuant):
    """int4 in [-7, 7], two per byte, with an fp32 absmax scale per block."""

    name = "int4"
    levels = 7

    def wire_bytes(self, numel, shape=None, dtype=torch.float32):
        return -(-numel // 2) + 4 * -(-numel // self.block)

    def _encode(self, q):
        return pack_int4(q)

    def _decode(self, q, n):
        return unpack_int4(q, n)
