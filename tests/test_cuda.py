"""The Triton kernels and the DDP hooks on a real GPU: `pytest -m cuda` (skipped without CUDA).

- Every kernel against the torch path on the same CUDA tensors: bit for bit where
  docs/kernels.md says so (fp16, bf16, int8, int4, top-k, and every decode-sum but top-k's
  atomics), to a stated tolerance otherwise (sign's scales, PowerSGD's sums, top-k's atomics).
  Bit for bit holds because both paths divide correctly rounded (torch divides by a Python
  number as a reciprocal multiply on CUDA; the torch paths divide by a device tensor instead):
  the scales are checked against that definition computed in float64 on the CPU.
- Every hook on a 1-rank NCCL group (tcp on 127.0.0.1) trains to the torch backend's
  parameters, with sane statistics.
- No host sync inside a hook after its first call (torch.cuda.set_sync_debug_mode("error")).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from kernel_utils import HOOK_CONFIGS as ELEMENTWISE_HOOKS
from kernel_utils import (assert_close, assert_same_bits, backend, gradient, nccl_group_on_cuda0,
                          rank_payloads, residual_like)

import gradcomp
from gradcomp.kernels.common import interpreting

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET=1 runs kernels on the CPU"),
]

SIZES = [4099, (1 << 20) + 3]
EXACT = [("fp16", {}), ("fp16", {"scale": 0.3}), ("bf16", {"scale": 0.125}), ("int8", {}),
         ("int8", {"block": 100}),
         ("int4", {"block": 64}), ("topk", {"ratio": 0.01}),
         ("topk", {"ratio": 0.01, "selector": "threshold", "sample": 4096})]
SIGN = [("sign", {}), ("sign", {"chunk": 96})]
SIGN_RTOL = 1e-5
"""sign: scales sum |v| in another order than torch (a few ulps, docs/kernels.md)."""
POWERSGD_RTOL = 2e-5
"""PowerSGD: P, Q and the residual to this fraction of their largest entry (sums in other orders)."""


def case_id(name: str, options: dict) -> str:
    return "-".join([name] + [f"{key}{value}" for key, value in options.items()])


def cuda_gradient(n: int, seed: int, specials: bool = False) -> torch.Tensor:
    return gradient(n, seed, specials=specials).cuda()


def ef_steps(name: str, options: dict, n: int, backend_name: str, steps: int = 2):
    """Decoded tensors of ``steps`` error-feedback steps (the second with NaN/inf/huge values, but
    none for top-k, whose ties would make the chosen set ambiguous), the final residual and the
    payloads' sizes, on one backend, all on the GPU."""
    ef, decoded, sizes = gradcomp.ErrorFeedback(), [], []
    with backend(backend_name):
        for step in range(steps):
            g = cuda_gradient(n, 100 + step, specials=step == 1 and name != "topk")
            payload = ef.compress("w", g, name, **options)
            sizes.append(payload.nbytes)
            decoded.append(gradcomp.decompress(payload))
    return decoded, ef.residual("w").clone(), sizes


# ---- kernels against the torch path ------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name, options", EXACT, ids=[case_id(*case) for case in EXACT])
def test_encode_and_decode_bit_for_bit(name, options, n):
    expected, expected_residual, expected_sizes = ef_steps(name, options, n, "torch")
    decoded, residual, sizes = ef_steps(name, options, n, "triton")
    for got, want in zip(decoded, expected):
        assert_same_bits(got, want)
    assert_same_bits(residual, expected_residual)
    assert sizes == expected_sizes


@pytest.mark.parametrize("name, levels", [("int8", 127), ("int4", 7)])
def test_quant_scales_are_correctly_rounded_divisions(name, levels):
    """scale = amax / L rounded once, on both paths (finding 4 of issue 20: torch's
    ``tensor / number`` is a reciprocal multiply on CUDA and rounds some scales differently)."""
    n, block = (1 << 20) + 3, 256
    x = gradient(n, 3).cuda()
    blocks = torch.nn.functional.pad(x.cpu(), (0, -n % block)).view(-1, block)
    expected = (blocks.abs().amax(dim=1).double() / levels).float()
    for path in ("torch", "triton"):
        with backend(path):
            scales = gradcomp.get_method(name, block=block).compress(x).parts["scales"]
        assert torch.equal(scales.cpu(), expected), path


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name, options", SIGN, ids=[case_id(*case) for case in SIGN])
def test_sign_to_summation_order(name, options, n):
    expected, expected_residual, _ = ef_steps(name, options, n, "torch")
    decoded, residual, _ = ef_steps(name, options, n, "triton")
    for got, want in zip(decoded, expected):
        assert torch.equal(got.sign(), want.sign())  # the bits are exact
        assert_close(got, want, SIGN_RTOL)
    assert_close(residual, expected_residual, SIGN_RTOL)


@pytest.mark.parametrize("shape", [(96, 700), (1024, 1030)], ids=str)
def test_powersgd_step_to_summation_order(shape):
    method = gradcomp.get_method("powersgd", rank=4, seed=3)
    n, m = shape
    x = cuda_gradient(n * m, 11).view(shape)
    residual = residual_like(n * m, 11).cuda()
    expected_residual = residual.clone()
    with backend("torch"):
        expected = method.compress(x, expected_residual, {})
    with backend("triton"):
        got = method.compress(x, residual, {})
    assert_close(got.parts["p"], expected.parts["p"], POWERSGD_RTOL)
    assert_close(got.parts["q"], expected.parts["q"], POWERSGD_RTOL)
    assert_close(residual, expected_residual, POWERSGD_RTOL)


DECODERS = [("fp16", {"scale": 0.5}), ("bf16", {}), ("int8", {}), ("int4", {"block": 64}),
            ("sign", {}), ("topk", {"ratio": 0.05})]


@pytest.mark.parametrize("name, options", DECODERS, ids=[case_id(*case) for case in DECODERS])
def test_decode_sum_of_three_ranks(name, options):
    """The multi-rank decoders against the rank-ordered fp32 sum of the torch decodes: exact,
    except top-k's atomics (fp32 sums at a shared index in another order)."""
    from gradcomp.kernels import cast, quant, sign, topk

    n = (1 << 20) + 3
    method = gradcomp.get_method(name, **options)
    _, expected, parts = rank_payloads(
        method, [cuda_gradient(n, 40 + w, specials=w == 1 and name != "topk") for w in range(3)])
    if name in ("fp16", "bf16"):
        got = cast.cast_decode_sum(parts["values"], method.scale)
    elif name in ("int8", "int4"):
        got = quant.dequantize_sum(parts["q"], parts["scales"], n, method.block)
    elif name == "sign":
        got = sign.sign_decode_sum(parts["bits"], parts["scales"], n, method.chunk)
    else:
        got = topk.scatter_add_sum(parts["values"], parts["indices"].int(), n)
        assert_close(got, expected, 1e-6)
        return
    assert_same_bits(got, expected)


@pytest.mark.parametrize("world", [9, 64])
def test_sign_decode_sum_of_many_ranks_sums_groups_of_four(world):
    """The sign kernel's sums of each group of 4 ranks' signed scales, then of the groups against kernel_utils.decode_order_sum of the torch decodes, bit for bit: 9 ranks
    leave a group of 1, 64 are the roofline's row; rank 1 holds NaN/inf/huge values."""
    from gradcomp.kernels import sign

    n = (1 << 20) + 3
    method = gradcomp.get_method("sign")
    _, expected, parts = rank_payloads(
        method, [cuda_gradient(n, 60 + w, specials=w == 1) for w in range(world)])
    assert_same_bits(sign.sign_decode_sum(parts["bits"], parts["scales"], n, method.chunk), expected)


# ---- hooks on a 1-rank NCCL group --------------------------------------------------------------

HOOK_CONFIGS = [*ELEMENTWISE_HOOKS, ("powersgd", "powersgd", {"matrix_rank": 4}, False)]
HOOK_RTOL = 1e-4
"""Parameters after training, sign and PowerSGD hooks: relative to the largest parameter."""
STEPS = 3
BUCKET_CAP_MB = 0.004


nccl_group = pytest.fixture(scope="module")(nccl_group_on_cuda0)
"""A world-size-1 NCCL process group on 127.0.0.1 (the default group while the module runs)."""


def small_net() -> nn.Module:
    """Four linear layers: three buckets at BUCKET_CAP_MB once DDP has rebuilt its buckets
    after the first step ({fc4, fc3}, fc2, fc1)."""
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def ddp_model(method: str, options: dict):
    torch.manual_seed(0)
    model = DDP(small_net().cuda(), device_ids=[0], bucket_cap_mb=BUCKET_CAP_MB)
    return model, gradcomp.hooks.register(model, method, **options)


def train(model, steps: int, on_backward=None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(32, 32, generator=gen).cuda()
        y = torch.randint(10, (32,), generator=gen).cuda()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        if on_backward is not None and step == steps - 1:
            with on_backward():
                loss.backward()
        else:
            loss.backward()
        optimizer.step()
    torch.cuda.synchronize()


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("label, method, options, exact", HOOK_CONFIGS,
                         ids=[c[0] for c in HOOK_CONFIGS])
def test_hook_gives_the_torch_backend_result(nccl_group, label, method, options, exact):
    results = {}
    for backend_name in ("torch", "triton"):
        with backend(backend_name):
            model, state = ddp_model(method, options)
            train(model, STEPS)
        results[backend_name] = flat_params(model), state.stats()
    (reference, _), (params, stats) = results["torch"], results["triton"]
    if exact:
        assert_same_bits(params, reference)
    else:
        assert_close(params, reference, HOOK_RTOL)
    assert stats["steps"] == STEPS and stats["buckets"] >= 3 * (STEPS - 1), stats
    assert stats["wire_bytes"] > 0 and stats["raw_bytes"] > 0
    assert all(stats[key] >= 0 for key in ("compress_s", "decompress_s", "comm_s"))
    minimum_ratio = {"fp16": 1.99, "bf16": 1.99, "int8": 3.5, "int8_twophase": 1.7,
                     "sign": 20, "sign_twophase": 8, "topk": 5, "powersgd": 1.5}.get(label, 1.0)
    assert stats["raw_bytes"] / stats["wire_bytes"] >= minimum_ratio * 0.99, stats


@pytest.mark.parametrize("label, method, options, exact", HOOK_CONFIGS,
                         ids=[c[0] for c in HOOK_CONFIGS])
def test_hook_has_no_host_sync_after_the_first_step(nccl_group, label, method, options, exact):
    """The backward of a warm step runs every hook call with CUDA sync debugging set to "error".
    Warm: the first step checked the configs across ranks, the second (after DDP's bucket
    rebuild) compiled and autotuned the kernels for the final bucket sizes."""

    class SyncsAreErrors:
        def __enter__(self):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc):
            torch.cuda.set_sync_debug_mode("default")

    model, _ = ddp_model(method, options)
    train(model, 3, on_backward=SyncsAreErrors)
