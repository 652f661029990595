"""sign: 1 bit per element, 8 per byte, with one fp32 scale per chunk (EF-signSGD).

For each chunk of ``chunk`` elements (the last may be short): scale = mean |v| over the chunk, and
each element decodes to +scale or -scale by its sign (zero decodes to +scale). Bit i of byte j is
element 8j + i, set when the element is negative. A chunk holding NaN/inf has a non-finite scale and
decodes to non-finite values. Scaled sign is biased; error feedback makes it converge (Karimireddy
et al., ICML 2019). Wire bytes: ceil(n / 8) + 4 ceil(n / chunk).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Method, corrected_fp32, finite_residual
from .fast import cpu_fast


def _chunked(flat: torch.Tensor, size: int, value: float = 0.0) -> torch.Tensor:
    pad = -flat.numel() % size
    return (F.pad(flat, (0, pad), value=value) if pad else flat).view(-1, size)


@cpu_fast
def sign_encode(c: torch.Tensor, chunk: int):
    """c fp32 [n] -> (bits uint8 [ceil(n / 8)], scales fp32 [ceil(n / chunk)])."""
    n = c.numel()
    starts = torch.arange(-(-n // chunk), device=c.device) * chunk
    counts = (n - starts).clamp(max=chunk).float()
    scales = _chunked(c, chunk).abs().sum(dim=1) / counts
    negative = _chunked((c < 0).to(torch.uint8), 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=c.device)
    return (negative * weights).sum(dim=1, dtype=torch.uint8), scales


@cpu_fast
def sign_decode(bits: torch.Tensor, scales: torch.Tensor, chunk: int, n: int) -> torch.Tensor:
    """(bits, scales) -> fp32 [n] of +-scale of each element's chunk."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    negative = ((bits[:, None] >> shifts) & 1).reshape(-1)[:n]
    signs = 1.0 - 2.0 * negative.float()
    return (_chunked(signs, chunk) * scales[:, None]).reshape(-1)[:n]


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
        c = corrected_fp32(x, residual)
        bits, scales = sign_encode(c, self.chunk)
        if residual is not None:
            finite_residual(c, sign_decode(bits, scales, self.chunk, c.numel()), residual)
        return self._payload(x, {"bits": bits, "scales": scales})

    def _decompress(self, payload):
        p = payload.parts
        flat = sign_decode(p["bits"], p["scales"], payload.options["chunk"], payload.numel)
        return flat.to(payload.dtype).view(payload.shape)
