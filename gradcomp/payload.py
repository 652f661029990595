"""What a compressed tensor is: named parts, the options needed to decode them, and wire bytes.

The wire layout (:meth:`Payload.flatten`, :func:`wire_layout`): a payload is one row of uint8,
its parts in order, each starting at a multiple of :data:`WIRE_ALIGN` bytes, zero bytes between
them and at the row's end up to the next multiple. A gathered or all-to-all buffer of p payloads
is uint8[p, row bytes]: every row and every part in it starts on a 16-byte boundary, so the
decode kernels get 16-byte aligned part pointers and row strides (Triton's 16-divisible
specialisation, wide loads) and every part is a view of a received buffer, not a copy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import torch

WIRE_ALIGN = 16
"""Bytes that every part's offset in a row and every row's length are a multiple of."""


def wire_layout(sizes: Iterable[int]) -> tuple[list[int], int]:
    """(byte offset of each part in a row, the row's bytes) for parts of ``sizes`` bytes laid
    out in order, each at a multiple of :data:`WIRE_ALIGN`, the row padded to one."""
    offsets, end = [], 0
    for size in sizes:
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"part sizes must be integers >= 0 bytes, got {size!r}")
        offsets.append(end)
        end += -(-size // WIRE_ALIGN) * WIRE_ALIGN
    return offsets, end


@dataclass
class Payload:
    """A compressed tensor.

    method:  name of the method that made it (a key of ``gradcomp.METHODS``).
    shape, dtype: of the tensor it decompresses to.
    parts:   ordered tensors that cross the wire (e.g. ``q`` int8[n] and ``scales`` fp32[n/256]).
    options: the method's options needed to decode (block size, scale, ...); never sent.
    rows:    None for one payload; p for p payloads of the same layout stacked (every part has a
             leading dimension p: several ranks' payloads, as ``Method.decode_sum`` takes them).
    """

    method: str
    shape: torch.Size
    dtype: torch.dtype
    parts: dict[str, torch.Tensor]
    options: dict = field(default_factory=dict)
    rows: int | None = None

    @property
    def numel(self) -> int:
        """Elements of the tensor this payload (each row) decompresses to."""
        return int(torch.Size(self.shape).numel())

    @property
    def device(self) -> torch.device:
        """Where the parts live (CPU for a payload without parts)."""
        first = next(iter(self.parts.values()), None)
        return first.device if first is not None else torch.device("cpu")

    def _row_sizes(self) -> list[int]:
        """Bytes of each part in one row (the whole part for a single payload)."""
        skip = 0 if self.rows is None else 1
        return [math.prod(t.shape[skip:]) * t.element_size() for t in self.parts.values()]

    @property
    def nbytes(self) -> int:
        """Bytes this payload (all its rows) puts in a gathered or all-to-all buffer: its parts'
        bytes plus the wire layout's padding (:func:`wire_layout`), ``flatten().numel()``."""
        return (self.rows if self.rows is not None else 1) * wire_layout(self._row_sizes())[1]

    @property
    def parts_nbytes(self) -> int:
        """Bytes of the parts alone, no padding: what an all-reduce of the parts as they lie
        sends (the ``allreduce`` and ``lowrank`` schemes)."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    @property
    def ratio(self) -> float:
        """Compression ratio: the uncompressed tensor's bytes over ``nbytes`` (inf when 0 bytes)."""
        raw = (self.rows or 1) * self.numel * torch.empty((), dtype=self.dtype).element_size()
        return raw / self.nbytes if self.nbytes else float("inf")

    def wire_chunks(self) -> list[torch.Tensor]:
        """The row's pieces in wire order: each part's bytes and the zero padding after it, uint8
        [size] for one payload, [p, size] for stacked ones; ``torch.cat(chunks, -1)`` is
        :meth:`flatten`. A sender copying several payloads into one buffer cats their chunks."""
        lead = () if self.rows is None else (self.rows,)
        sizes = self._row_sizes()
        offsets, end = wire_layout(sizes)
        chunks, zeros = [], None  # the pads: slices of one zero tensor (one fill)
        for t, size, offset, next_offset in zip(self.parts.values(), sizes, offsets, offsets[1:] + [end]):
            chunks.append(t.contiguous().reshape(*lead, size // t.element_size()).view(torch.uint8))
            if next_offset > offset + size:
                if zeros is None:
                    zeros = torch.zeros(*lead, WIRE_ALIGN - 1, dtype=torch.uint8, device=t.device)
                chunks.append(zeros[..., :next_offset - offset - size])
        return chunks

    def flatten(self) -> torch.Tensor:
        """All parts as one new contiguous uint8 buffer in the wire layout: [nbytes] for one
        payload, [p, nbytes / p] (one row per payload) for stacked ones."""
        lead = () if self.rows is None else (self.rows,)
        chunks = self.wire_chunks()
        if not chunks:
            return torch.empty(*lead, 0, dtype=torch.uint8, device=self.device)
        return torch.cat(chunks, dim=-1)

    def unflatten(self, buffer: torch.Tensor) -> Payload:
        """A payload laid out like this one (a single payload) whose parts are read from
        ``buffer`` in the wire layout: uint8[nbytes] gives one payload, uint8[p, nbytes] p
        stacked payloads (rows).

        Used on the receiving side of a collective: every rank's payload of the same tensor has
        the same layout, so the local payload is the template for the peers' buffers. The
        buffer's size is checked against the template; the padding is never read. Parts are
        views of ``buffer`` (copies only when the buffer itself lies at an offset or row stride
        misaligned for a part's dtype).
        """
        if self.rows is not None:
            raise ValueError("unflatten needs a single payload as the template, not stacked rows")
        if buffer.dtype != torch.uint8 or buffer.dim() not in (1, 2) or buffer.shape[-1] != self.nbytes:
            raise ValueError(
                f"buffer must be uint8[{self.nbytes}] or uint8[p, {self.nbytes}] for a "
                f"{self.method} payload, got {buffer.dtype}{list(buffer.shape)}"
            )
        lead = tuple(buffer.shape[:-1])
        sizes = self._row_sizes()
        parts = {}
        for (name, t), size, offset in zip(self.parts.items(), sizes, wire_layout(sizes)[0]):
            raw = buffer[..., offset : offset + size]
            if size == 0:  # nothing to read (an empty tensor's payload)
                parts[name] = torch.empty(*lead, *t.shape, dtype=t.dtype, device=buffer.device)
                continue
            if raw.storage_offset() % t.element_size() or any(
                    stride % t.element_size() for stride in raw.stride()[:-1]):
                # a fresh, canonically strided copy (clone keeps the odd stride of a size-1
                # leading dimension)
                raw = torch.empty(raw.shape, dtype=raw.dtype, device=raw.device).copy_(raw)
            parts[name] = raw.view(t.dtype).view(*lead, *t.shape)
        return Payload(self.method, self.shape, self.dtype, parts, dict(self.options),
                       lead[0] if lead else None)

    @staticmethod
    def stack(payloads: list[Payload]) -> Payload:
        """p payloads of one layout (same method, options, shape and part shapes) as rows."""
        if not payloads:
            raise ValueError("stack needs at least one payload")
        first = payloads[0]
        for p in payloads:
            if (p.rows is not None or p.method != first.method or p.options != first.options
                    or tuple(p.shape) != tuple(first.shape)
                    or [(k, v.shape, v.dtype) for k, v in p.parts.items()]
                    != [(k, v.shape, v.dtype) for k, v in first.parts.items()]):
                raise ValueError("stack needs single payloads of one layout (method, options, "
                                 "shape and parts)")
        parts = {name: torch.stack([p.parts[name] for p in payloads]) for name in first.parts}
        return Payload(first.method, first.shape, first.dtype, parts, dict(first.options), len(payloads))

    def as_rows(self, rows: int = 1) -> Payload:
        """This single payload as stacked rows (views, no copy): one row of the whole, or
        ``rows`` equal rows, each part cut evenly (the payload of a tensor of whole granules
        cut into ``rows`` chunks of whole granules: the inverse of :meth:`joined`)."""
        if self.rows is not None:
            raise ValueError("as_rows() needs a single payload")
        if rows == 1:
            return Payload(self.method, self.shape, self.dtype,
                           {k: v.unsqueeze(0) for k, v in self.parts.items()}, self.options, 1)
        if self.numel % rows or any(v.numel() % rows for v in self.parts.values()):
            raise ValueError(f"a {self.method} payload of {self.numel} elements does not split "
                             f"into {rows} equal rows")
        return Payload(self.method, torch.Size([self.numel // rows]), self.dtype,
                       {k: v.reshape(rows, -1) for k, v in self.parts.items()}, self.options, rows)

    def joined(self) -> Payload:
        """Stacked rows as one payload of the rows' tensors end to end (each part's rows
        concatenated; shape (rows * numel,)). Sound for chunks of whole granules of the method
        (``Method.granule``), as the two-phase scheme cuts them."""
        if self.rows is None:
            raise ValueError("joined() needs stacked payloads")
        return Payload(self.method, torch.Size([self.rows * self.numel]), self.dtype,
                       {k: v.reshape(-1).contiguous() for k, v in self.parts.items()}, self.options)

    def row(self, i: int) -> Payload:
        """Row ``i`` of stacked payloads, as a single payload (views)."""
        if self.rows is None:
            raise ValueError("row() needs stacked payloads")
        return Payload(self.method, self.shape, self.dtype, {k: v[i] for k, v in self.parts.items()},
                       self.options)

    def to(self, device) -> Payload:
        """This payload with every part moved to ``device``."""
        parts = {k: v.to(device) for k, v in self.parts.items()}
        return Payload(self.method, self.shape, self.dtype, parts, dict(self.options), self.rows)
