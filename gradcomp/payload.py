"""What a compressed tensor is: named parts, the options needed to decode them, and wire bytes."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

    @property
    def nbytes(self) -> int:
        """Exact bytes this payload (all its rows) puts on the wire: the sum of its parts' bytes."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    @property
    def ratio(self) -> float:
        """Compression ratio: the uncompressed tensor's bytes over ``nbytes`` (inf when 0 bytes)."""
        raw = (self.rows or 1) * self.numel * torch.empty((), dtype=self.dtype).element_size()
        return raw / self.nbytes if self.nbytes else float("inf")

    def flatten(self) -> torch.Tensor:
        """All parts as one contiguous uint8 buffer, parts in order: [nbytes] for one payload,
        [p, nbytes / p] (one row per payload) for stacked ones."""
        lead = () if self.rows is None else (self.rows,)
        chunks = [t.contiguous().view(*lead, -1).view(torch.uint8) for t in self.parts.values()]
        if not chunks:
            return torch.empty(*lead, 0, dtype=torch.uint8, device=self.device)
        return torch.cat(chunks, dim=-1)

    def unflatten(self, buffer: torch.Tensor) -> Payload:
        """A payload laid out like this one (a single payload) whose parts are read from
        ``buffer``: uint8[nbytes] gives one payload, uint8[p, nbytes] p stacked payloads (rows).

        Used on the receiving side of a collective: every rank's payload of the same tensor has
        the same layout, so the local payload is the template for the peers' buffers. Parts are
        views of ``buffer`` where their dtype's alignment allows, else copies.
        """
        if self.rows is not None:
            raise ValueError("unflatten needs a single payload as the template, not stacked rows")
        if buffer.dtype != torch.uint8 or buffer.dim() not in (1, 2) or buffer.shape[-1] != self.nbytes:
            raise ValueError(
                f"buffer must be uint8[{self.nbytes}] or uint8[p, {self.nbytes}] for a "
                f"{self.method} payload, got {buffer.dtype}{list(buffer.shape)}"
            )
        lead = tuple(buffer.shape[:-1])
        parts, offset = {}, 0
        for name, t in self.parts.items():
            size = t.numel() * t.element_size()
            raw = buffer[..., offset : offset + size]
            if raw.storage_offset() % t.element_size() or any(
                    stride % t.element_size() for stride in raw.stride()[:-1]):
                # misaligned for the part's dtype (after an odd-sized part): a fresh, canonically
                # strided copy (clone keeps the odd stride of a size-1 leading dimension)
                raw = torch.empty(raw.shape, dtype=raw.dtype, device=raw.device).copy_(raw)
            parts[name] = raw.view(t.dtype).view(*lead, *t.shape)
            offset += size
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
