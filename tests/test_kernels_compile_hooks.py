"""The decode-sum launches the fronts make on a received buffer, compiled ahead of time for sm_90
with the offsets and row strides that buffer really has for a 100M-element payload, read with
wide loads (no byte-load fallback).

A gathered or all-to-all buffer is uint8[p, row bytes] in the wire layout (gradcomp/payload.py):
every row and every part starts on a 16-byte boundary, so Triton's JIT marks the part pointers
and the codes' row stride 16-divisible, as the shipped compile cases (and bench_gpu's aligned
rows) assume. The launches are recorded, not run: the real front code (``Payload.unflatten``,
the scheme's decode, ``Method.decode_sum``, the kernel's launcher) runs on meta tensors with the
kernel replaced by a recorder; each recorded argument is marked 16-divisible exactly when the
JIT would (an int divisible by 16; a tensor whose byte offset in its 16-byte aligned allocation
is). A control lays the same payloads end to end, as before the padding: byte loads come back.
"""
import dataclasses
import re

import pytest
import torch

triton = pytest.importorskip("triton")

from gradcomp import comm, fsdp, get_method  # noqa: E402
from gradcomp.kernels import common, quant, sign  # noqa: E402
from gradcomp.kernels.aot import compile_case, sass  # noqa: E402
from gradcomp.kernels.common import interpreting, jit_function  # noqa: E402
from gradcomp.payload import Payload  # noqa: E402
from gradcomp.schemes import SCHEMES  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(interpreting(), reason="ahead-of-time compilation needs the JIT")]

N = 100_000_000
"""Elements of the payload (a 100M-element bucket; sign 12,890,628 bytes, int4 51,562,500 end
to end: both 4 mod 16)."""
WORLD = 64
KERNELS = {"int8": (quant, "dequantize_sum_kernel"), "int4": (quant, "dequantize_sum_kernel"),
           "sign": (sign, "sign_decode_sum_kernel")}
BYTE_LOADS_PTX = re.compile(r"ld\.global(\.\w+)*\.[bsu]8\b")
BYTE_LOADS_SASS = re.compile(r"\bLDG\.E\.(U8|S8)\b")


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def template(name: str, n: int) -> Payload:
    """A meta-device payload of an fp32 tensor of n elements, parts as the method lays them out."""
    method = get_method(name)
    parts = {part: torch.empty(shape, dtype=dtype, device="meta")
             for part, (dtype, shape) in method.parts_layout((n,), torch.float32).items()}
    return Payload(name, torch.Size([n]), torch.float32, parts, method.options())


def end_to_end(local: Payload, rows: int) -> Payload:
    """The control: ``rows`` payloads laid out as before the wire-layout padding, parts end to
    end in rows of exactly their bytes, viewed as the unflatten then did."""
    sizes = [t.numel() * t.element_size() for t in local.parts.values()]
    buffer = torch.empty(rows, sum(sizes), dtype=torch.uint8, device="meta")
    parts, offset = {}, 0
    for (part, t), size in zip(local.parts.items(), sizes):
        parts[part] = buffer[:, offset:offset + size].view(t.dtype)
        offset += size
    return Payload(local.method, local.shape, local.dtype, parts, dict(local.options), rows)


def decode_on(path: str, name: str, padded: bool = True) -> None:
    """Run the front's decode of ``path`` for method ``name`` at N elements on meta tensors."""
    method = get_method(name)
    if path == "allgather":  # comm.allgather_payloads' receive, then AllGather.decode
        local = template(name, N)
        gathered = torch.empty(WORLD, local.nbytes, dtype=torch.uint8, device="meta")
        arrived = local.unflatten(gathered) if padded else end_to_end(local, WORLD)
        SCHEMES["allgather"].decode(method, arrived, torch.empty(N, device="meta"))
    elif path == "twophase":  # comm.two_phase_allreduce's reduce of this rank's chunk
        chunk = SCHEMES["twophase"].padded_numel(N, WORLD, method.granule) // WORLD
        chunks = template(name, chunk * WORLD).as_rows(WORLD)
        received = torch.empty_like(chunks.flatten())
        comm.decode_sum(chunks.row(0).unflatten(received) if padded
                        else end_to_end(chunks.row(0), WORLD))
    else:  # gradcomp.fsdp's reduce-scatter of N-element rows: p - 1 received onto the own row
        row = N
        local = template(name, row)
        received = torch.empty(WORLD - 1, local.nbytes, dtype=torch.uint8, device="meta")
        own = torch.empty(row, device="meta")
        if padded:
            fsdp.decode_and_sum(method, local, received, own, own_scale=1 / WORLD)
        else:
            method.decode_sum(end_to_end(local, WORLD - 1), torch.empty(row, device="meta"),
                              addend=own, addend_scale=1 / WORLD)


def recorded_launches(monkeypatch, path: str, name: str, padded: bool = True) -> list:
    """(kernel, positional args, constexpr kwargs) of every launch the decode makes."""
    module, kernel_name = KERNELS[name]
    recorder = Recorder()
    monkeypatch.setenv("GRADCOMP_BACKEND", "triton")
    monkeypatch.setattr(common, "interpreting", lambda: True)  # meta tensors pass check_flat
    kernel = jit_function(getattr(module, kernel_name))
    monkeypatch.setattr(module, kernel_name, recorder)
    decode_on(path, name, padded)
    assert recorder.launches, f"{name} {path}: no kernel launch recorded"
    return [(kernel, args, kwargs) for args, kwargs in recorder.launches]


def divisible_args(kernel, args) -> set[str]:
    """The arguments the JIT specialises as 16-divisible: ints divisible by 16 and tensors at a
    16-byte aligned address (allocations are; a view adds its byte offset)."""
    marked = set()  # the launchers pass the non-constexpr arguments in order, constexprs by name
    for arg_name, value in zip(kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            if value.storage_offset() * value.element_size() % 16 == 0:
                marked.add(arg_name)
        elif isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0:
            marked.add(arg_name)
    return marked


def compiled_as_launched(monkeypatch, path, name, padded=True):
    """[(shipped case, the launch's 16-divisible arguments, the case compiled for sm_90 with
    them)] for the decode's first (full-runs) launch, one per shipped config of its constexprs
    (TILE aside: the autotuner's)."""
    shipped = KERNELS[name][0].compile_cases()  # before the kernel is replaced by the recorder
    (kernel, args, kwargs), *_ = recorded_launches(monkeypatch, path, name, padded)
    cases = [case for case in shipped if case.kernel is kernel
             and all(kwargs.get(k) == v for k, v in case.constexprs.items() if k != "TILE")]
    assert cases, f"no shipped compile case of {kernel.__name__} with {kwargs}"
    aligned = divisible_args(kernel, args)
    return [(case, aligned, compile_case(dataclasses.replace(case, aligned=tuple(
        a for a in case.signature if a in aligned)), 90)) for case in cases]


@pytest.mark.parametrize("path", ["allgather", "twophase", "fsdp"])
@pytest.mark.parametrize("name", ["int8", "int4", "sign"])
def test_hook_decode_launches_use_wide_loads_at_100m(monkeypatch, path, name):
    for case, aligned, compiled in compiled_as_launched(monkeypatch, path, name):
        # the JIT sees every argument the shipped case assumes 16-divisible: the same kernel
        assert set(case.aligned) <= aligned, (case.name, sorted(set(case.aligned) - aligned))
        ptx, code = compiled.asm["ptx"], sass(compiled)
        for pattern in case.wide:
            assert re.search(pattern, ptx), f"{case.name}: no {pattern!r} on the {path} path"
        assert not BYTE_LOADS_PTX.search(ptx), f"{case.name}: byte loads on the {path} path"
        assert not BYTE_LOADS_SASS.search(code), f"{case.name}: byte loads in the SASS ({path})"
        if name != "sign":  # int8/int4 codes: 16-byte loads (sign's bits: 4-byte words)
            assert re.search(r"\bLDG\.E\.128\b", code), f"{case.name}: no LDG.E.128 ({path})"


@pytest.mark.parametrize("name", ["int8", "int4", "sign"])
def test_control_parts_end_to_end_fall_back_to_byte_loads(monkeypatch, name):
    """The check can fail: the same launch on rows laid end to end (12,890,628 / 51,562,500 /
    100,390,628 bytes, none 16-divisible) loses the row stride's specialisation."""
    for case, aligned, compiled in compiled_as_launched(monkeypatch, "allgather", name, padded=False):
        assert not set(case.aligned) <= aligned
        assert BYTE_LOADS_PTX.search(compiled.asm["ptx"]), case.name
