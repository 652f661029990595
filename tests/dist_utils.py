"""Run a function on N Gloo ranks on 127.0.0.1, one thread each, and collect what each returns."""
from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, timeout_s):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        from datetime import timedelta

        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world_size, *args)
        # plain pickle copies tensors by value (the queue's pickler would share them through
        # file descriptors that die with this process)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException as exc:  # reported to the parent, which raises
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 60.0, allow_errors: bool = False):
    """fn(rank, world_size, *args) on ``world_size`` spawned Gloo ranks; a list of results by rank.

    ``fn`` must be a module-level function and its results picklable (tensors are copied by
    value). With ``allow_errors``,
    an error becomes ("error", text) in the list instead of raising.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, timeout_s))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout_s * 3 + 60)
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    out = []
    for rank in range(world_size):
        status, value = results[rank]
        if status == "error" and not allow_errors:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        out.append(pickle.loads(value) if status == "ok" else ("error", value))
    return out
