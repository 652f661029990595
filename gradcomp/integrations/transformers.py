"""Hugging Face Trainer: register a gradcomp hook on the DDP model the Trainer builds, and keep
every rank's hook state in the Trainer's checkpoints.

    from transformers import Trainer
    from gradcomp.hooks import Int8State, int8_hook
    from gradcomp.integrations.transformers import attach

    trainer = Trainer(model=model, args=args, train_dataset=data)
    attach(trainer, Int8State(None), int8_hook)         # once, before train()
    trainer.train(resume_from_checkpoint=True)          # resumes each rank's residuals too

Any gradcomp state and hook work (``PowerSGDState`` / ``powersgd_hook``, ``AutoState`` /
``auto_hook``, ``HOOKS[method]``...). Every save writes ``gradcomp_rank<r>.pt`` (``torch.save``
of ``state.state_dict()``) from every rank r into the checkpoint folder,
``<output_dir>/checkpoint-<step>``; ``train(resume_from_checkpoint=...)`` (a folder, or True for
the newest one in ``output_dir``) makes every rank load its own file (``weights_only=True``)
before the first step. A checkpoint saved with another world size, or without a rank's file,
stops every rank with one ValueError naming each rank's problem; ``restore=False`` starts the
hook state afresh instead. Under fp16 the state follows the Trainer's GradScaler
(``trainer.accelerator.scaler``; ``HookState.follow_scaler``). An ``AutoState`` built without an
optimizer is given the Trainer's when training starts (``give_optimizer=False`` keeps it without):
its noise ratios are then in the update's coordinates, every method a candidate by default
(docs/auto.md).

Why ``attach`` and not only ``Trainer(callbacks=[...])``: the Trainer wraps the model in DDP
(through Accelerate) inside ``train()`` and gives callbacks the unwrapped model, never the DDP
wrapper nor the folder it resumes from. ``attach`` adds a :class:`CommHookCallback` that keeps
the trainer, so that at ``on_train_begin`` it registers the hook on ``trainer.model_wrapped``
(the DDP model, or a ``torch.compile`` module around it), and wraps this trainer's ``train`` to
learn ``resume_from_checkpoint``. It uses only the Trainer's public surface (``model_wrapped``,
``accelerator``, ``add_callback``, the ``optimizer`` callbacks are given, ``train``'s argument,
the ``checkpoint-<step>`` folders of ``transformers.trainer_utils.PREFIX_CHECKPOINT_DIR``), all
there and used the same way since transformers 4.30 (the ``hf`` extra asks for 4.46); tested
with transformers 5.24 (Accelerate 1.15). Not covered: hyperparameter search (its checkpoints go
to per-trial folders), DeepSpeed and FSDP (no DDP model: ``train()`` raises TypeError).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..hooks.base import HookState
from . import give_auto_optimizer

FILE = "gradcomp_rank{rank}.pt"


class CommHookCallback(TrainerCallback):
    """Register ``hook`` with ``state`` (a gradcomp HookState) on the Trainer's DDP model when
    training starts, save ``state`` into every checkpoint folder per rank (``FILE``), restore it
    when ``train`` resumes (unless ``restore`` is False), and under fp16 let it follow the
    Trainer's GradScaler; ``give_optimizer``: give an AutoState built without an optimizer the
    Trainer's (:func:`gradcomp.integrations.give_auto_optimizer`) when training starts, before it
    restores ``state``. Needs its trainer: build it with :func:`attach`, or call :meth:`attach` on
    a callback already given to ``Trainer(callbacks=[...])``."""

    def __init__(self, state: HookState, hook, restore: bool = True, give_optimizer: bool = True):
        self.state, self.hook, self.restore, self.give_optimizer = state, hook, restore, give_optimizer
        self.trainer = None
        self._registered = None  # the DDP model the hook is on
        self._resume: str | None = None  # the folder the running train() resumes from

    def attach(self, trainer) -> CommHookCallback:
        """Bind to ``trainer``: add this callback to it (if it is not there yet) and wrap its
        ``train`` to note the checkpoint it resumes from. Call once, before ``train()``."""
        if self.trainer is not None or getattr(trainer.train, "_gradcomp_callback", None) is not None:
            raise RuntimeError("gradcomp: this trainer or this callback is already attached")
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        train = trainer.train

        @functools.wraps(train)
        def train_and_restore(resume_from_checkpoint=None, *args, **kwargs):
            if resume_from_checkpoint is True:  # what the Trainer resolves it to
                resume_from_checkpoint = get_last_checkpoint(trainer.args.output_dir) or True
            folder = resume_from_checkpoint
            self._resume = os.fspath(folder) if isinstance(folder, (str, os.PathLike)) else None
            try:
                return train(resume_from_checkpoint, *args, **kwargs)
            finally:
                self._resume = None

        train_and_restore._gradcomp_callback = self
        trainer.train = train_and_restore
        return self

    def _model(self):
        model = self.trainer.model_wrapped
        model = getattr(model, "_orig_mod", model)  # torch.compile'd by Accelerate
        if not hasattr(model, "register_comm_hook"):
            raise TypeError(f"gradcomp: the Trainer trains a {type(model).__name__}, not a "
                            "DistributedDataParallel model (launch more than one process with "
                            "torchrun or accelerate launch; DeepSpeed and FSDP are not DDP)")
        return model

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise RuntimeError("gradcomp: CommHookCallback needs its trainer, which callbacks are "
                               "not given: use gradcomp.integrations.transformers.attach(trainer, "
                               "state, hook), or callback.attach(trainer) before train()")
        model = self._model()
        if model is not self._registered:  # a second train() keeps the same DDP model
            model.register_comm_hook(self.state.bind(model), self.hook)
            self._registered = model
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if scaler is not None:
            self.state.follow_scaler(scaler)
        if self.give_optimizer and kwargs.get("optimizer") is not None:  # before the restore: its options
            give_auto_optimizer(self.state, kwargs["optimizer"])
        if self._resume is not None and self.restore:
            self.load(self._resume)

    def on_save(self, args, state, control, **kwargs):
        # the Trainer calls on_save on every rank, after writing the checkpoint folder
        self.save(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))

    def save(self, folder: str) -> None:
        """Write this rank's ``state.state_dict()`` to ``folder/FILE``."""
        os.makedirs(folder, exist_ok=True)
        torch.save(self.state.state_dict(), os.path.join(folder, FILE.format(rank=_rank())))

    def load(self, folder: str) -> None:
        """Every rank loads its own ``folder/FILE``; if any rank cannot (no file, another world
        size, another state or options), every rank raises ValueError naming each failure
        (one all-gather, so that no rank trains on while another stopped)."""
        rank, error = _rank(), None
        path = os.path.join(folder, FILE.format(rank=rank))
        try:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no {FILE.format(rank=rank)} (saved with fewer ranks, or "
                                        "without gradcomp?)")
            self.state.load_state_dict(torch.load(path, weights_only=True))
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"rank {rank}: {exc}"
        errors = [error]
        if dist.is_initialized():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        failed = [e for e in errors if e is not None]
        if failed:
            raise ValueError(f"gradcomp could not restore the hook state from {folder}: "
                             + "; ".join(failed) + ". Resume with the world size that saved it, or "
                             "attach with restore=False to start the hook state afresh")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def attach(trainer, state: HookState, hook, restore: bool = True,
           give_optimizer: bool = True) -> CommHookCallback:
    """Make ``trainer`` (a ``transformers.Trainer``) train with ``hook`` and ``state`` and keep
    ``state`` in its checkpoints (see the module docstring); returns the callback. Call once,
    before ``trainer.train()``."""
    return CommHookCallback(state, hook, restore, give_optimizer).attach(trainer)


__all__ = ["CommHookCallback", "attach", "FILE"]
