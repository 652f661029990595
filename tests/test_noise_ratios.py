"""benchmarks/noise_ratios.py: the ratio as AdamW sees it. Its ``adam_weight`` must be exactly
what AdamW divides each coordinate of a step's gradient by, or the adam:* columns measure
something AdamW never applies."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import noise_ratios  # noqa: E402


@pytest.mark.parametrize("steps_before", [0, 3])
def test_adam_weight_is_what_adamw_divides_the_gradient_by(steps_before):
    """With beta1 = 0, no weight decay and lr 1, AdamW moves each coordinate by g / (sqrt(v_hat)
    + eps): the step taken equals -g * adam_weight (first step and later ones, two groups)."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))
    optimizer = torch.optim.AdamW([{"params": [a], "eps": 1e-3}, {"params": [b], "betas": (0.0, 0.9)}],
                                  lr=1.0, betas=(0.0, 0.95), weight_decay=0.0)
    params = [a, b]
    for _ in range(steps_before + 1):
        grads = [torch.randn_like(p) * torch.logspace(-3, 1, p.numel()).view_as(p) for p in params]
        average = torch.cat([g.reshape(-1) for g in grads])
        weight = noise_ratios.adam_weight(optimizer, params, average)
        before = torch.cat([p.detach().reshape(-1).clone() for p in params])
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
        moved = torch.cat([p.detach().reshape(-1) for p in params]) - before
    torch.testing.assert_close(moved, -average * weight, rtol=1e-5, atol=1e-6)


def test_digits_distortion_off_the_digits_is_refused(capsys):
    with pytest.raises(SystemExit):
        noise_ratios.main(["--model", "gpt", "--digits-distort", "2"])
    assert "--digits-distort is resnet20's" in capsys.readouterr().err
