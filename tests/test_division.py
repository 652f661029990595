"""Finding 4 of issue 20: one division definition per method, the same on every device.

torch on CUDA computes ``tensor / python_number`` as a multiply by the number's fp32 reciprocal;
on the CPU it divides. The kernels divide correctly rounded (``tl.math.div_rn``). So the torch
paths define every division as one correctly rounded division (``methods.base.divided``: the
divisor as a tensor on the data's device), and int8/int4's L / amax as fl(fl(1 / amax) * L).

These CPU tests run each torch path under :class:`CudaScalarDivision`, which divides by a Python
number the way CUDA does, and compare with the definition computed in float64: a float64 quotient
of two fp32 values, rounded to fp32, is the correctly rounded fp32 quotient (53 >= 2 * 24 + 2
bits, so the double rounding is innocuous). A torch path that divides by a Python number again
fails here, as it would differ on a GPU.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import gradcomp
from gradcomp.methods.base import forced_backend

aten = torch.ops.aten
_DIVISIONS = {aten.div.Tensor: aten.mul.Tensor, aten.div_.Tensor: aten.mul_.Tensor}


class CudaScalarDivision(TorchDispatchMode):
    """Inside the block, ``float_tensor / python_number`` is computed as torch does on CUDA:
    ``t * fl(1 / fl(number))`` in the tensor's dtype. ``divisions`` counts them."""

    def __init__(self):
        super().__init__()
        self.divisions = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func in _DIVISIONS and not kwargs and isinstance(args[1], (int, float))
                and args[0].is_floating_point()):
            self.divisions += 1
            dtype = args[0].dtype
            inverse = torch.tensor(1.0, dtype=dtype) / torch.tensor(float(args[1]), dtype=dtype)
            return _DIVISIONS[func](args[0], inverse)
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def eager_torch_path(monkeypatch):
    """The torch backend, eager (the dispatch mode sees every operator)."""
    monkeypatch.setenv("GRADCOMP_CPU_COMPILE", "0")
    with forced_backend("torch"):
        yield


def gradient(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.rand(n, generator=gen).exp2()


def correctly_rounded(a: torch.Tensor, b) -> torch.Tensor:
    """fp32 a / b rounded once (b an fp32 value or tensor)."""
    b = b.double() if isinstance(b, torch.Tensor) else float(torch.tensor(b, dtype=torch.float32))
    return (a.double() / b).float()


def test_the_emulation_differs_from_division():
    """CUDA's reciprocal multiply differs from a division for some quotients (so the tests below
    can fail)."""
    x = gradient(4096, 0)
    with CudaScalarDivision() as mode:
        emulated = x / 127
    assert mode.divisions == 1
    assert (emulated != correctly_rounded(x, 127.0)).sum() > 100


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), name=st.sampled_from(["int8", "int4"]),
       block=st.sampled_from([64, 100, 256]))
def test_quant_scales_and_codes_are_the_definition(seed, name, block):
    n = block * 97 + 3
    x = gradient(n, seed)
    method = gradcomp.get_method(name, block=block)
    levels = 127 if name == "int8" else 7
    with CudaScalarDivision():
        payload = method.compress(x)
    blocks = torch.nn.functional.pad(x, (0, -n % block)).view(-1, block)
    amax = blocks.abs().amax(dim=1)
    assert torch.equal(payload.parts["scales"], correctly_rounded(amax, float(levels)))
    inverse = (correctly_rounded(torch.ones_like(amax), amax).double() * levels).float()
    t = (blocks.double() * inverse.double()[:, None]).float()
    expected = torch.round(t).flatten()[:n]
    with CudaScalarDivision():
        decoded = method.decompress(payload)
    steps = decoded.view(-1)
    scales = payload.parts["scales"].repeat_interleave(block)[:n]
    assert torch.equal(steps, expected * scales)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), name=st.sampled_from(["fp16", "bf16"]),
       scale=st.sampled_from([1 / 3, 0.3, 1 / 6, 1 / 24]))
def test_cast_decode_is_the_definition(seed, name, scale):
    x = gradient(4099, seed)
    method = gradcomp.get_method(name, scale=scale)
    with CudaScalarDivision():
        payload = method.compress(x)
        decoded = method.decompress(payload)
    assert torch.equal(decoded, correctly_rounded(payload.parts["values"].float(), scale))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), chunk=st.sampled_from([96, 1000, 1024]))
def test_sign_scales_are_the_definition(seed, chunk):
    n = chunk * 50
    x = gradient(n, seed)
    method = gradcomp.get_method("sign", chunk=chunk)
    with CudaScalarDivision():
        payload = method.compress(x)
    sums = x.view(-1, chunk).abs().sum(dim=1)
    assert torch.equal(payload.parts["scales"], correctly_rounded(sums, float(chunk)))
