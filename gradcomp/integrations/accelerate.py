"""Hugging Face Accelerate: save and restore every rank's hook state with ``save_state`` /
``load_state``.

    from accelerate import Accelerator
    from gradcomp.hooks import Int8State, int8_hook
    from gradcomp.integrations.accelerate import checkpoint_hook_state

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
    state = Int8State(None)
    model.register_comm_hook(state, int8_hook)
    checkpoint_hook_state(accelerator, state)
    ...
    accelerator.save_state("ckpt")       # also writes ckpt/gradcomp_hook_state_rank<r>.pt
    accelerator.load_state("ckpt")       # every rank loads its own file

``accelerator.register_for_checkpointing(state)`` is not enough: Accelerate saves custom objects
from the main process only, so every rank would load rank 0's error-feedback residuals (refused
by ``HookState.load_state_dict``).
"""
from __future__ import annotations

import os

import torch

from ..hooks.base import HookState

FILE = "gradcomp_hook_state_rank{rank}.pt"


def checkpoint_hook_state(accelerator, state: HookState) -> tuple:
    """Register save/load pre-hooks on ``accelerator`` that write and read ``state`` per rank
    (``FILE`` in the checkpoint folder), and let ``state`` follow the accelerator's GradScaler
    (fp16 mixed precision; see ``HookState.follow_scaler``). Returns the two removable handles."""
    if getattr(accelerator, "scaler", None) is not None:
        state.follow_scaler(accelerator.scaler)

    def path(folder: str) -> str:
        return os.path.join(folder, FILE.format(rank=accelerator.process_index))

    def save(models, weights, output_dir):
        torch.save(state.state_dict(), path(output_dir))

    def load(models, input_dir):
        state.load_state_dict(torch.load(path(input_dir), weights_only=True))

    return (accelerator.register_save_state_pre_hook(save),
            accelerator.register_load_state_pre_hook(load))
