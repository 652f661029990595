"""Every shipped kernel config compiles ahead of time for sm_80 and sm_90 without register
spills, and the streaming kernels load global memory with 128-bit vector instructions.

No GPU is needed: triton.compile runs the whole pipeline down to PTX and the bundled ptxas
assembles the cubin; ``ptxas -v`` reports the spills. Runs in this (non-interpreted) process.
"""
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402

from gradcomp.kernels import families  # noqa: E402
from gradcomp.kernels.common import interpreting  # noqa: E402
from gradcomp.kernels.aot import compile_case  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(interpreting(), reason="ahead-of-time compilation needs the JIT")]

CASES = [case for module in families() for case in module.compile_cases()]
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_report(ptx: str, capability: int) -> str:
    arch = f"sm_{capability}a" if capability == 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name={arch}", str(path),
                               "-o", str(path.with_suffix(".cubin"))],
                              capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_compiles_without_spills(case, capability):
    compiled = compile_case(case, capability)
    ptx = compiled.asm["ptx"]
    report = ptxas_report(ptx, capability)
    spills = SPILLS.findall(report)
    assert spills, f"no spill line in the ptxas report:\n{report}"
    assert all(store == "0" and load == "0" for store, load in spills), report
    for pattern in case.wide:
        assert re.search(pattern, ptx), f"{case.name}: no {pattern!r} (128-bit) on sm_{capability}"
    assert "div.full.f32" not in ptx, f"{case.name}: approximate division (use tl.math.div_rn)"


def test_every_kernel_has_a_compile_case():
    """Each launched kernel of every module (``*_kernel``) is among the compiled cases."""
    shipped = {case.kernel.fn.__name__ for case in CASES}
    for module in families():
        kernels = {name for name in vars(module) if name.endswith("_kernel")}
        assert kernels and kernels <= shipped, f"{module.__name__}: {sorted(kernels - shipped)}"
