"""Every DDP hook on 2 Gloo ranks with several buckets trains to the same parameters with
GRADCOMP_BACKEND=triton (the kernels under the interpreter) as with GRADCOMP_BACKEND=torch.

With several buckets the hook compresses bucket i + 1 on the autograd thread while a Gloo
callback thread decodes bucket i, so kernels are launched from two threads at once: this is the
end-to-end check of kernels.common.LAUNCH_LOCK (without it the interpreter fails with "Did you
forget to add @triton.jit?"). The ranks inherit TRITON_INTERPRET=1 from this process.
"""
import os
import threading

import pytest
import torch
import triton
from ddp_models import build_model, flat_params, make_ddp, train_steps
from dist_utils import run_ranks
from kernel_utils import HOOK_CONFIGS, assert_same_bits, gradient

import gradcomp
from gradcomp.hooks import register
from gradcomp.kernels import cast, quant

SIGN_TOLERANCE = 1e-5
"""Largest parameter difference allowed for sign after 3 steps (parameters are ~0.1-1)."""
STEPS = 3
BUCKET_CAP_MB = 0.001
"""Three buckets of MixedNet (fc2, fc1, then conv and norm) once DDP has rebuilt its buckets
after the first step (one bucket there)."""


def _train_every_hook(rank, world):
    """Per hook, on both backends: (parameters after STEPS steps, bucket calls)."""
    os.environ["GRADCOMP_CPU_COMPILE"] = "0"
    out = {}
    for backend_name in ("torch", "triton"):
        os.environ["GRADCOMP_BACKEND"] = backend_name
        for label, method, options, _ in HOOK_CONFIGS:
            ddp = make_ddp(build_model(), bucket_cap_mb=BUCKET_CAP_MB)
            state = register(ddp, method, **options)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            train_steps(ddp, optimizer, STEPS, rank)
            out[backend_name, label] = (flat_params(ddp.module), state.stats()["buckets"])
    return out


def test_configs_cover_every_element_wise_method():
    """HOOK_CONFIGS picks options per method; it still names every registered method compressed
    as the flat bucket (PowerSGD, tensor by tensor, has its own hook tests)."""
    flat = {m for m in gradcomp.METHODS if not gradcomp.get_method(m).per_tensor}
    assert {method for _, method, _, _ in HOOK_CONFIGS} - {"none"} == flat


def test_every_hook_gives_the_torch_backend_parameters():
    results = run_ranks(_train_every_hook, 2, timeout_s=300)
    for label, _, _, exact in HOOK_CONFIGS:
        reference, buckets = results[0]["torch", label]
        params, triton_buckets = results[0]["triton", label]
        assert buckets == triton_buckets >= 1 + 3 * (STEPS - 1), f"{label}: {buckets} buckets"
        assert torch.equal(params, results[1]["triton", label][0]), f"{label}: replicas differ"
        if exact:
            assert_same_bits(params, reference)
        else:
            assert (params - reference).abs().max() <= SIGN_TOLERANCE, label


def _launch_from_threads(launch, threads: int = 2):
    """Run ``launch(seed)`` on several threads at once; re-raise the first error."""
    errors = []

    def run(seed):
        try:
            launch(seed)
        except Exception as exc:  # reported below, on the test's thread
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(seed,)) for seed in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("kernel", ["ef_cast", "dequantize_sum"])
def test_kernels_launched_from_two_threads_at_once(kernel):
    """The minimal reproduction: two threads each launch a multi-program kernel several times;
    every result is right (no InterpreterError, no program id taken from the other thread)."""
    n = 4 * cast.CPU_CONFIG.kwargs["BLOCK"] + 5

    def ef_cast(seed):
        x = gradient(n, seed)
        for _ in range(3):
            assert_same_bits(cast.ef_cast(x, None, 1.0, torch.float16), x.half())

    def dequantize_sum(seed):
        codes = torch.randint(-127, 128, (1, n), dtype=torch.int8,
                              generator=torch.Generator().manual_seed(seed))
        scales = torch.ones(1, triton.cdiv(n, 256))
        for _ in range(3):
            assert_same_bits(quant.dequantize_sum(codes, scales, n, 256), codes[0].float())

    _launch_from_threads({"ef_cast": ef_cast, "dequantize_sum": dequantize_sum}[kernel])
