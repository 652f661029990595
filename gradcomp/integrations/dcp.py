"""torch.distributed.checkpoint (DCP): gradcomp's per-rank state beside the model, as a ``Stateful``.

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from gradcomp.integrations.dcp import PerRank

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "comm": PerRank(state)},
             checkpoint_id=folder)
    # a new run: build and register everything the same way first, then
    model_state, optim_state = get_state_dict(model, optimizer)
    checkpoint = {"model": model_state, "optim": optim_state, "comm": PerRank(state)}
    dcp.load(checkpoint, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=checkpoint["model"],
                   optim_state_dict=checkpoint["optim"])

``PerRank(obj)`` takes anything of gradcomp's with ``state_dict`` / ``load_state_dict``: a DDP
hook state (``auto`` and hierarchical included), a ``gradcomp.fsdp.compress`` handle, ZeroOneAdam,
DGC or DiLoCo. Their state is per rank (error-feedback residuals, each rank's own). DCP keeps one
copy of entries that have the same key on every rank (it takes them as replicated), so each rank
writes its state under its own key, ``rank<r>``, one opaque entry (``torch.save`` bytes: loading
needs no tensors of the right shapes in a fresh run, whose residuals do not exist yet). On load,
rank r reads ``rank<r>`` back, bit for bit. A checkpoint from another world size is refused: by
the state's own check (it records the rank and world size that saved it) when rank r exists in
it, by DCP's missing-key error otherwise; to change the world size, start the residuals afresh
(register the same way, do not load ``comm``).
"""
from __future__ import annotations

import io

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful


class PerRank(Stateful):
    """A DCP ``Stateful`` over ``obj`` (anything with ``state_dict`` / ``load_state_dict``) that
    saves and loads this rank's state under the key ``rank<r>`` (r: the rank in
    ``process_group``, default the default group)."""

    def __init__(self, obj, process_group=None):
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"PerRank needs an object with state_dict and load_state_dict, got "
                            f"{type(obj).__name__}")
        self.obj, self.process_group = obj, process_group

    def _key(self) -> str:
        if not dist.is_initialized():
            raise RuntimeError("PerRank: torch.distributed is not initialized (DCP saves per rank)")
        return f"rank{dist.get_rank(self.process_group)}"

    def state_dict(self) -> dict:
        buffer = io.BytesIO()
        torch.save(self.obj.state_dict(), buffer)
        return {self._key(): buffer.getvalue()}

    def load_state_dict(self, state_dict: dict) -> None:
        key = self._key()
        saved = state_dict.get(key)
        if not isinstance(saved, (bytes, bytearray)) or not saved:
            raise ValueError(f"PerRank: the checkpoint holds no state for {key} (saved by "
                             "another world size?); register afresh instead of loading it")
        try:
            state = torch.load(io.BytesIO(saved), weights_only=True)
        except Exception as exc:  # bytes another process wrote: untrusted, never unpickled freely
            raise ValueError(f"PerRank: the checkpoint's {key} entry ({len(saved)} bytes) is not a state "
                             f"PerRank saved ({type(exc).__name__}); load the checkpoint this run "
                             "wrote, or register afresh instead of loading it") from None
        self.obj.load_state_dict(state)


__all__ = ["PerRank"]
