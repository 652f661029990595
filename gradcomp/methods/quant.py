"""int8 / int4: block quantization with one fp32 absmax scale per block.

For each block of ``block`` elements (the last may be short) with absmax a and L = 127 (int8)
or 7 (int4):  scale = a / L,  q = clamp(round(v * (L / a)), -L, L)  (q = 0 where a = 0),
decoded as q * scale. On every device and in the kernels, a / L is one correctly rounded
division and L / a is fl(fl(1 / a) * L) (two roundings), so the paths agree bit for bit.
Round-to-nearest is half-to-even (|error| <= scale / 2); stochastic rounding
is q = floor(v * L / a + u), u ~ U[0, 1) drawn from a generator seeded by (seed, step), so it is
unbiased and reproducible (|error| < scale). A block holding NaN/inf gets scale NaN and codes 0:
it decodes to NaN. A block whose absmax is below L / 3.4e38 (L / a would overflow fp32) is sent as
zeros with scale 0, like an all-zero block (with error feedback its values stay in the residual).

Wire bytes: int8 n + 4 ceil(n / block); int4 ceil(n / 2) + 4 ceil(n / block) (block is even),
two values per byte, each stored as q + 8: a block of w elements (the last may be short) takes
h = ceil(w / 2) bytes, byte j holding element j in its low nibble and element j + h in its high
nibble (an odd block's missing element is stored as 8, i.e. 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..checks import check_number
from ..kernels import declared
from .base import SEED_STEP_STRIDE, Method, corrected_fp32, divided, kernel_family, use_triton
from .fast import cpu_fast, row_pieces

kernels = kernel_family("quant")
"""The family's Triton launchers (gradcomp.kernels.quant), imported at their first use; read only
where :func:`~.base.use_triton` is True (never without triton)."""

INT8_LEVELS = 127
INT4_LEVELS = 7


def quantize_rows(rows: torch.Tensor, levels: int, noise: torch.Tensor | None = None):
    """rows fp32 [m, w] (one block each) -> (q fp32 [m, w] integers in [-levels, levels],
    scales fp32 [m]). ``noise`` (U[0, 1), rows' shape) selects stochastic rounding."""
    amax = rows.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    inv = amax.reciprocal() * levels  # two roundings, as the kernel: 1 / amax, then * levels
    # a zero block, or one so small that levels / amax overflows, is sent as zeros with scale 0
    sent = (amax > 0) & (inv < math.inf)
    t = rows * torch.where(sent, inv, 0.0)[:, None]
    # |t| <= levels (1 + 2^-24)^3 < levels + 1/2 (inv is finite, |v| <= amax): round() stays in
    # [-levels, levels] without a clamp; floor(t + u) can step one below -levels
    q = torch.round(t) if noise is None else torch.floor(t + noise).clamp(-levels, levels)
    q = torch.where(finite[:, None], q, 0.0)
    scales = torch.where(finite, torch.where(sent, divided(amax, levels), 0.0), float("nan"))
    return q, scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q [m, w] (any integer or float dtype), scales [m] -> fp32 [m, w] = q * scale of its row."""
    return q.float() * scales[:, None]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [..., w] integers in [-7, 7] (any dtype) -> uint8 [..., h], h = ceil(w / 2): byte j holds
    q[j] + 8 in its low nibble and q[j + h] + 8 in its high nibble.

    Both halves are contiguous (pairing neighbours reads with stride 2, which inductor's CPU code
    does one element at a time); computed in fp32, which converts to uint8 with vector code.
    """
    w = q.shape[-1]
    h = -(-w // 2)
    codes = q.float() + 8
    if w != 2 * h:
        codes = F.pad(codes, (0, 1), value=8.0)
    return (codes[..., :h] + 16 * codes[..., h:]).to(torch.uint8)


NIBBLE_SHIFTS = torch.tensor([[0], [4]], dtype=torch.int32)
"""int32 [2, 1]: the shifts of the low and the high nibble."""


def unpack_int4(packed: torch.Tensor, w: int) -> torch.Tensor:
    """uint8 [..., ceil(w / 2)] -> int32 [..., w] in [-8, 7]: the inverse of :func:`pack_int4`."""
    nibbles = (packed.to(torch.int32)[..., None, :] >> NIBBLE_SHIFTS.to(packed.device)) & 15
    return (nibbles - 8).reshape(*packed.shape[:-1], -1)[..., :w]


def quantize_blocks(c: torch.Tensor, block: int, levels: int, noise: torch.Tensor | None = None):
    """c fp32 [n] -> (q fp32 [n] holding integers in [-levels, levels], scales fp32 [nblocks])."""
    pieces = [quantize_rows(rows, levels, noise_rows)
              for rows, noise_rows in row_pieces(c.numel() // block, (c, block), (noise, block))]
    return (torch.cat([q.reshape(-1) for q, _ in pieces] + [c.new_empty(0)]),
            torch.cat([s for _, s in pieces] + [c.new_empty(0)]))


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """q [n] (any integer or float dtype), scales [nblocks] -> fp32 [n] = q * scale of its block."""
    pieces = [dequantize_rows(rows, s.view(-1)).reshape(-1)
              for rows, s in row_pieces(q.numel() // block, (q, block), (scales, 1))]
    return torch.cat(pieces + [scales.new_empty(0)])


PER_BLOCK_ONCE = {"realize_opcount_threshold": 1}
"""Inductor setting of the int8 encode: a block's 1 / amax, finite flag and scale are computed
once per block, in their own vector loop, instead of again (a scalar division) for every 16
elements of the block: ~7% faster at 1M elements. (The int4 encode slows down with it: its
packed halves get materialized too.)"""

# Row functions: rows / out fp32 [m, w], codes [m, code bytes of w], scales fp32 [m, 1].


@cpu_fast(options=PER_BLOCK_ONCE)
def _encode_int8(rows, noise, codes, scales):
    q, s = quantize_rows(rows, INT8_LEVELS, noise)
    codes.copy_(q.to(torch.int32))  # through int32: faster in inductor's CPU code than fp32 -> int8
    scales.copy_(s[:, None])


@cpu_fast
def _encode_int4(rows, noise, codes, scales):
    q, s = quantize_rows(rows, INT4_LEVELS, noise)
    codes.copy_(pack_int4(q))
    scales.copy_(s[:, None])


@cpu_fast
def _decode_int8(codes, scales, out):
    out.copy_(dequantize_rows(codes, scales.view(-1)))


@cpu_fast
def _decode_int4(codes, scales, out):
    out.copy_(dequantize_rows(unpack_int4(codes, out.shape[1]), scales.view(-1)))


@dataclass(frozen=True)
class _BlockQuant(Method):
    block: int = 256
    stochastic: bool = False
    seed: int = 0

    def __post_init__(self):
        check_number(self.name, "block", self.block, 2, integer=True)
        if self.name == "int4" and self.block % 2:
            raise ValueError(f"int4: block must be even (two values per byte), got {self.block}")
        if not isinstance(self.stochastic, bool):
            raise ValueError(f"{self.name}: stochastic must be True or False, got {self.stochastic!r}")
        check_number(self.name, "seed", self.seed, 0, integer=True)

    schemes = ("allgather", "twophase")
    prescales = True

    @property
    def granule(self) -> int:
        return self.block

    def parts_layout(self, shape, dtype):
        n = math.prod(shape)
        return {"q": (self.code_dtype, (self._code_bytes(n),)), "scales": (torch.float32, (-(-n // self.block),))}

    def declared_bytes(self, shape, world=1, error_feedback=True):
        n = math.prod(shape)
        return (declared.ef_quantize_bytes(n, self.block, self.levels, 4, error_feedback),
                declared.dequantize_sum_bytes(n, self.block, self.levels, world, 4))

    def _noise(self, c: torch.Tensor, state: dict) -> torch.Tensor | None:
        """U[0, 1) per element for stochastic rounding, from (seed, step); None otherwise."""
        if not self.stochastic:
            return None
        gen = torch.Generator(device=c.device)
        gen.manual_seed(self.seed + SEED_STEP_STRIDE * self._next_step(state))
        return torch.rand(c.numel(), generator=gen, device=c.device)

    def _next_step(self, state: dict) -> int:
        """The stochastic-rounding step counter kept in ``state``; returns it, then counts up."""
        step = state.get("step", 0)
        state["step"] = step + 1
        return step

    def _compress(self, x, residual, state, scale=1.0):
        if use_triton(x) and kernels.supports(self.block):
            seed = self.seed + SEED_STEP_STRIDE * self._next_step(state) if self.stochastic else None
            codes, scales = kernels.ef_quantize(x.reshape(-1), residual, self.block, self.levels,
                                                seed, scale)
            return self._payload(x, {"q": codes, "scales": scales})
        c = corrected_fp32(x, residual, scale)
        n = c.numel()
        codes = torch.empty(self._code_bytes(n), dtype=self.code_dtype, device=c.device)
        scales = torch.empty(-(-n // self.block), device=c.device)
        self.encode_rows.each(row_pieces(
            n // self.block, (c, self.block), (self._noise(c, state), self.block),
            (codes, self._code_bytes(self.block)), (scales, 1)))
        return self._feed_back(c, self._payload(x, {"q": codes, "scales": scales}), residual)

    def _decompress_into(self, payload, out):
        p = payload.parts
        self.decode_rows.each(row_pieces(
            payload.numel // self.block, (p["q"], self._code_bytes(self.block)),
            (p["scales"], 1), (out, self.block)))

    def _kernel_decode_sum(self, payloads, out, addend=None, addend_scale=1.0):
        if not kernels.supports(self.block):
            return False
        p, rows = payloads.parts, payloads.rows
        kernels.dequantize_sum(p["q"].reshape(rows, -1),
                               p["scales"].reshape(rows, -1), payloads.numel,
                               self.block, out.dtype, out, addend, addend_scale)
        return True


@dataclass(frozen=True)
class Int8(_BlockQuant):
    """int8 in [-127, 127] with an fp32 absmax scale per block: ~1 + 4/block bytes per element."""

    name = "int8"
    levels = INT8_LEVELS
    code_dtype = torch.int8
    encode_rows = staticmethod(_encode_int8)
    decode_rows = staticmethod(_decode_int8)

    @staticmethod
    def _code_bytes(numel: int) -> int:
        return numel


@dataclass(frozen=True)
class Int4(_BlockQuant):
    """int4 in [-7, 7], two per byte, with an fp32 absmax scale per block."""

    name = "int4"
    levels = INT4_LEVELS
    code_dtype = torch.uint8
    encode_rows = staticmethod(_encode_int4)
    decode_rows = staticmethod(_decode_int4)

    @staticmethod
    def _code_bytes(numel: int) -> int:
        return -(-numel // 2)
