"""Lightning: a callback that registers a gradcomp hook on Lightning's DDP model and keeps every
rank's hook state in Lightning checkpoints.

    from gradcomp.hooks import PowerSGDState, powersgd_hook
    from gradcomp.integrations.lightning import CommHookCallback

    state = PowerSGDState(None, matrix_rank=4)
    trainer = Trainer(strategy="ddp", callbacks=[CommHookCallback(state, powersgd_hook)])
    trainer.fit(model, ckpt_path="last.ckpt")    # resumes each rank's residuals too

The callback registers the hook itself: ``DDPStrategy(ddp_comm_hook=...)`` registers it on CUDA
only (Lightning 2.6 ignores it on CPU without a word); do not pass both. Lightning writes a checkpoint from global rank 0 only, so the callback's ``state_dict`` gathers
every rank's hook state (one all-gather, on every rank, when Lightning saves) and
``load_state_dict`` gives each rank its own. The callback is a ``pytorch_lightning.Callback``
when that package is installed, else a ``lightning.pytorch.Callback``.
"""
from __future__ import annotations

import torch.distributed as dist

from ..hooks.base import HookState
from . import give_auto_optimizer

try:
    from pytorch_lightning import Callback
except ImportError:
    from lightning.pytorch import Callback


class CommHookCallback(Callback):
    """Register ``hook`` with ``state`` (a gradcomp HookState) on the strategy's DDP model when
    fitting starts, save and restore ``state`` with Lightning checkpoints, per rank, and under
    fp16 mixed precision let ``state`` follow Lightning's GradScaler. ``give_optimizer``: an
    :class:`~gradcomp.hooks.AutoState` built without an optimizer is given the module's one (from
    ``configure_optimizers``, when it returns exactly one torch SGD, Adam or AdamW) before the
    first step, as if at construction (``AutoState.use_optimizer``); False keeps it measuring in
    the gradient's coordinates."""

    def __init__(self, state: HookState, hook, give_optimizer: bool = True):
        self.state, self.hook, self.give_optimizer = state, hook, give_optimizer
        self._saved = None  # this rank's entry of a checkpoint, loaded once fitting has started
        self._started = False

    def on_fit_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        if not hasattr(model, "register_comm_hook"):
            raise TypeError(f"CommHookCallback needs a DDP strategy; the model is a {type(model).__name__}")
        model.register_comm_hook(self.state, self.hook)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.state.follow_scaler(scaler)
        if self.give_optimizer and len(trainer.optimizers) == 1:
            give_auto_optimizer(self.state, trainer.optimizers[0])
        self._started = True
        if self._saved is not None:  # Lightning restores callbacks before fitting starts
            self.load_state_dict({"ranks": [self._saved]})

    def state_dict(self) -> dict:
        mine = self.state.state_dict()
        if not dist.is_initialized():
            return {"ranks": [mine]}
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        return {"ranks": ranks}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore this rank's entry: at once when fitting has started, else when it starts
        (after auto is given the optimizer its checkpoint was saved under)."""
        ranks = state_dict["ranks"]
        rank = dist.get_rank() if dist.is_initialized() else 0
        # another world size: the entry's own world size makes load_state_dict refuse it
        mine = ranks[min(rank, len(ranks) - 1)]
        if not self._started:
            self._saved = mine
            return
        self._saved = None
        self.state.load_state_dict(mine)
