"""What every gradcomp DDP hook state shares: the process group, statistics, error-feedback memory
keyed by bucket, checkpointing, and the first-step check that all ranks are configured alike.

A hook written on top of :class:`HookState` follows this shape (PyTorch's contract,
``hook(state, bucket) -> Future[Tensor]`` holding the averaged gradient of ``bucket.buffer()``)::

    @resumable
    def my_hook(state, bucket):
        state.begin_bucket(bucket, "my_hook")   # config check on the first bucket, counters
        ...                                      # issue collectives here, in this thread
        state.end_bucket(bucket)                 # counts the step after DDP's last bucket
        return future
"""
from __future__ import annotations

import functools
import hashlib
import json

import torch
import torch.distributed as dist

from ..comm import Deferred, all_gather_into
from ..feedback import ErrorFeedback
from ..methods import Method
from ..payload import Payload
from .stats import HookStats


def resumable(hook):
    """Decorate a hook so that a resumed run replays the checkpoint's bucket layout on its first
    step (see :meth:`HookState.replay_saved_layout`)."""
    @functools.wraps(hook)
    def wrapper(state, bucket):
        if isinstance(state, HookState):
            future = state.replay_saved_layout(bucket, wrapper)
            if future is not None:
                return future
        return hook(state, bucket)
    return wrapper


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
      residuals: :class:`gradcomp.ErrorFeedback`, flat fp32 residuals of whole buckets (or of
                their chunks), keyed by name (``"bucket<index>"``), following parameters across
                bucket rebuilds.
      deferred: :class:`gradcomp.comm.Deferred`, collectives that depend on an earlier one's
                result; flushed at the start of every bucket and after DDP's last bucket, from
                the hook's thread, so every rank issues collectives in the same order.
      step:     completed DDP steps (counted when the hook sees DDP's last bucket).
    """

    def __init__(self, process_group=None, **options):
        self.process_group = process_group
        self.options = dict(options)
        self.stats = HookStats()
        self.residuals = ErrorFeedback()
        self.deferred = Deferred()
        self.step = 0
        self._checked = False
        self.layouts: dict[int, tuple] = {}
        self._saved_layouts = self._replay = None
        self._replaying = False

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
        all_gather_into(gathered, mine, group=self.group)
        if bool((gathered == gathered[0]).all()):
            return
        configs: list = [None] * self.world_size
        dist.all_gather_object(configs, config, group=self.group)
        raise ConfigMismatchError(
            "gradcomp hooks are configured differently across ranks (every rank must register "
            "the same hook with the same method and options):\n" + _describe_differences(configs))

    def begin_bucket(self, bucket, hook_name: str) -> None:
        """Call first in a hook: the consistency check on the first bucket, counters, and the
        launch of collectives deferred by earlier buckets."""
        self.deferred.flush()
        if not self._checked:
            self.check_consistent(hook_name)
            self._checked = True
        self.layouts[bucket.index()] = self.bucket_layout(bucket)
        buffer = bucket.buffer()
        self.stats.buckets += 1
        self.stats.add(raw_bytes=buffer.numel() * buffer.element_size())

    def end_bucket(self, bucket) -> None:
        """Call last in a hook's body: after DDP's last bucket, launches what is still deferred
        and counts a completed step."""
        if bucket.is_last():
            self.deferred.flush()
            self.step += 1
            self.stats.steps += 1

    # ---- parameters and error feedback ----------------------------------------------------
    def bind(self, model) -> HookState:
        """Name the model's parameters, so that bucket residuals follow them across DDP's bucket
        rebuild and a restart, and a resumed run replays the checkpoint's buckets (see
        :meth:`replay_saved_layout`). ``register()`` binds; call it yourself when you use
        ``model.register_comm_hook``. Unbound, residuals still follow parameters within a
        process but restart from zero after a restart whose first step has another layout."""
        module = getattr(model, "module", model)
        self._params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        self._param_names = {id(p): name for name, p in self._params.items()}
        return self

    def bucket_layout(self, bucket) -> tuple:
        """((parameter key, numel), ...) of the bucket's parameters, in bucket order."""
        names = getattr(self, "_param_names", {})
        return tuple((names.get(id(p), f"#{id(p)}"), p.numel()) for p in bucket.parameters())

    def replay_saved_layout(self, bucket, hook):
        """Make a resumed run bit-identical to an uninterrupted one.

        DDP's first step in a new process uses its initial bucket layout and only then rebuilds
        the buckets in gradient order, so compressing that step bucket by bucket would differ
        from the uninterrupted run. On the first step after ``load_state_dict`` (bound state,
        checkpoint layout covering the same parameters, DDP's layout different), this copies each
        bucket's gradients into the checkpoint's buckets and returns a Future for the bucket;
        at DDP's last bucket it runs ``hook`` on the checkpoint's buckets in their order and
        completes those Futures. Returns None when the hook should proceed normally.
        Costs one step without overlap, once per restart.
        """
        saved = self._saved_layouts
        if saved is None or self._replaying:
            return None
        layout = self.bucket_layout(bucket)
        if self._replay is None:
            trainable = set(getattr(self, "_params", {}))
            covered = {key for entry in saved.values() for key, _ in entry}
            if saved.get(bucket.index()) == layout or not trainable or covered != trainable:
                self._saved_layouts = None
                return None
            self._replay = _Replay(saved, self._params, bucket.buffer())
        future = self._replay.add(bucket, layout)
        if bucket.is_last():
            replay, self._replay, self._saved_layouts = self._replay, None, None
            self._replaying = True
            try:
                replay.run(self, hook)
            finally:
                self._replaying = False
        return future

    def compress(self, name: str, x: torch.Tensor, method: Method, error_feedback: bool = True,
                 layout: tuple = ()) -> Payload:
        """Compress the flat tensor ``x`` with ``method``, adding the residual kept under ``name``
        (fp32, x's size, laid out as ``layout`` from :meth:`bucket_layout`) when
        ``error_feedback``; the residual is updated in place."""
        if not error_feedback:
            return method.compress(x)
        residual, method_state = self.residuals.get(name, x.numel(), layout, x.device)
        return method.compress(x, residual, method_state)

    # ---- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Options, step counter, statistics and residuals (with method states: seeds' steps,
        warm-start matrices). Never the process group."""
        return {"state": type(self).__name__, "options": dict(self.options), "step": self.step,
                "stats": self.stats.state_dict(), "residuals": self.residuals.state_dict(),
                "layouts": {i: [list(x) for x in layout] for i, layout in self.layouts.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s output. The process group becomes the default group; the
        consistency check runs again at the next step (a rank resumed from another checkpoint
        fails there)."""
        missing = {"state", "options", "step", "stats", "residuals"} - set(state)
        if missing:
            raise ValueError(f"{type(self).__name__}.load_state_dict: missing {sorted(missing)}")
        if state["state"] != type(self).__name__:
            raise ValueError(f"a {state['state']} checkpoint cannot be loaded into a {type(self).__name__}")
        if state["options"] != self.options:
            raise ValueError(f"{type(self).__name__}.load_state_dict: checkpoint options "
                             f"{state['options']} differ from this state's {self.options}")
        self.step = int(state["step"])
        self.stats.load_state_dict(state["stats"])
        self.residuals.load_state_dict(state["residuals"])
        self.layouts = {int(i): tuple((k, int(n)) for k, n in layout)
                        for i, layout in state.get("layouts", {}).items()}
        self._saved_layouts = dict(self.layouts) or None
        self.process_group = None
        self._checked = False

    def __getstate__(self):
        """Pickling drops the process group (it cannot cross processes); see load_state_dict."""
        out = dict(self.__dict__)
        out["process_group"] = None
        out["_checked"] = False
        out["deferred"] = Deferred()
        out["_params"], out["_param_names"], out["_replay"] = {}, {}, None
        return out

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts}{', ' if opts else ''}step={self.step})"


class _Bucket:
    """A duck-typed GradBucket over part of a flat buffer (for replaying a saved layout)."""

    def __init__(self, index: int, last: bool, buffer: torch.Tensor, params: list):
        self._index, self._last, self._buffer, self._params = index, last, buffer, params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list:
        return self._params

    def gradients(self) -> list:
        out, offset = [], 0
        for p in self._params:
            out.append(self._buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


class _Replay:
    """One step's gradients regrouped into a checkpoint's bucket layout (see replay_saved_layout)."""

    def __init__(self, saved: dict, params: dict, like: torch.Tensor):
        self.order = sorted(saved)
        self.buffers, self.where, self.params = {}, {}, {}
        for index in self.order:
            offset = 0
            for key, numel in saved[index]:
                self.where[key] = (index, offset, numel)
                offset += numel
            self.buffers[index] = torch.zeros(offset, dtype=like.dtype, device=like.device)
            self.params[index] = [params[key] for key, _ in saved[index]]
        self.pending = []

    def add(self, bucket, layout) -> torch.futures.Future:
        for (key, numel), grad in zip(layout, bucket.gradients()):
            index, offset, _ = self.where[key]
            self.buffers[index][offset:offset + numel].copy_(grad.reshape(-1))
        future = torch.futures.Future()
        self.pending.append((layout, bucket.buffer(), future))
        return future

    def run(self, state, hook) -> None:
        futures = [hook(state, _Bucket(index, index == self.order[-1], self.buffers[index], self.params[index]))
                   for index in self.order]
        torch.futures.collect_all(futures).then(self._scatter_back)

    def _scatter_back(self, collected) -> None:
        try:
            results = dict(zip(self.order, (f.value() for f in collected.value())))
        except Exception as exc:
            for _, _, future in self.pending:
                future.set_exception(exc)
            return
        for layout, like, future in self.pending:
            out, offset = torch.zeros_like(like), 0
            for key, numel in layout:
                index, start, _ = self.where[key]
                out[offset:offset + numel] = results[index][start:start + numel]
                offset += numel
            future.set_result(out)
