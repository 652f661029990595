"""Ahead-of-time compilation of a ``CompileCase`` for a GPU this machine need not have: triton's
own pipeline down to the cubin, assembled by the ptxas bundled with triton, and what the cubin
holds (SASS, registers, shared memory, local memory), read with the bundled cuobjdump.

Used by tests/test_kernels_compile.py (sm_80/sm_90 without spills) and benchmarks/roofline.py
(instructions counted from the sm_90 SASS). Works on any ``CompileCase``-like object (name,
kernel, signature, constexprs, num_warps, aligned, options), e.g. one of another commit's tree.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def compile_case(case, capability: int):
    """Compile one ``CompileCase`` ahead of time for sm_<capability> (no GPU needed): the
    launch's specialization marks ``case.aligned`` 16-divisible, as the JIT does for 16-byte
    aligned tensors and sizes divisible by 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(case.signature)
    attrs = {(names.index(arg),): [["tt.divisibility", 16]] for arg in case.aligned}
    src = ASTSource(fn=case.kernel, signature=case.signature, constexprs=case.constexprs, attrs=attrs)
    options = {"num_warps": case.num_warps, **case.options}
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def sass(compiled) -> str:
    """The compiled kernel's SASS (nvdisasm through triton.tools.disasm: one instruction a line,
    control codes first, branch targets as ``LBB<i>:`` labels)."""
    from triton.tools.disasm import get_sass

    return get_sass(compiled.asm["cubin"])


def resources(compiled) -> dict[str, int]:
    """Per-thread registers, stack and local bytes (spills), and static shared bytes per block of
    the compiled kernel, as the cubin records them (``cuobjdump -res-usage``); ``shared`` is the
    larger of that and triton's dynamic shared memory."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        report = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", str(path)],
                                capture_output=True, text=True, check=True).stdout
    found = RESOURCES.search(report)
    if found is None:
        raise RuntimeError(f"no resource line in cuobjdump's report:\n{report}")
    regs, stack, shared, local = map(int, found.groups())
    return {"registers": regs, "stack": stack, "local": local,
            "shared": max(shared, int(compiled.metadata.shared))}
