"""Run a function on N Gloo ranks on 127.0.0.1, one thread each, and collect what each returns.

Ranks start from a forkserver that has already imported torch (about 0.3 s a rank instead of
3 s from a bare interpreter), with this process's environment as it is at the call; when a
variable that torch reads at import differs from the server's, the ranks are spawned instead.
"""
from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradcomp.emulate import LOOPBACK, free_port

PRELOADED = ["numpy", "torch", "torch.distributed", "torch.multiprocessing", "torch._dynamo",
             "torch.nn.parallel", "gradcomp", "gradcomp.hooks", "gradcomp.fsdp", "gradcomp.optim"]
"""What the forkserver imports before it forks a rank: torch (3 s), torch._dynamo (2.5 s: DDP's
constructor imports it), gradcomp and Triton (which reads TRITON_* when its kernels are
decorated). gradcomp reads its own GRADCOMP_* variables when called, under the environment the
rank applies; none of these start a thread."""

READ_AT_IMPORT = ("TORCH", "PYTORCH", "ATEN", "OMP", "MKL", "KMP", "CUDA", "LD_", "PYTHON", "TRITON")
"""Prefixes of environment variables read when torch or Triton is imported (the test module a
rank runs is imported, with gradcomp and Triton, before the rank applies the caller's
environment): a rank that needs another value than the forkserver had is spawned."""

SET_BY_LIBRARIES = ("TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK", "KMP_DUPLICATE_LIB_OK",
                    "KMP_INIT_AT_FORK")
"""Set in the process's own environment by a library, not by the caller: torch.compile's first
use (the cache folder; a rank reads it when it compiles, under the caller's environment),
importing Lightning (``PYTORCH_NVML_BASED_CUDA_CHECK=1``) and importing scikit-learn (the
examples' digits: the two ``KMP_*``, for Intel's OpenMP, which torch's CPU wheel does not use).
Any of them would otherwise send every later launch of that test worker to spawn (10-50 s a
launch on 2 busy cores)."""


def _read_at_import(env=None) -> dict:
    """What of ``env`` (default: this process's environment) torch or Triton read at import."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT) and k not in SET_BY_LIBRARIES}


_server_env: dict | None = None
_session_env: dict | None = None


def remember_environment() -> None:
    """Note the environment before any test changes it (conftest.py, when pytest is configured):
    the forkserver starts under it, whichever test launches ranks first (a test that sets
    TRITON_INTERPRET would otherwise leave a server that every later launch must bypass)."""
    global _session_env
    _session_env = dict(os.environ)


def start_server() -> None:
    """Start the forkserver (once) under the remembered environment, or this one."""
    global _server_env
    if _server_env is not None:
        return
    current = dict(os.environ)
    os.environ.clear()
    os.environ.update(_session_env or current)
    try:
        multiprocessing.set_forkserver_preload(PRELOADED)
        multiprocessing.forkserver.ensure_running()
        _server_env = _read_at_import()
    finally:
        os.environ.clear()
        os.environ.update(current)


def start_method() -> str:
    """``forkserver`` (torch, gradcomp and Triton preloaded) unless the environment they read at
    import differs from the server's, then ``spawn``."""
    start_server()
    return "forkserver" if _read_at_import() == _server_env else "spawn"


def _enter(rank, world_size, port, env, timeout_s):
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    if os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0", "false"):
        from kernel_utils import speed_up_interpreter
        speed_up_interpreter()  # the interpreted tests' ranks: the interpreter's patching, faster
    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _leave():
    # models and hook states left in reference cycles must go while the group still exists:
    # collected after destroy_process_group (at exit), a process whose hooks ran the Triton
    # interpreter was seen to abort in Gloo's teardown ("Resource deadlock avoided")
    gc.collect()
    dist.destroy_process_group()


def _worker(rank, world_size, port, fn, args, folder, timeout_s, env):
    _enter(rank, world_size, port, env, timeout_s)
    try:
        result = fn(rank, world_size, *args)
        # a file, not a queue: plain pickle copies tensors by value (a queue's pickler shares them
        # through file descriptors that die with this process) and a full pipe cannot block exit
        Path(folder, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        _leave()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 60.0, wall_s: float | None = None):
    """fn(rank, world_size, *args) on ``world_size`` Gloo ranks; a list of results by rank.

    ``fn`` must be a module-level function and its results picklable (tensors are copied by
    value). ``timeout_s`` bounds each collective. A rank that raises fails the call with its
    traceback (``torch.multiprocessing.ProcessRaisedException``; the other ranks are terminated);
    ranks still running after ``wall_s`` seconds (default 3 timeout_s + 60) are killed and
    TimeoutError is raised.
    """
    wall_s = timeout_s * 3 + 60 if wall_s is None else wall_s
    with tempfile.TemporaryDirectory(prefix="gradcomp-ranks-") as folder:
        ranks = mp.start_processes(
            _worker, args=(world_size, free_port(), fn, args, folder, timeout_s, dict(os.environ)),
            nprocs=world_size, join=False, start_method=start_method())
        deadline = time.monotonic() + wall_s
        while not ranks.join(timeout=max(deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= deadline:
                for process in ranks.processes:
                    process.kill()
                    process.join()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {wall_s:g} s")
        return [pickle.loads(Path(folder, f"rank{rank}.pkl").read_bytes()) for rank in range(world_size)]


# ---- ranks that die ----------------------------------------------------------------------------

def die(folder: str) -> None:
    """End this rank at once, as a crash or a lost machine does (SIGKILL: no cleanup, no
    goodbye to its peers), after noting the time in ``folder``."""
    Path(folder, f"died{dist.get_rank()}").write_text(repr(time.time()))
    os.kill(os.getpid(), 9)


def _outcome_worker(rank, world_size, port, fn, args, folder, timeout_s, env):
    _enter(rank, world_size, port, env, timeout_s)
    try:
        result = fn(rank, world_size, folder, *args)
    except BaseException as exc:
        Path(folder, f"rank{rank}.pkl").write_bytes(pickle.dumps(
            {"raised": type(exc).__name__, "message": str(exc), "at": time.time(),
             "traceback": traceback.format_exc()}))
        raise  # the rank exits with the error, as a training script would
    Path(folder, f"rank{rank}.pkl").write_bytes(pickle.dumps({"returned": result, "at": time.time()}))
    _leave()


def run_ranks_to_their_end(fn, world_size: int, *args, timeout_s: float = 20.0,
                           wall_s: float | None = None) -> list[dict]:
    """fn(rank, world_size, folder, *args) on ``world_size`` Gloo ranks, some of which end
    themselves with :func:`die` (folder: where it notes the time). Waits for every rank to exit
    (a rank still running after ``wall_s``, default 2 timeout_s + 30, is killed) and returns by
    rank: ``exitcode``; ``raised`` (the exception's type name), ``message`` and ``traceback``,
    or ``returned``; ``after_death_s``: seconds from the first death to this rank's end (None
    if it was killed or it is a dead rank); ``killed``: still running at the wall limit."""
    wall_s = timeout_s * 2 + 30 if wall_s is None else wall_s
    with tempfile.TemporaryDirectory(prefix="gradcomp-ranks-") as folder:
        ranks = mp.start_processes(
            _outcome_worker, args=(world_size, free_port(), fn, args, folder, timeout_s, dict(os.environ)),
            nprocs=world_size, join=False, start_method=start_method())
        deadline = time.monotonic() + wall_s
        for process in ranks.processes:
            process.join(timeout=max(deadline - time.monotonic(), 0.0))
        outcomes = []
        deaths = [float(p.read_text()) for p in Path(folder).glob("died*")]
        for rank, process in enumerate(ranks.processes):
            killed = process.is_alive()
            if killed:
                process.kill()
                process.join()
            saved = Path(folder, f"rank{rank}.pkl")
            outcome = pickle.loads(saved.read_bytes()) if saved.exists() else {}
            at = outcome.pop("at", None)
            outcome.update(exitcode=process.exitcode, killed=killed,
                           after_death_s=at - min(deaths) if at is not None and deaths else None)
            outcomes.append(outcome)
        return outcomes
