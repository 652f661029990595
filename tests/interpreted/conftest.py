"""Collect the interpreted kernel tests only inside a TRITON_INTERPRET=1 process.

The main test process imports Triton without the interpreter (ahead-of-time compile tests), so
these modules are skipped there and run by tests/test_kernels_interpreted.py in subprocesses.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from kernel_utils import interpreter_active, speed_up_interpreter  # noqa: E402

speed_up_interpreter()


def pytest_ignore_collect(collection_path, config):
    if collection_path.name.startswith("test_") and not interpreter_active():
        return True
    return None
