"""Runs every module of tests/interpreted/ under the Triton interpreter (TRITON_INTERPRET=1): the
kernels against the torch reference, the public API with both backends, and the global-memory
bytes each kernel moves.

The modules run in PROCESSES pytest subprocesses, one per xdist worker, each a share of the
modules balanced by their measured seconds: a process pays the imports and the interpreter's
warm-up once for its share (the 14 modules took 217 s in one process, 542 s as 14 processes).
"""
import pytest

from kernel_utils import INTERPRETED_DIR, interpreter_blocked, run_interpreted

MODULES = sorted(INTERPRETED_DIR.glob("test_*.py"))
pytestmark = pytest.mark.skipif(bool(interpreter_blocked()), reason=interpreter_blocked())

PROCESSES = 2
SECONDS = {"test_powersgd": 35, "test_traffic_account": 28, "test_traffic": 27, "test_host_syncs": 25,
           "test_autotune": 19, "test_topk": 18, "test_hooks_backends": 14, "test_decode_sum": 12,
           "test_api": 10, "test_quant": 10, "test_sign": 8, "test_untrusted_payloads": 10, "test_cast": 3,
           "test_fsdp_rows": 3}
"""Each module's seconds in one interpreted process on 2 cores (a new module counts 10 until
measured)."""


def shares(modules: list, processes: int) -> list[list]:
    """``modules`` split into ``processes`` lists of about equal SECONDS, longest first."""
    out = [[] for _ in range(processes)]
    load = [0] * processes
    for module in sorted(modules, key=lambda m: (-SECONDS.get(m.stem, 10), m.stem)):
        least = load.index(min(load))
        out[least].append(module)
        load[least] += SECONDS.get(module.stem, 10)
    return out


SHARES = shares(MODULES, PROCESSES)


def test_there_are_interpreted_modules_and_each_runs_once():
    assert len(MODULES) >= 5
    assert sorted(m for share in SHARES for m in share) == MODULES


@pytest.mark.parametrize("share", SHARES, ids=[f"share{i}" for i in range(PROCESSES)])
def test_modules_under_interpreter(share):
    done = run_interpreted(share)
    lines = (done.stdout + done.stderr).splitlines()
    failures = [line for line in lines if line.startswith(("E ", "FAILED", "ERROR"))][:40]
    tail = "\n".join(failures + lines[-5:])
    names = ", ".join(m.name for m in share)
    assert done.returncode == 0, f"{names} failed under TRITON_INTERPRET=1:\n{tail}"
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], tail
