"""Every training front on a real GPU, and offsets past 2^31: `pytest -m cuda` (skipped without CUDA).

tests/test_cuda.py holds the kernels and the DDP hooks; this module holds what a GPU user reaches
beyond them, each on a 1-rank NCCL group against the torch backend on the same GPU:

- the hierarchical and LoCo hooks, `auto`, ZeroOneAdam, DGC and DiLoCo train to the torch
  backend's parameters (NCCL takes only tensors on the data's device, so a buffer made without a
  device fails here at its first collective). gradcomp.fsdp is not here: at one rank FSDP2's
  reduce-scatter sends nothing (gradcomp.fsdp returns the row as it is), and NCCL refuses two
  ranks on one GPU;
- compress / decompress of a tensor of more than 2^31 elements gives the torch path's bits in
  its last blocks (a 32-bit offset product wraps there).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_models import flat_params
from kernel_utils import assert_close, assert_same_bits, backend, nccl_group_on_cuda0

import gradcomp
from gradcomp.kernels.common import interpreting

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1 runs kernels on the CPU"),
]

STEPS = 4
RTOL = 1e-4
"""Parameters after training: relative to the largest parameter (sums in other orders)."""


nccl_group = pytest.fixture(scope="module")(nccl_group_on_cuda0)
"""A world-size-1 NCCL process group on 127.0.0.1 (the default group while the module runs)."""


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10)).cuda()


def batches(steps: int):
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        yield torch.randn(32, 64, generator=gen).cuda(), torch.randint(10, (32,), generator=gen).cuda()


def train_ddp(register, optimizer_for=None, steps: int = STEPS):
    """Train a DDP model for ``steps`` on the GPU: ``register(model)`` sets it up and returns
    the state whose ``stats()`` is read; ``optimizer_for(model)`` makes the optimizer (SGD)."""
    model = DDP(net(), device_ids=[0], bucket_cap_mb=0.1)
    state = register(model)
    optimizer = optimizer_for(model) if optimizer_for else torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(steps):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    torch.cuda.synchronize()
    stats = (state if state is not None else optimizer).stats()
    return flat_params(model.module), stats


def on_both_backends(run):
    """``run()`` under the torch backend, then under the kernels: (reference, kernels) results."""
    results = []
    for name in ("torch", "triton"):
        with backend(name):
            results.append(run())
    return results


HOOKS = [("hierarchical_int8", "int8", {"hierarchical": True, "node_size": 1}),
         ("loco_sign", "sign", {"loco_beta": 0.8}),
         ("int4_loco", "int4", {"loco_beta": 0.8})]


@pytest.mark.parametrize("label, method, options", HOOKS, ids=[h[0] for h in HOOKS])
def test_hook_variants_train_like_the_torch_backend(nccl_group, label, method, options):
    (reference, _), (params, stats) = on_both_backends(
        lambda: train_ddp(lambda model: gradcomp.hooks.register(model, method, **options)))
    assert torch.isfinite(reference).all()
    assert_close(params, reference, RTOL)
    assert stats["raw_bytes"] > stats["wire_bytes"], stats  # one node: no inter-node bytes


def test_auto_hook_trains(nccl_group):
    params, stats = train_ddp(lambda model: gradcomp.hooks.register(model, "auto"), steps=8)
    assert torch.isfinite(params).all()
    assert stats["steps"] == 8 and stats["wire_bytes"] > 0, stats


OPTIMIZERS = [
    ("zeroone", lambda model: gradcomp.optim.ZeroOneAdam(model.module.parameters(), model, lr=1e-3)),
    ("dgc", lambda model: gradcomp.optim.DGC(model.module.parameters(), model, lr=0.05)),
    ("diloco_sign", lambda model: gradcomp.optim.DiLoCo(
        model.module.parameters(), model, torch.optim.AdamW, dict(lr=1e-3), sync_every=2,
        method="sign")),
    ("diloco_topk", lambda model: gradcomp.optim.DiLoCo(
        model.module.parameters(), model, torch.optim.AdamW, dict(lr=1e-3), sync_every=2,
        method="topk", method_options=dict(ratio=0.05))),
]


@pytest.mark.parametrize("label, make", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_optimizers_train_like_the_torch_backend(nccl_group, label, make):
    def run():
        return train_ddp(lambda model: gradcomp.optim.local_gradients(model), make)

    (reference, _), (params, stats) = on_both_backends(run)
    assert torch.isfinite(reference).all()
    assert_close(params, reference, RTOL)
    assert stats["wire_bytes"] > 0, stats


# ---- offsets past 2^31 -------------------------------------------------------------------------

HUGE = (1 << 31) + 4099
"""Elements (8.6 GB of fp32): the last blocks sit past 2^31, where an int32 offset wraps."""
TAIL = 1 << 20


@pytest.fixture(scope="module")
def huge_gradient():
    if torch.cuda.get_device_properties(0).total_memory < 60 * 2**30:
        pytest.skip("needs 60 GiB of GPU memory")
    x = torch.empty(HUGE, device="cuda")
    x.normal_(generator=torch.Generator("cuda").manual_seed(5))
    yield x
    del x
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name, options", [("int8", {}), ("int4", {}), ("fp16", {"scale": 0.5}),
                                           ("sign", {})])
def test_compress_past_two_to_the_31(huge_gradient, name, options):
    """The kernels' payload and decode of the last TAIL elements equal the torch path's."""
    decoded = {}
    for path in ("torch", "triton"):
        with backend(path):
            payload = gradcomp.compress(huge_gradient, name, **options)
            parts = {key: part[-TAIL // 8:].clone() for key, part in payload.parts.items()}
            decoded[path] = (gradcomp.decompress(payload)[-TAIL:].clone(), parts)
            del payload
        torch.cuda.empty_cache()
    (want, want_parts), (got, got_parts) = decoded["torch"], decoded["triton"]
    for key in want_parts:
        if name == "sign" and key != "bits":
            assert_close(got_parts[key].float(), want_parts[key].float(), 1e-5)
        else:
            assert_same_bits(got_parts[key], want_parts[key])
    if name == "sign":
        assert torch.equal(got.sign(), want.sign())
        assert_close(got, want, 1e-5)
    else:
        assert_same_bits(got, want)
