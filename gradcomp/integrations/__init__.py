"""Checkpointing gradcomp hook states with training frameworks; each module imports its framework
only when used.

- :mod:`gradcomp.integrations.accelerate`: ``checkpoint_hook_state(accelerator, state)`` makes
  ``accelerator.save_state`` / ``load_state`` save and restore every rank's hook state.
- :mod:`gradcomp.integrations.lightning`: ``CommHookCallback(state, hook)``, a Lightning callback
  that registers the hook and puts every rank's hook state into Lightning checkpoints.
- :mod:`gradcomp.integrations.dcp`: ``PerRank(state)``, a torch.distributed.checkpoint
  ``Stateful`` that saves and loads every rank's state (hooks, FSDP handles, optimizers) under
  its own key, beside the model and optimizer.
- :mod:`gradcomp.integrations.transformers`: ``attach(trainer, state, hook)``, called once before
  ``trainer.train()``, registers the hook on the Hugging Face Trainer's DDP model and saves every
  rank's hook state into each checkpoint folder, restored by ``train(resume_from_checkpoint=...)``.
"""
from __future__ import annotations

import importlib

MODULES = ("accelerate", "dcp", "lightning", "transformers")


def __getattr__(name: str):
    """``gradcomp.integrations.<name>`` after a plain ``import gradcomp``: the module is imported
    on first access (its framework with it), never before."""
    if name in MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
