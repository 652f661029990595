"""LoCo-style moving-average error feedback for any method (int4 / int8 hooks in particular).

Plain error feedback keeps e <- h - Q(h) with h = g + e. LoCo (Xie et al., 2024; DeepSpeed's
``all_to_all_loco_quant_reduce``) keeps a moving average of the compression errors instead:
    h = g + e,   send Q(h),   e <- beta e + (1 - beta) (h - Q(h))
(beta 0.8 by default, DeepSpeed's ``err_beta``), and zeroes e every ``reset_every`` steps.
Non-finite values follow gradcomp's rule: sent, never remembered (e is 0 there).
"""
from __future__ import annotations

import torch

from ..methods import Method, get_method
from ..payload import Payload

LOCO_BETA = 0.8
LOCO_RESET_EVERY = 1024


def moving_average_compress(method: str | Method, x: torch.Tensor, residual: torch.Tensor,
                            state: dict, beta: float = LOCO_BETA,
                            reset_every: int | None = LOCO_RESET_EVERY) -> Payload:
    """Compress ``x`` plus the moving-average error ``residual`` (contiguous fp32, x's numel,
    updated in place as the module doc says) with ``method``; ``state`` is the method's state
    dict (as ``ErrorFeedback.get`` returns it), which also keeps this function's step counter
    under ``"loco_step"``. Returns the payload, exactly as ``Method.compress`` would."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
        raise ValueError(f"moving-average error feedback: beta must lie in [0, 1), got {beta!r}")
    if reset_every is not None and (isinstance(reset_every, bool) or not isinstance(reset_every, int)
                                    or reset_every < 1):
        raise ValueError(f"moving-average error feedback: reset_every must be a positive integer "
                         f"or None, got {reset_every!r}")
    step = state.get("loco_step", 0)
    state["loco_step"] = step + 1
    if reset_every is not None and step and step % reset_every == 0:
        residual.zero_()
    previous = residual.clone()
    payload = get_method(method).compress(x, residual, state)  # residual <- h - Q(h), finite only
    residual.mul_(1.0 - beta).add_(previous, alpha=beta)
    return payload
