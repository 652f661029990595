"""Bit packing shared by sign (the sign bits) and top-k (the candidate mask): 8 flags per byte,
bit i of byte j standing for element 8j + i."""
from __future__ import annotations

import torch
import torch.nn.functional as F

BIT_TABLE = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).to(torch.uint8)
"""uint8 [256, 8]: the bits of each byte value, bit i -> column i."""
LOWEST_SET_BIT = BIT_TABLE.argmax(dim=1)
"""int64 [256]: the index of each byte value's lowest set bit (0 for the value 0)."""


def pack_bit31(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., w] -> uint8 [..., ceil(w / 8)]: bit i of byte j is bit 31 of words[..., 8j + i]
    (missing words of the last byte count as 0).

    Shifts and ors only: inductor compiles them to vector code, where a compare does not vectorize.
    """
    if words.shape[-1] % 8:
        words = F.pad(words, (0, -words.shape[-1] % 8))
    words = words.contiguous().view(*words.shape[:-1], -1, 8)
    packed = (words[..., 0] >> 31) & 1
    for i in range(1, 8):
        packed = packed | (((words[..., i] >> 31) & 1) << i)
    return packed.to(torch.uint8)


def set_bit_positions(bits: torch.Tensor) -> torch.Tensor:
    """uint8 [m] -> int64 positions 8j + i of the set bits (bit i of byte j), grouped by rank:
    the lowest set bit of every non-zero byte first (increasing), then the second lowest, ...

    One scan of the packed bytes (8x fewer than a byte-per-element mask), then work on the
    non-zero bytes only: sparse masks have few bytes with more than one bit set.
    """
    byte_index = bits.nonzero().squeeze(1)
    values = bits[byte_index].long()
    lowest = LOWEST_SET_BIT.to(bits.device)
    positions = []
    while byte_index.numel():
        positions.append(byte_index * 8 + lowest[values])
        values = values & (values - 1)  # clear the lowest set bit
        more = values.nonzero().squeeze(1)
        byte_index, values = byte_index[more], values[more]
    return torch.cat(positions) if positions else byte_index
