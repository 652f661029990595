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

The Trainer's and Lightning's callbacks give an ``AutoState`` built without an optimizer the one
the framework builds (:func:`give_auto_optimizer`), before the first step.
"""
from __future__ import annotations

import importlib
import logging

MODULES = ("accelerate", "dcp", "lightning", "transformers")
log = logging.getLogger(__name__)


def give_auto_optimizer(state, optimizer) -> bool:
    """Give ``optimizer`` (a framework's, possibly wrapped) to ``state`` when it is an AutoState
    (``AutoState.use_optimizer``: its noise ratios then in the update's coordinates, its defaults
    those given an optimizer) and auto knows that optimizer's update (torch's SGD, Adam, AdamW);
    another optimizer is left out with a warning (auto keeps to the gradient's coordinates).
    Whether it was given; False for any other state."""
    from ..analysis.auto import optimizer_family, torch_optimizer
    from ..hooks.auto import AutoState

    if not isinstance(state, AutoState):
        return False
    if optimizer_family(optimizer) is None:
        log.warning("gradcomp: auto is not given the %s the framework built (its update's coordinates are "
                    "known for torch's SGD, Adam and AdamW): it measures in the gradient's",
                    type(torch_optimizer(optimizer)).__name__)
        return False
    state.use_optimizer(optimizer)
    return True


def __getattr__(name: str):
    """``gradcomp.integrations.<name>`` after a plain ``import gradcomp``: the module is imported
    on first access (its framework with it), never before."""
    if name in MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
