"""Helpers for the kernel tests: running a test module under the Triton interpreter, the torch
reference path, gradients with special values, and NaN-aware bit comparisons.

Triton reads TRITON_INTERPRET when it is imported, and the main test process imports it
without (the ahead-of-time compile tests need the real JIT). So the interpreted tests live in
tests/interpreted/ and run in a subprocess with TRITON_INTERPRET=1 (tests/test_kernels_interpreted.py
starts one per module); run them directly with `TRITON_INTERPRET=1 pytest tests/interpreted`.
"""
from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import torch

from gradcomp import Payload
from gradcomp.methods.base import forced_backend

INTERPRETED_DIR = Path(__file__).parent / "interpreted"
REPO = Path(__file__).parent.parent


def run_interpreted(modules: list[Path], timeout: float = 900) -> subprocess.CompletedProcess:
    """Run interpreted test modules with one pytest in a fresh process (TRITON_INTERPRET=1)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "GRADCOMP_CPU_COMPILE": "0",
           "TRITON_DEFAULT_FP_FUSION": "0"}
    env.pop("GRADCOMP_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--disable-warnings", *map(str, modules)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


backend = forced_backend
"""GRADCOMP_BACKEND=name inside the block (restored after)."""


@contextlib.contextmanager
def counted_launches():
    """Count gradcomp's Triton kernel launches by kernel name inside the block (a Counter)."""
    from gradcomp.kernels import common

    launches = collections.Counter()
    original = common.SerializedLaunch.__getitem__

    def counted(self, grid):
        launches[self.fn.__name__] += 1
        return original(self, grid)

    common.SerializedLaunch.__getitem__ = counted
    try:
        yield launches
    finally:
        common.SerializedLaunch.__getitem__ = original

HOOK_CONFIGS = [
    ("allreduce", "none", {}, True),
    ("fp16", "fp16", {}, True),
    ("bf16", "bf16", {}, True),
    ("int8", "int8", {}, True),
    ("int8_twophase", "int8", {"scheme": "twophase"}, True),
    ("int4", "int4", {}, True),
    ("sign", "sign", {}, False),
    ("sign_twophase", "sign", {"scheme": "twophase", "chunk": 64}, False),
    ("topk", "topk", {"ratio": 0.05}, True),
]
"""(label, method, options, bit-exact) of every element-wise hook, for the tests that compare
the kernels with the torch path: sign's scales sum |v| in another order than torch (a few ulps,
docs/kernels.md), everything else is bit-exact; stochastic int8 rounding draws other random
numbers in the kernel, so the two-phase int8 case rounds to nearest."""


def gradient(n: int, seed: int, dtype=torch.float32, specials: bool = False,
             scale: float = 1.0) -> torch.Tensor:
    """A seeded N(0, scale^2) gradient [n]; with ``specials`` also NaN, +-inf, zeros and values
    beyond fp16's range at seeded positions (at most one of each per 64 elements)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * scale
    if specials and n:
        count = max(1, n // 64)
        for value in (float("nan"), float("inf"), -float("inf"), 0.0, 1e6, -3e38):
            x[torch.randint(n, (count,), generator=gen)] = value
    return x.to(dtype)


def residual_like(n: int, seed: int) -> torch.Tensor:
    """A seeded finite fp32 residual [n] (what error feedback carries between steps)."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed + 7919)) * 0.1


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a tensor as a signed integer tensor of the same itemsize."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-for-bit equality, except that NaN payloads may differ (NaN must match NaN)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        f"{actual.dtype}{list(actual.shape)} vs {expected.dtype}{list(expected.shape)}"
    if actual.is_floating_point():
        nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
        assert torch.equal(nan_a, nan_e), f"NaN at {torch.nonzero(nan_a != nan_e)[:5].tolist()}"
        actual, expected = actual.masked_fill(nan_a, 0), expected.masked_fill(nan_e, 0)
    differ = bits(actual) != bits(expected)
    assert not differ.any(), (f"{int(differ.sum())} of {differ.numel()} differ, first at "
                              f"{torch.nonzero(differ)[:3].flatten().tolist()}: "
                              f"{actual[differ][:3].tolist()} vs {expected[differ][:3].tolist()}")


def interpreter_blocked() -> str:
    """Why the Triton interpreter cannot run the kernels with these package versions ("" when it
    can): triton 3.6's interpreter turns a scalar kernel argument used as a loop bound into an int
    with ``int()`` of a 1-element array, which numpy >= 2.4 rejects (triton 3.9 squeezes it)."""
    import numpy
    import triton

    def version(module):
        return tuple(int(part) for part in module.__version__.split(".")[:2])

    if version(triton) < (3, 7) and version(numpy) >= (2, 4):
        return (f"triton {triton.__version__}'s interpreter needs numpy < 2.4 (numpy "
                f"{numpy.__version__} is installed): pip install 'numpy<2.4'")
    return ""


_PATCH_BUILTIN_SOURCE = """def _patch_builtin(pkg, builder, scope: _LangPatchScope):
    for name, member in inspect.getmembers(pkg):
        if tl.core.is_builtin(member):
            _patch_attr(pkg, name, member, builder, scope)
"""
"""Triton 3.x's interpreter: what speed_up_interpreter replaces, checked word for word."""


def speed_up_interpreter() -> None:
    """Under TRITON_INTERPRET=1, Triton's interpreter patches triton.language's builtins at every
    kernel launch and again at every call of a @triton.jit helper inside a kernel, each time
    scanning every member of triton.language, its tensor class and math module with
    inspect.getmembers (a quarter of an interpreted DDP step's seconds). Here the scan is done
    once, in this untouched state, and each later patch looks only at the names that were
    builtins then, patching those that still are: the same patches, in the same order (a
    patched member is the interpreter's lambda, not a builtin, and restoring puts the original
    builtin back; nothing else sets a builtin on these). Left alone if the interpreter's code is
    not the one this was written against. Called in the interpreted test processes
    (tests/interpreted/conftest.py) and in every rank they launch (dist_utils._enter)."""
    if not interpreter_active():
        return
    import inspect

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_builtin", None)
    if original is None or getattr(original, "_builtin_names", None) is not None:
        return  # another Triton, or already done in this process
    try:
        if inspect.getsource(original) != _PATCH_BUILTIN_SOURCE:
            return
    except (OSError, TypeError):
        return
    is_builtin, patch_attr = interpreter.tl.core.is_builtin, interpreter._patch_attr
    builtin_names: dict = {}  # id(package) -> (package, its builtins' names, sorted as getmembers)

    def names_of(pkg) -> list:
        known = builtin_names.get(id(pkg))
        if known is None:
            known = builtin_names[id(pkg)] = (pkg, [name for name, member in inspect.getmembers(pkg)
                                                    if is_builtin(member)])
        return known[1]

    def _patch_builtin(pkg, builder, scope):
        for name in names_of(pkg):
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    _patch_builtin._builtin_names = builtin_names
    tl = interpreter.tl  # the packages _patch_lang scans, read now, while nothing is patched
    for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        names_of(pkg)
    interpreter._patch_builtin = _patch_builtin


def interpreter_active() -> bool:
    """True in a process started with TRITON_INTERPRET=1 (Triton reads it at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0", "false")


def decode_order_sum(method, decoded: list, start: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 sum that ``method.decode_sum`` makes of these fp32 decodes (one per row):
    ``start`` (or the first group's sum) plus each group of ``method.decode_group`` decodes,
    summed in row order, in group order (``decode_group`` 1: plain row order)."""
    total = start
    for first in range(0, len(decoded), method.decode_group):
        group = decoded[first]
        for d in decoded[first + 1:first + method.decode_group]:
            group = group + d
        total = group if total is None else total + group
    return total


def rank_payloads(method, gradients) -> tuple[list, torch.Tensor, dict]:
    """Every rank's payload of its gradient on the torch path, the fp32 sum of their decodes in
    the method's order (:func:`decode_order_sum`: what a multi-rank decode kernel must give), and
    each part stacked [world, ...]."""
    with backend("torch"):
        payloads = [method.compress(g) for g in gradients]
        decoded = [method.decompress(p).float() for p in payloads]
    total = decode_order_sum(method, decoded)
    stacked = {name: torch.stack([p.parts[name] for p in payloads]) for name in payloads[0].parts}
    return payloads, total, stacked


PRESCALES = [1.0, 0.5, 1 / 3, 1 / 7, 0.125]
"""``Method.compress`` scales the property tests draw: exact, halving, and three that round."""


def compressed_scaled_on_each_path(method, x: torch.Tensor, seed: int, prescale: float,
                                   feedback: bool, parts: tuple[str, ...]) -> dict:
    """On the torch path and the kernels' in turn: compress(x, residual, scale=prescale) equals
    compress(x.float() * prescale, residual) in ``parts`` and the updated residual, bit for bit
    (asserted); the scaled payloads by path, for the caller to compare the paths."""
    payloads = {}
    for path in ("torch", "triton"):
        residual = residual_like(x.numel(), seed) if feedback else None
        expected_residual = residual.clone() if feedback else None
        with backend(path):
            payloads[path] = method.compress(x, residual, scale=prescale)
            expected = method.compress(x.float() * prescale, expected_residual)
        for part in parts:
            assert_same_bits(payloads[path].parts[part], expected.parts[part])
        if feedback:
            assert_same_bits(residual, expected_residual)
    return payloads


ADDEND_SCALES = [1.0, 0.5, 1 / 3]
"""``Method.decode_sum`` addend scales the property tests draw: exact, halving, one that rounds."""
ADDEND_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def decoded_with_addend_on_each_path(method, gradients: list, addend: torch.Tensor,
                                     addend_scale: float, out_dtype=torch.float32,
                                     kernel=None) -> torch.Tensor:
    """Method.decode_sum(rows of the gradients' torch-path payloads, addend=, addend_scale=) on
    the torch path and on the kernels: each equal, bit for bit, to fp32(addend) * fp32(scale)
    (the product rounded once; the addend as it is for scale 1) plus every row's fp32 decode in
    the method's order (:func:`decode_order_sum`), cast to ``out_dtype`` (asserted; 0 gradients:
    the scaled addend). ``kernel``:
    also the decode kernel's launcher, called as kernel(stacked parts, out, addend, scale)
    (reached with 0 rows too, which Method.decode_sum answers without a launch). Returns the
    expected result."""
    n = addend.numel()
    with backend("torch"):
        template = method.compress(torch.zeros(n))
        payloads = [method.compress(g) for g in gradients]
        decoded = [method.decompress(p, torch.empty(n)) for p in payloads]
    if payloads:
        rows = Payload.stack(payloads)
    else:
        rows = Payload(template.method, template.shape, template.dtype,
                       {k: v.unsqueeze(0)[:0] for k, v in template.parts.items()},
                       template.options, 0)
    expected = decode_order_sum(
        method, decoded, addend.float() * addend_scale if addend_scale != 1 else addend.float())
    expected = expected.to(out_dtype)
    for path in ("torch", "triton"):
        with backend(path):
            got = method.decode_sum(rows, torch.empty(n, dtype=out_dtype), addend, addend_scale)
        assert_same_bits(got, expected)
    if kernel is not None:
        out = torch.empty(n, dtype=out_dtype)
        assert kernel(rows.parts, out, addend, addend_scale) is not None
        assert_same_bits(out, expected)
    return expected


SPECIAL_SCALES = torch.tensor([1.0, -0.5, 0.0, -0.0, float("inf"), -float("inf"), float("nan"),
                               3e38, 1e-45])
"""Scales a peer may send: finite, negative, signed zeros, infinite, NaN, huge, subnormal."""


def assert_special_rows_decode_as_on_torch(method, n: int, unit: int, parts: dict) -> None:
    """``parts`` (the payload's parts but ``scales``, stacked as [world, ...] rows) with one of
    SPECIAL_SCALES per ``unit`` elements (block or chunk) of every row, decode-summed on both
    paths: bit for bit the same, and the sum holds both NaNs and finite values."""
    world = next(iter(parts.values())).shape[0]
    picks = torch.arange(world * (n // unit)).reshape(world, -1) % len(SPECIAL_SCALES)
    with backend("torch"):
        template = method.compress(torch.zeros(n))
    rows = Payload(template.method, template.shape, template.dtype,
                   {**parts, "scales": SPECIAL_SCALES[picks]}, template.options, world)
    decoded = {}
    for path in ("torch", "triton"):
        with backend(path):
            decoded[path] = method.decode_sum(rows, torch.empty(n))
    assert_same_bits(decoded["triton"], decoded["torch"])
    assert decoded["torch"].isnan().any() and decoded["torch"].isfinite().any()


def int4_codes(packed: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """A payload's packed int4 codes, uint8 [ceil(n / 2)] -> int32 [n] in [-8, 7], block by block
    (each block's halves paired, as gradcomp.methods.quant.pack_int4 lays them out)."""
    from gradcomp.methods.quant import unpack_int4

    full = n // block
    head = unpack_int4(packed[:full * block // 2].view(full, block // 2), block).reshape(-1)
    return torch.cat([head, unpack_int4(packed[full * block // 2:], n - full * block)])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """|actual - expected| <= rtol * max |expected| (NaN where expected is NaN)."""
    assert torch.equal(torch.isnan(actual), torch.isnan(expected))
    finite = torch.isfinite(expected)
    assert torch.equal(actual[~finite].nan_to_num(), expected[~finite].nan_to_num())
    scale = expected[finite].abs().max().item() if finite.any() else 0.0
    error = (actual[finite] - expected[finite]).abs().max().item() if finite.any() else 0.0
    assert error <= rtol * max(scale, 1e-30), f"max error {error} vs scale {scale}"


def nccl_group_on_cuda0():
    """A world-size-1 NCCL process group on 127.0.0.1 and GPU 0 (the default group until the
    generator resumes): the body of the CUDA modules' module-scoped ``nccl_group`` fixture."""
    import socket

    import pytest
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()
