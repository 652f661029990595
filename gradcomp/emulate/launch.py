"""The rank launcher: ``module:function(rank, world_size, config) -> JSON-able`` run on Gloo ranks,
each a new Python process started as ``python -m gradcomp.emulate`` (inside a shaped link's
namespace when given one), every launch bounded by a timeout after which its processes are
killed.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from .links import LOOPBACK, ShapedLink

RANK_PORT = 29611  # inside a fresh namespace nothing else listens

KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(2 ** 30), "MALLOC_TRIM_THRESHOLD_": str(2 ** 40),
                     "MALLOC_ARENA_MAX": "1"}
"""Environment that makes glibc's malloc keep what a rank frees, whichever thread frees it (no
mmap per tensor under 1 GiB, no trim, one arena for every thread), as a caching allocator would
(PyTorch's CPU tuning guide: jemalloc or tcmalloc). glibc's default maps every large tensor
afresh and hands freed memory back, so each new tensor pays a page fault per 4 KiB page, by an
amount that depends on the process's allocation history: int8's compress of 0.5-4.2M elements
alone on a core measured 13-61 ns per element per call with the default (medians 20-36) and
12-32 (medians 13-16) with the first two. A thread other than the main one
allocates from an arena of its own, whose heap glibc unmaps once it is empty whatever the trim
threshold: a collective's callback decoding on Gloo's thread faulted its 16.8 MB scratch in
afresh (4,110-8,221 faults per decode of 2 int8 payloads of 4.2M elements) until every thread
shared the main arena. The break-even validation gives these to every rank, so that the hooks'
calibration and their training allocate alike. Ignored by other C libraries."""


def _import(path: str):
    module_name, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {path!r}: {exc}") from None


def free_port() -> int:
    """A TCP port free on LOOPBACK right now (gradcomp's one such helper: tests, examples and
    the cli import it)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def launch_ranks(target: str, world_size: int, config: dict, link: ShapedLink | None = None,
                 timeout_s: float = 300.0, env: dict | None = None) -> list:
    """Run ``target`` ("package.module:function") on ``world_size`` Gloo ranks, each a new Python
    process (inside ``link``'s namespace when given: a ShapedLink's, or its node's for
    ShapedNodes); the list of their JSON results by rank.

    Raises TimeoutError after ``timeout_s`` (the processes are killed) and RuntimeError with the
    tail of a failed rank's stderr.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # not torch.multiprocessing.spawn: a rank must start inside the namespace (``ip netns exec``)
    port = RANK_PORT if link is not None else free_port()
    address = link.store_address if link is not None else LOOPBACK
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="gradcomp-ranks-") as tmp:
        procs, logs = [], []
        for rank in range(world_size):
            out = Path(tmp) / f"rank{rank}.json"
            log = open(Path(tmp) / f"rank{rank}.log", "w+")
            prefix = link.rank_prefix(rank, world_size) if link is not None else []
            cmd = prefix + [sys.executable, "-m", "gradcomp.emulate", "--target", target, "--rank", str(rank),
                            "--world-size", str(world_size), "--address", address, "--port", str(port),
                            "--timeout-s", str(timeout_s), "--config", json.dumps(config), "--out", str(out)]
            rank_env = {**child_env, **(link.rank_env(rank, world_size) if link is not None else {})}
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=rank_env,
                                          start_new_session=True))
            logs.append(log)
        deadline = time.monotonic() + timeout_s
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{target} on {world_size} ranks did not finish in {timeout_s:.0f} s") from None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait()
            texts = []
            for log in logs:
                log.seek(0)
                texts.append(log.read())
                log.close()
        for rank, proc in enumerate(procs):
            if proc.returncode != 0:
                raise RuntimeError(f"rank {rank} of {target} failed (exit {proc.returncode}):\n"
                                   + "\n".join(texts[rank].splitlines()[-25:]))
        return [json.loads((Path(tmp) / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _rank_main(argv=None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description="one rank of gradcomp.emulate.launch_ranks")
    for flag in ("--target", "--config", "--out"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--address", default=LOOPBACK, help="where rank 0's store listens")
    for flag in ("--rank", "--world-size", "--port"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.address}:{args.port}", rank=args.rank,
                            world_size=args.world_size, timeout=timedelta(seconds=args.timeout_s))
    try:
        result = _import(args.target)(args.rank, args.world_size, json.loads(args.config))
        Path(args.out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
