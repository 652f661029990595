"""Runs every module of tests/interpreted/ under the Triton interpreter (TRITON_INTERPRET=1), one
subprocess per module: the kernels against the torch reference, the public API with both
backends, and the global-memory bytes each kernel moves."""
import pytest

from kernel_utils import INTERPRETED_DIR, interpreter_blocked, run_interpreted

MODULES = sorted(INTERPRETED_DIR.glob("test_*.py"))
pytestmark = pytest.mark.skipif(bool(interpreter_blocked()), reason=interpreter_blocked())


def test_there_are_interpreted_modules():
    assert len(MODULES) >= 5


@pytest.mark.parametrize("module", MODULES, ids=[m.stem for m in MODULES])
def test_module_under_interpreter(module):
    done = run_interpreted(module)
    lines = (done.stdout + done.stderr).splitlines()
    failures = [line for line in lines if line.startswith("E ")][:40]
    tail = "\n".join(failures + lines[-5:])
    assert done.returncode == 0, f"{module.name} failed under TRITON_INTERPRET=1:\n{tail}"
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], tail
