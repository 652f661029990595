"""Optimizers that own the gradient exchange: they decide what is compressed (momentum, not the
gradient) and send it themselves, so DDP's all-reduce must be off for them.

    model = DistributedDataParallel(net)
    gradcomp.optim.local_gradients(model)           # DDP's all-reduce off (a no-op comm hook)
    opt = gradcomp.optim.ZeroOneAdam(net.parameters(), model, lr=2e-3, warmup_steps=10)
    loss.backward(); opt.step(); opt.stats()         # raw and wire bytes, ratio

- :class:`ZeroOneAdam`: AdamW with warm-up, frozen / exponentially refreshed variance and scaled
  sign momentum through the two-phase compressed all-reduce (1-bit Adam / 0/1 Adam), optionally
  with 0/1 Adam's local steps (``local_updates="own"``, ``sync_every``, ``sync_growth``).
- :class:`DiLoCo`: any inner optimizer (AdamW) for H local steps, then a Nesterov outer step on
  the mean pseudo-gradient (anchor - parameters) sent compressed with error feedback; optionally
  streaming (``fragments``: pieces of the model synced at staggered steps).
- :class:`DGC`: SGD with momentum exchanging top-k of the momentum-corrected velocity.
- :func:`moving_average_compress`: LoCo's moving-average error feedback for any method.

Every one compares its configuration across ranks (parameters at construction; options, each
param group's hyper-parameters, step and GradScaler use at the first step: ConfigMismatchError on
every rank), checks a checkpoint against the live optimizer before loading it, and works under
``torch.amp.GradScaler`` with ``opt.follow_scaler(scaler)`` (every rank skips the same steps; see
gradcomp.optim.base). See docs/convergence.md ("Optimizers that own the exchange", "GradScaler").
"""
from .dgc import DGC
from .diloco import DiLoCo
from .exchange import DDPStillReducesError, check_local, local_gradients, local_gradients_hook
from ..feedback import moving_average_compress
from .zeroone import ZeroOneAdam
from ..schedules import dgc_density, exchange_schedule, fragment_bounds, fragments_due, sync_interval

__all__ = ["ZeroOneAdam", "exchange_schedule", "sync_interval", "dgc_density", "DGC", "moving_average_compress",
           "DiLoCo", "fragments_due", "fragment_bounds",
           "local_gradients", "local_gradients_hook", "check_local", "DDPStillReducesError"]
