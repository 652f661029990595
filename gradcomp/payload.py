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
    """

    method: str
    shape: torch.Size
    dtype: torch.dtype
    parts: dict[str, torch.Tensor]
    options: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        """Elements of the tensor this payload decompresses to."""
        return int(torch.Size(self.shape).numel())

    @property
    def device(self) -> torch.device:
        """Where the parts live (CPU for a payload without parts)."""
        first = next(iter(self.parts.values()), None)
        return first.device if first is not None else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """Exact bytes this payload puts on the wire: the sum of its parts' bytes."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    @property
    def ratio(self) -> float:
        """Compression ratio: the uncompressed tensor's bytes over ``nbytes`` (inf when 0 bytes)."""
        raw = self.numel * torch.empty((), dtype=self.dtype).element_size()
        return raw / self.nbytes if self.nbytes else float("inf")

    def flatten(self) -> torch.Tensor:
        """All parts as one contiguous uint8 buffer of ``nbytes`` bytes, parts in order."""
        chunks = [t.contiguous().reshape(-1).view(torch.uint8) for t in self.parts.values()]
        if not chunks:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return torch.cat(chunks)

    def unflatten(self, buffer: torch.Tensor) -> Payload:
        """A payload laid out like this one whose parts are read from ``buffer`` (uint8[nbytes]).

        Used on the receiving side of a collective: every rank's payload of the same tensor has
        the same layout, so the local payload is the template for the peers' buffers.
        """
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != self.nbytes:
            raise ValueError(
                f"buffer must be uint8[{self.nbytes}] for a {self.method} payload, "
                f"got {buffer.dtype}{list(buffer.shape)}"
            )
        parts, offset = {}, 0
        for name, t in self.parts.items():
            size = t.numel() * t.element_size()
            raw = buffer[offset : offset + size]
            if (raw.storage_offset() % t.element_size()) != 0:
                raw = raw.clone()  # a part after an odd-sized one is misaligned for its dtype
            parts[name] = raw.view(t.dtype).view(t.shape)
            offset += size
        return Payload(self.method, self.shape, self.dtype, parts, dict(self.options))

    def to(self, device) -> Payload:
        """This payload with every part moved to ``device``."""
        parts = {k: v.to(device) for k, v in self.parts.items()}
        return Payload(self.method, self.shape, self.dtype, parts, dict(self.options))
