"""What every gradcomp DDP hook state shares: the process group, statistics, error-feedback memory
keyed by bucket, checkpointing, and the first-step check that all ranks are configured alike.

A hook written on top of :class:`HookState` follows this shape (PyTorch's contract,
``hook(state, bucket) -> Future[Tensor]`` holding the averaged gradient of ``bucket.buffer()``)::

    def my_hook(state, bucket):
        state.begin_bucket(bucket, "my_hook")   # config check on the first bucket, counters
        ...                                      # issue collectives here, in this thread
        state.end_bucket(bucket)                 # counts the step after DDP's last bucket
        return future
"""
from __future__ import annotations

import hashlib
import json
import warnings

import torch
import torch.distributed as dist

from ..feedback import ErrorFeedback
from ..methods import Method
from ..payload import Payload
from .stats import HookStats


class ConfigMismatchError(ValueError):
    """Ranks registered hooks with different configurations (hook, method or options)."""


def _fingerprint(config: dict) -> int:
    """A 63-bit hash of a JSON-able config dict, the same on every rank for equal configs."""
    text = json.dumps(config, sort_keys=True, default=repr)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _describe_differences(configs: list[dict]) -> str:
    """Human-readable list of the keys where some rank's config differs from rank 0's."""
    lines = []
    reference = configs[0]
    for rank, config in enumerate(configs[1:], start=1):
        for key in sorted(set(reference) | set(config)):
            if reference.get(key, "<unset>") != config.get(key, "<unset>"):
                lines.append(f"  {key}: rank 0 has {reference.get(key, '<unset>')!r}, "
                             f"rank {rank} has {config.get(key, '<unset>')!r}")
    return "\n".join(lines)


class HookState:
    """State of a gradcomp DDP hook: group, statistics, residuals by bucket, checkpointing.

    process_group: the group DDP reduces over; None means the default group, resolved when first
        used (so a state can be built before ``init_process_group``).
    options: the hook's options (JSON-able values); they enter the first-step consistency check
        and ``state_dict()``. Subclasses validate them.

    Attributes:
      stats:    :class:`HookStats`, bytes and times summed over the buckets of each step;
                ``state.stats()`` is its summary.
      feedback: :class:`ErrorFeedback` residuals keyed ``"bucket<index>"`` (and whatever other
                names a hook chooses), fp32, bucket-sized.
      step:     completed DDP steps (counted when the hook sees DDP's last bucket).
    """

    def __init__(self, process_group=None, **options):
        self.process_group = process_group
        self.options = dict(options)
        self.stats = HookStats()
        self.feedback = ErrorFeedback()
        self.step = 0
        self._checked = False

    # ---- group ---------------------------------------------------------------------------
    @property
    def group(self):
        """The process group collectives run on (the default group when none was given)."""
        if not dist.is_initialized():
            raise RuntimeError("gradcomp hook: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group() before training")
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    # ---- per-bucket bookkeeping ------------------------------------------------------------
    def config(self, hook_name: str) -> dict:
        """What must be equal on every rank: hook, state class, options and the step counter."""
        return {"hook": hook_name, "state": type(self).__name__, "step": self.step,
                "world_size": self.world_size, **self.options}

    def check_consistent(self, hook_name: str) -> None:
        """All ranks compare config fingerprints; raise ConfigMismatchError naming differences.

        One all-gather of an int64 per rank; on a mismatch (seen identically by every rank, so
        none hangs) a second all-gather of the configs names the differing keys.
        """
        config = self.config(hook_name)
        mine = torch.tensor([_fingerprint(config)], dtype=torch.int64)
        gathered = torch.empty(self.world_size, dtype=torch.int64)
        dist.all_gather_into_tensor(gathered, mine, group=self.group)
        if bool((gathered == gathered[0]).all()):
            return
        configs: list = [None] * self.world_size
        dist.all_gather_object(configs, config, group=self.group)
        raise ConfigMismatchError(
            "gradcomp hooks are configured differently across ranks (every rank must register "
            "the same hook with the same method and options):\n" + _describe_differences(configs))

    def begin_bucket(self, bucket, hook_name: str) -> None:
        """Call first in a hook: the consistency check on the first bucket, then counters."""
        if not self._checked:
            self.check_consistent(hook_name)
            self._checked = True
        buffer = bucket.buffer()
        self.stats.buckets += 1
        self.stats.add(raw_bytes=buffer.numel() * buffer.element_size())

    def end_bucket(self, bucket) -> None:
        """Call last in a hook's body: counts a completed step after DDP's last bucket."""
        if bucket.is_last():
            self.step += 1
            self.stats.steps += 1

    # ---- error feedback --------------------------------------------------------------------
    def compress(self, name: str, x: torch.Tensor, method: Method, error_feedback: bool = True) -> Payload:
        """Compress ``x`` with ``method``, adding the residual kept under ``name`` when
        ``error_feedback``; a residual of another size (DDP rebuilt its buckets after the first
        step) is dropped with a warning and restarts from zero."""
        if not error_feedback:
            return method.compress(x)
        if name in self.feedback.names() and self.feedback.residual(name).shape != x.shape:
            warnings.warn(f"gradcomp: {name} changed size (DDP rebuilt its buckets); its "
                          "error-feedback residual restarts from zero", stacklevel=2)
            self.feedback.reset(name)
        return self.feedback.compress(name, x, method)

    # ---- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Options, step counter, statistics and residuals (with method states: seeds' steps,
        warm-start matrices). Never the process group."""
        return {"state": type(self).__name__, "options": dict(self.options), "step": self.step,
                "stats": self.stats.state_dict(), "feedback": self.feedback.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s output. The process group becomes the default group; the
        consistency check runs again at the next step (a rank resumed from another checkpoint
        fails there)."""
        missing = {"state", "options", "step", "stats", "feedback"} - set(state)
        if missing:
            raise ValueError(f"{type(self).__name__}.load_state_dict: missing {sorted(missing)}")
        if state["state"] != type(self).__name__:
            raise ValueError(f"a {state['state']} checkpoint cannot be loaded into a {type(self).__name__}")
        if state["options"] != self.options:
            raise ValueError(f"{type(self).__name__}.load_state_dict: checkpoint options "
                             f"{state['options']} differ from this state's {self.options}")
        self.step = int(state["step"])
        self.stats.load_state_dict(state["stats"])
        self.feedback.load_state_dict(state["feedback"])
        self.process_group = None
        self._checked = False

    def __getstate__(self):
        """Pickling drops the process group (it cannot cross processes); see load_state_dict."""
        out = dict(self.__dict__)
        out["process_group"] = None
        out["_checked"] = False
        return out

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts}{', ' if opts else ''}step={self.step})"
