"""Bit packing shared by sign (the sign bits) and top-k (the candidate mask), in bit planes.

A run of w flags takes g = ceil(w / 8) bytes: bit i of byte j stands for flag i * g + j (flags
past w count as 0). Each bit plane is a contiguous slice of the run, so packing reads and
unpacking writes contiguous vectors; interleaving flag 8j + i into one byte would read with
stride 8, which inductor's CPU code does one element at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PLANE_SHIFTS = torch.arange(8, dtype=torch.int32)[:, None]
"""int32 [8, 1]: the shift that brings bit plane i down to bit 0."""
LOWEST_SET_BIT = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).argmax(dim=1)
"""int64 [256]: the index of each byte value's lowest set bit (0 for the value 0)."""


def pack_bit31(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., w] -> int8 [..., ceil(w / 8)], the bytes' bit patterns: bit i of byte j is
    bit 31 of words[..., i * g + j], g = ceil(w / 8) (missing words count as 0).

    Shifts and ors only (inductor vectorizes them, not a compare); the result is int8, not uint8,
    because inductor's CPU code converts int32 to int8 with vector instructions and to uint8 one
    element at a time: store it into an int8 view of the uint8 bytes.
    """
    w = words.shape[-1]
    g = -(-w // 8)
    if w != 8 * g:
        words = F.pad(words, (0, 8 * g - w))
    planes = words.contiguous().view(*words.shape[:-1], 8, g)
    packed = (planes[..., 0, :] >> 31) & 1
    for i in range(1, 8):
        packed = packed | (((planes[..., i, :] >> 31) & 1) << i)
    return packed.to(torch.int8)


def unpack_bits(bits: torch.Tensor, w: int) -> torch.Tensor:
    """uint8 or int8 [..., ceil(w / 8)] -> int32 [..., w] of 0 / 1: the flags that
    :func:`pack_bit31` packed, in their order."""
    flags = (bits.to(torch.int32)[..., None, :] >> PLANE_SHIFTS.to(bits.device)) & 1
    return flags.reshape(*bits.shape[:-1], -1)[..., :w]


def set_bit_positions(bits: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """Flag indices of the set bits of ``bits``: n flags packed in runs of ``width`` (a multiple of
    8; the last run may be short) by :func:`pack_bit31`. int64, grouped by bit rank: the lowest
    set bit of every non-zero byte first (by byte), then the second lowest, ...

    One scan of the packed bytes (8x fewer than a byte-per-flag mask), then work on the non-zero
    bytes only: sparse masks have few bytes with more than one bit set.
    """
    plane = width // 8
    full = n // width
    last_plane = -(-(n - full * width) // 8)
    byte_index = bits.nonzero().squeeze(1)
    values = bits[byte_index].long()
    run = byte_index // plane  # the short last run's bytes follow the full runs' and give `full`
    start = run * width + (byte_index - run * plane)  # the flag of bit 0
    stride = torch.where(run < full, plane, last_plane)  # flags between two bits of a byte
    lowest = LOWEST_SET_BIT.to(bits.device)
    positions = []
    while values.numel():
        positions.append(start + stride * lowest[values])
        values = values & (values - 1)  # clear the lowest set bit
        more = values.nonzero().squeeze(1)
        values, start, stride = values[more], start[more], stride[more]
    return torch.cat(positions) if positions else byte_index
