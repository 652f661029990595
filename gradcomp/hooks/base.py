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

import torch
import torch.distributed as dist

from ..comm import Deferred
from ..consistency import check_consistent
from ..feedback import ErrorFeedback, moving_average_compress
from ..methods import Method
from ..payload import Payload
from .replay import _Bucket, check_sizes, replay_saved_layout
from .stats import HookStats


def resumable(hook):
    """Decorate a hook so that a resumed run replays the checkpoint's bucket layout on its first
    step (see :meth:`HookState.replay_saved_layout`), and so that it also serves compiled
    autograd's per-parameter call form (see :func:`_reduce_parameter`)."""
    @functools.wraps(hook)
    def wrapper(state, bucket):
        if isinstance(bucket, tuple):
            return _reduce_parameter(hook, state, *bucket)
        if isinstance(state, HookState):
            future = state.replay_saved_layout(bucket, wrapper)
            if future is not None:
                return future
        return hook(state, bucket)
    return wrapper


@torch.compiler.disable
def _reduce_parameter(hook, state, grad: torch.Tensor, param: torch.Tensor) -> torch.futures.Future:
    """Compiled autograd's DDP (``optimize_ddp="python_reducer"``) calls a comm hook once per
    parameter as ``hook(state, (grad, param))``, ignores what it returns and expects the average
    written into ``grad`` in place. Compress the parameter as a bucket of its own (there is no
    end-of-backward signal to coalesce safely against), wait for the result and write it back.
    Runs eagerly: one graph break per parameter."""
    flat = grad.view(-1) if grad.is_contiguous() else grad.reshape(-1).clone()
    if isinstance(state, HookState):
        bucket = state.parameter_bucket(flat, param)
    else:
        bucket = _Bucket(0, True, flat, [param])
    future = hook(state, bucket)
    if isinstance(state, HookState):
        state.deferred.flush()  # a two-phase second collective waits for the next bucket otherwise
    reduced = future.wait()
    if reduced.data_ptr() != grad.data_ptr():
        grad.copy_(reduced.view(grad.shape))
    return future


def _refuse_position(name: str, saved: tuple[int, int], rank: int, world_size: int) -> None:
    """Raise ValueError when residuals saved as (rank, world size) ``saved`` are loaded by
    ``rank`` of ``world_size``: error-feedback residuals are per rank and per world size."""
    saved_rank, saved_world = saved
    if saved_world != world_size:
        raise ValueError(
            f"{name}.load_state_dict: the checkpoint was saved with world size {saved_world}, "
            f"this run has {world_size}; error-feedback residuals are per rank and do not "
            f"carry over to another world size: resume with {saved_world} ranks, or start from "
            f"a fresh {name} (skip load_state_dict)")
    if saved_rank != rank:
        raise ValueError(
            f"{name}.load_state_dict: the checkpoint holds rank {saved_rank}'s error-feedback "
            f"residuals, this process is rank {rank}; save state.state_dict() on every "
            f"rank and load each rank's own (gradcomp.integrations does this for Accelerate "
            f"and Lightning)")


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
        self._params: dict[str, torch.Tensor] = {}
        self._param_names: dict[int, str] = {}
        self._loaded_position = None  # (rank, world size) of a loaded checkpoint, checked once
        self._step_open = False
        self._step_parameters: set[int] = set()  # per-parameter calls of the current step
        self._parameters_per_step = None  # learned from the first per-parameter step
        self._parameter_buckets: dict[str, int] = {}  # parameter key -> its per-parameter bucket
        self._scaler = self._scaler_snapshot = None

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

    def check_consistent(self, hook_name: str, device: torch.device) -> None:
        """All ranks compare :meth:`config` (gradcomp.consistency.check_consistent: one
        all-gather of an int64 on ``device``, the bucket's); a mismatch raises
        ConfigMismatchError on every rank naming the differing keys."""
        check_consistent(self.config(hook_name), self.group, device, "the gradcomp hook",
                         "every rank must register the same hook with the same method and options")

    def begin_bucket(self, bucket, hook_name: str) -> None:
        """Call first in a hook: the consistency check on the first bucket, counters, and the
        launch of collectives deferred by earlier buckets."""
        self.deferred.flush()
        if not self._checked:
            self._check_loaded_position()
            self.check_consistent(hook_name, bucket.buffer().device)
            self._checked = True
        if not self._step_open:
            self._step_open = True
            self._follow_scale()
        self.layouts[bucket.index()] = self.bucket_layout(bucket)
        buffer = bucket.buffer()
        self.stats.buckets += 1
        self.stats.add(raw_bytes=buffer.numel() * buffer.element_size())

    def end_bucket(self, bucket) -> None:
        """Call last in a hook's body: after DDP's last bucket, launches what is still deferred
        and counts a completed step."""
        if bucket.is_last():
            self._finish_step()

    def _finish_step(self) -> None:
        self.deferred.flush()
        self.step += 1
        self.stats.steps += 1
        self._step_open = False
        self._step_parameters = set()

    def parameter_bucket(self, flat_grad: torch.Tensor, param: torch.Tensor) -> _Bucket:
        """A bucket of one parameter, for compiled autograd's per-parameter hook calls. Its
        index is the parameter's position in the order of first calls (the same on every rank
        and in every process); a step ends after as many calls as the first step had (or, in a
        step with fewer, when a parameter comes again)."""
        if id(param) in self._step_parameters:  # a new step began before the last one closed
            self._parameters_per_step = self._parameters_per_step or len(self._step_parameters)
            self._finish_step()
        self._step_parameters.add(id(param))
        index = self._parameter_buckets.setdefault(self.parameter_key(param), len(self._parameter_buckets))
        last = len(self._step_parameters) == self._parameters_per_step
        return _Bucket(index, last, flat_grad, [param])

    # ---- automatic mixed precision ---------------------------------------------------------
    def follow_scaler(self, scaler) -> HookState:
        """Keep error-feedback residuals right under ``torch.amp.GradScaler``: the hook sees
        gradients multiplied by the loss scale, so residuals are rescaled whenever the scale
        changes, and a step the scaler skipped (its scale went down) leaves the residuals as
        they were before it. Without this, a skipped step's finite values stay in the residuals
        and a scale change leaves them in the old scale's units."""
        self._scaler = scaler
        return self

    def _follow_scale(self) -> None:
        """At the start of a step: undo a skipped step, rescale, snapshot (see follow_scaler)."""
        if self._scaler is None or not self._scaler.is_enabled():
            return
        scale = float(self._scaler.get_scale())
        if self._scaler_snapshot is not None:
            previous_scale, snapshot = self._scaler_snapshot
            if scale < previous_scale:  # the scaler backed off: it skipped the last step
                self.residuals.load_state_dict(snapshot)
            if scale != previous_scale:
                rescaled = self.residuals.state_dict()
                for entry in rescaled["entries"].values():
                    entry["residual"].mul_(scale / previous_scale)
                for piece in rescaled["pieces"].values():
                    piece.mul_(scale / previous_scale)
                self.residuals.load_state_dict(rescaled)
        self._scaler_snapshot = (scale, self.residuals.state_dict())

    # ---- parameters and error feedback ----------------------------------------------------
    def bind(self, model) -> HookState:
        """Name the model's parameters by their module names (for readable checkpoints and
        :meth:`parameter_residuals`). Optional: an unbound state names each parameter by the
        order in which its buckets first bring it, which is the same in every process, so
        residuals follow parameters across DDP's bucket rebuild and a restart either way."""
        module = getattr(model, "module", model)
        self._params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        self._param_names = {id(p): name for name, p in self._params.items()}
        return self

    def parameter_key(self, param: torch.Tensor) -> str:
        """The parameter's name (bound) or ``"<parameter i>"``, i its order of first appearance."""
        key = self._param_names.get(id(param))
        if key is None:
            key = self._param_names[id(param)] = f"<parameter {len(self._param_names)}>"
            self._params[key] = param  # also keeps the id from being reused
        return key

    def bucket_layout(self, bucket) -> tuple:
        """((parameter key, numel), ...) of the bucket's parameters, in bucket order."""
        return tuple((self.parameter_key(p), p.numel()) for p in bucket.parameters())

    def replay_saved_layout(self, bucket, hook):
        """On the first step after ``load_state_dict``, reduce in the checkpoint's bucket
        layout (gradcomp.hooks.replay.replay_saved_layout); None when ``hook`` should proceed
        normally."""
        return replay_saved_layout(self, bucket, hook)

    def compress(self, name: str, x: torch.Tensor, method: Method, error_feedback: bool = True,
                 layout: tuple = (), scale: float = 1.0) -> Payload:
        """Compress ``scale`` times the flat tensor ``x`` with ``method`` (``Method.compress``'s
        ``scale``), adding the residual kept under ``name`` (fp32, x's size, laid out as
        ``layout`` from :meth:`bucket_layout`) when ``error_feedback``; the residual is updated in
        place: what was not sent, or with the ``loco_beta`` option its moving average
        (gradcomp.feedback.moving_average_compress)."""
        if not error_feedback:
            return method.compress(x, scale=scale)
        residual, method_state = self.residuals.get(name, x.numel(), layout, x.device)
        if self.options.get("loco_beta") is not None:
            return moving_average_compress(method, x, residual, method_state, self.options["loco_beta"],
                                           self.options["loco_reset_every"], scale)
        return method.compress(x, residual, method_state, scale)

    # ---- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Options, step counter, statistics, residuals (with method states: seeds' steps,
        warm-start matrices) and bucket layouts, and the rank and world size they belong to:
        residuals are per rank, so every rank saves its own. Never the process group."""
        rank, world_size = (self.rank, self.world_size) if dist.is_initialized() else (None, None)
        return {"state": type(self).__name__, "options": dict(self.options), "step": self.step,
                "rank": rank, "world_size": world_size,
                "stats": self.stats.state_dict(), "residuals": self.residuals.state_dict(),
                "layouts": {i: [list(x) for x in layout] for i, layout in self.layouts.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s output, saved by this same rank with the same world size
        (checked now, or at the first step when torch.distributed is not initialized yet; a
        mismatch raises ValueError). The process group becomes the default group; the
        consistency check runs again at the next step. A checkpoint refused here leaves this
        state as it was: everything is checked and built before anything is set. Statistics
        and residual stores are loaded into the objects this state already holds (a caller may
        keep ``state.stats``), once the checkpoint has loaded into fresh ones."""
        for name, value in self._loaded(state).items():
            current = getattr(self, name, None)
            if type(current) is type(value) and hasattr(value, "load_state_dict"):
                current.load_state_dict(value.state_dict())
            else:
                setattr(self, name, value)

    def _loaded(self, state: dict) -> dict:
        """The attributes :meth:`load_state_dict` sets from ``state`` (name -> value), checked and
        built without changing this state (ValueError naming what is refused). Subclasses extend
        it with their own."""
        name = type(self).__name__
        missing = {"state", "options", "step", "stats", "residuals"} - set(state)
        if missing:
            raise ValueError(f"{name}.load_state_dict: missing {sorted(missing)}")
        if state["state"] != name:
            raise ValueError(f"a {state['state']} checkpoint cannot be loaded into a {name}")
        if state["options"] != self.options:
            differing = sorted(k for k in {*state["options"], *self.options}
                               if state["options"].get(k, "absent") != self.options.get(k, "absent"))
            raise ValueError(f"{name}.load_state_dict: the checkpoint was saved with other {', '.join(differing)}: "
                             f"checkpoint options {state['options']}, this state's {self.options}")
        position = None if state.get("rank") is None else (int(state["rank"]), int(state["world_size"]))
        if position is not None and dist.is_initialized():  # the default group: see the docstring
            _refuse_position(name, position, dist.get_rank(), dist.get_world_size())
            position = None
        stats = type(self.stats)()
        stats.load_state_dict(state["stats"])
        residuals = ErrorFeedback()
        residuals.load_state_dict(state["residuals"])
        layouts = {int(i): tuple((k, int(n)) for k, n in layout)
                   for i, layout in state.get("layouts", {}).items()}
        self._check_against_model(layouts, residuals)
        return {"process_group": None, "_loaded_position": position, "step": int(state["step"]),
                "stats": stats, "residuals": residuals, "layouts": layouts,
                "_saved_layouts": dict(layouts) or None, "_checked": False}

    def _check_against_model(self, layouts: dict, residuals: ErrorFeedback) -> None:
        """Refuse a checkpoint whose parameters are not the bound model's: a name the model does
        not have, or another size (ValueError). An unbound state is checked against the buckets
        at the first step (gradcomp.hooks.replay)."""
        if not self._params:
            return
        saved = {key: numel for layout in layouts.values() for key, numel in layout}
        saved.update(residuals.parameter_sizes())
        live = {key: p.numel() for key, p in self._params.items()}
        name = type(self).__name__
        unknown = sorted(key for key in saved if key not in live and not key.startswith("<parameter "))
        if unknown:
            raise ValueError(f"{name}.load_state_dict: the checkpoint holds parameters this model does "
                             f"not have: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}; load the state "
                             f"saved for this model, or start from a fresh state (skip load_state_dict)")
        check_sizes(name, saved, live)

    def _check_loaded_position(self) -> None:
        """Refuse residuals saved by another rank or with another world size (a checkpoint loaded
        before torch.distributed was initialized: checked at the first step)."""
        if self._loaded_position is None:
            return
        saved, self._loaded_position = self._loaded_position, None
        _refuse_position(type(self).__name__, saved, self.rank, self.world_size)

    def __getstate__(self):
        """Pickling drops the process group and the parameters (they cannot cross processes);
        see load_state_dict."""
        out = dict(self.__dict__)
        out["process_group"] = None
        out["_checked"] = False
        out["deferred"] = Deferred()
        out["_params"], out["_param_names"], out["_replay"] = {}, {}, None
        out["_step_parameters"], out["_parameter_buckets"], out["_scaler"] = set(), {}, None
        return out

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts}{', ' if opts else ''}step={self.step})"
