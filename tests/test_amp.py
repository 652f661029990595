"""Mixed precision as users run it: torch.autocast (fp16 and bf16) and a GradScaler, on 2 Gloo
ranks, under every hook. A step the scaler skips (an inf loss on one rank) leaves no trace in the
residuals, and the scaler skips and rescales exactly as with DDP's own all-reduce."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddp_models import batch, build_model, flat_params, make_ddp
from dist_utils import run_ranks
from gradcomp.hooks import register

pytestmark = pytest.mark.slow

STEPS, SKIPPED = 5, 2
CONFIGS = [("default", None, {}), ("allreduce", "none", {}), ("fp16", "fp16", {"error_feedback": True}),
           ("int8", "int8", {}), ("int8_twophase", "int8", {"scheme": "twophase", "stochastic": True}),
           ("sign", "sign", {"chunk": 64}), ("topk", "topk", {"ratio": 0.1}),
           ("powersgd", "powersgd", {"matrix_rank": 2})]


def _train(rank, dtype, method, options, skipped_batch):
    """STEPS steps under autocast + GradScaler; at step SKIPPED rank 0's loss is inf (batch
    ``skipped_batch``). Returns (parameters, scale after every step)."""
    model = make_ddp(build_model())
    if method is not None:
        state = register(model, method, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    if method is not None:
        state.follow_scaler(scaler)
    scales = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(skipped_batch if step == SKIPPED else step, rank)
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x).float(), y)
        if step == SKIPPED and rank == 0:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return flat_params(model.module), scales


def _suite(rank, world):
    return {(dtype, label, skipped_batch): _train(rank, dtype, method, options, skipped_batch)
            for dtype in (torch.float16, torch.bfloat16) for label, method, options in CONFIGS
            for skipped_batch in (SKIPPED, 7)}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_suite, 2)


def test_scaler_skips_and_rescales_as_without_a_hook(runs):
    for (dtype, label, skipped_batch), (params, scales) in runs[0].items():
        reference = runs[0][(dtype, "default", skipped_batch)][1]
        assert scales == reference, f"{dtype} {label}: scale history {scales} != DDP's {reference}"
        assert scales[SKIPPED] == scales[SKIPPED - 1] / 2  # the inf step was skipped
        assert torch.isfinite(params).all(), f"{dtype} {label}"
        assert torch.equal(params, runs[1][(dtype, label, skipped_batch)][0]), f"{dtype} {label}: replicas differ"


def test_a_skipped_step_leaves_no_trace_in_the_residuals(runs):
    """The skipped step's finite gradients differ between the two runs (another batch); with the
    residuals restored after the skip, the runs end bit-identical."""
    for dtype in (torch.float16, torch.bfloat16):
        for label, _, _ in CONFIGS:
            one, other = runs[0][(dtype, label, SKIPPED)][0], runs[0][(dtype, label, 7)][0]
            assert torch.equal(one, other), f"{dtype} {label}: the skipped step changed training"
