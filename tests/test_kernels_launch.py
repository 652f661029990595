"""Kernel launches from several threads run one at a time (kernels.common.LAUNCH_LOCK), on the
GPU path too: there every kernel is a ``triton.autotune`` kernel behind a SerializedLaunch.

A DDP hook launches from two threads at once (the autograd thread compresses, a communication
callback decodes); tests/interpreted/test_hooks_backends.py runs that end to end.
"""
import threading
import time

import pytest
import triton

from gradcomp.kernels import cast, powersgd, quant, sign, topk
from gradcomp.kernels.common import SerializedLaunch, jit_function

MODULES = (cast, quant, sign, topk, powersgd)


class OverlapRecorder:
    """A stand-in kernel: ``kernel[grid](...)`` sleeps and counts launches that overlapped."""

    def __init__(self):
        self.running, self.overlaps, self.grids = 0, 0, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.running += 1
            self.overlaps += self.running > 1
            time.sleep(0.005)
            self.grids.append(grid)
            self.running -= 1

        return run


def launch_from_threads(kernel, threads: int = 4, launches: int = 5) -> None:
    def launch():
        for _ in range(launches):
            kernel[(1,)]()

    workers = [threading.Thread(target=launch) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def test_serialized_launches_never_overlap():
    recorder = OverlapRecorder()
    launch_from_threads(SerializedLaunch(recorder))
    assert recorder.overlaps == 0 and recorder.grids == [(1,)] * 20


def test_unserialized_launches_do_overlap():
    """The recorder does see overlapping launches, so the test above can fail."""
    recorder = OverlapRecorder()
    launch_from_threads(recorder)
    assert recorder.overlaps > 0


@pytest.mark.parametrize("module", MODULES, ids=[m.__name__.rsplit(".", 1)[-1] for m in MODULES])
def test_every_gpu_kernel_is_an_autotuned_serialized_launch(module):
    kernels = [value for name, value in vars(module).items() if name.endswith("_kernel")]
    assert kernels
    for kernel in kernels:
        assert isinstance(kernel, SerializedLaunch)
        assert isinstance(kernel.kernel, triton.runtime.Autotuner)
        assert isinstance(jit_function(kernel), triton.runtime.JITFunction)
