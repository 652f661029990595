"""Run a function on N Gloo ranks on 127.0.0.1, one thread each, and collect what each returns."""
from __future__ import annotations

import gc
import pickle
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradcomp.emulate import LOOPBACK, free_port


def _worker(rank, world_size, port, fn, args, folder, timeout_s):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        # a file, not a queue: plain pickle copies tensors by value (a queue's pickler shares them
        # through file descriptors that die with this process) and a full pipe cannot block exit
        Path(folder, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        # models and hook states left in reference cycles must go while the group still exists:
        # collected after destroy_process_group (at exit), a process whose hooks ran the Triton
        # interpreter was seen to abort in Gloo's teardown ("Resource deadlock avoided")
        gc.collect()
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 60.0, wall_s: float | None = None):
    """fn(rank, world_size, *args) on ``world_size`` spawned Gloo ranks; a list of results by rank.

    ``fn`` must be a module-level function and its results picklable (tensors are copied by
    value). ``timeout_s`` bounds each collective. A rank that raises fails the call with its
    traceback (``torch.multiprocessing.ProcessRaisedException``; the other ranks are terminated);
    ranks still running after ``wall_s`` seconds (default 3 timeout_s + 60) are killed and
    TimeoutError is raised.
    """
    wall_s = timeout_s * 3 + 60 if wall_s is None else wall_s
    with tempfile.TemporaryDirectory(prefix="gradcomp-ranks-") as folder:
        ranks = mp.start_processes(_worker, args=(world_size, free_port(), fn, args, folder, timeout_s),
                                   nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + wall_s
        while not ranks.join(timeout=max(deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= deadline:
                for process in ranks.processes:
                    process.kill()
                    process.join()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {wall_s:g} s")
        return [pickle.loads(Path(folder, f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]
