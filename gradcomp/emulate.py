"""Emulated links: Gloo ranks inside a private network namespace whose loopback is shaped by tbf.

    with ShapedLink(rate_gbps=1.0) as link:            # needs root, ip and tc; else EmulationUnavailable
        results = launch_ranks("gradcomp.emulate:train_worker", 2, config, link=link)

A ShapedLink creates its own namespace (``ip netns add gradcomp-<pid>-<n>``), brings its loopback
up and installs ``tc qdisc ... tbf rate R burst B latency L`` on it; ranks talk over 127.0.0.1
inside it only. Both directions of every rank pair share the one loopback queue, so an all-reduce
between two ranks sees R in total, not R per direction: the calibration measures exactly that.
The namespace is deleted on exit, on error, and at interpreter exit (atexit) if still open.

Loopback's default MTU is 64 KiB. tbf drops packets larger than its burst, so the burst is at
least 4 x 64 KiB and at least 2 ms at the rate (a smaller burst starves the link under the
kernel's timer granularity: measured 0.59 of the rate with 64 KiB at 1 Gbit/s, 0.87 with MTU
1500 and 256 KiB, 1.0 with 64 KiB MTU and 256 KiB). ``mtu`` sets another MTU for realism.

Workers run ``module:function(rank, world_size, config) -> JSON-able`` under a Gloo process group;
every launch is bounded by a timeout after which its processes are killed.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

LOOPBACK = "127.0.0.1"
NAMESPACE_PREFIX = "gradcomp-"
MIN_BURST_BYTES = 4 * 65536
BURST_SECONDS = 0.002
QUEUE_MS = 200
RANK_PORT = 29611  # inside a fresh namespace nothing else listens
_open_namespaces: set[str] = set()


class EmulationUnavailable(RuntimeError):
    """Shaping is not permitted here (not root, or no ip/tc); the message says why."""


def unavailable_reason() -> str | None:
    """Why a shaped link cannot be made here, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulated links need root (ip netns and tc); run as root or skip the emulation"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated links need {' and '.join(missing)} (iproute2) on PATH"
    return None


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.stdout.strip()}")


def _delete_namespace(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    _open_namespaces.discard(name)


@atexit.register
def _delete_open_namespaces() -> None:
    for name in list(_open_namespaces):
        _delete_namespace(name)


class ShapedLink:
    """A network namespace whose loopback is shaped to ``rate_gbps`` (None: unshaped).

    mtu: loopback MTU (None keeps 64 KiB); burst_bytes: tbf burst (None: see module doc);
    queue_ms: tbf latency, the longest a packet may wait before it is dropped.
    """

    _count = 0

    def __init__(self, rate_gbps: float | None = None, mtu: int | None = None,
                 burst_bytes: int | None = None, queue_ms: float = QUEUE_MS):
        if rate_gbps is not None and not rate_gbps > 0:
            raise ValueError(f"rate_gbps must be > 0 (or None for unshaped), got {rate_gbps!r}")
        if mtu is not None and not 576 <= mtu <= 65536:
            raise ValueError(f"mtu must be in [576, 65536], got {mtu!r}")
        self.rate_gbps, self.mtu, self.burst_bytes, self.queue_ms = rate_gbps, mtu, burst_bytes, queue_ms
        ShapedLink._count += 1
        self.name = f"{NAMESPACE_PREFIX}{os.getpid()}-{ShapedLink._count}"
        self.opened = False

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def open(self) -> ShapedLink:
        reason = unavailable_reason()
        if reason:
            raise EmulationUnavailable(reason)
        _run(["ip", "netns", "add", self.name])
        _open_namespaces.add(self.name)
        self.opened = True
        try:
            _run(self.prefix + ["ip", "link", "set", "lo", "up"])
            if self.mtu:
                _run(self.prefix + ["ip", "link", "set", "lo", "mtu", str(self.mtu)])
            self.set_rate(self.rate_gbps)
        except BaseException:
            self.close()
            raise
        return self

    def burst(self, rate_gbps: float) -> int:
        if self.burst_bytes:
            return self.burst_bytes
        return max(MIN_BURST_BYTES, int(rate_gbps * 1e9 / 8 * BURST_SECONDS))

    def set_rate(self, rate_gbps: float | None) -> None:
        """Shape to ``rate_gbps`` (replacing any shaping), or remove the shaping with None."""
        if rate_gbps is None:
            subprocess.run(self.prefix + ["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True,
                           timeout=30)
        else:
            _run(self.prefix + ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf",
                                "rate", f"{int(rate_gbps * 1e9)}bit", "burst", str(self.burst(rate_gbps)),
                                "latency", f"{self.queue_ms:g}ms"])
        self.rate_gbps = rate_gbps

    def close(self) -> None:
        if self.opened:
            _delete_namespace(self.name)
            self.opened = False

    # the launcher's view: where each rank runs and how it reaches the others
    store_address = LOOPBACK

    def rank_prefix(self, rank: int, world_size: int) -> list[str]:
        """The command prefix of ``rank``: every rank in the one namespace."""
        return self.prefix

    def rank_env(self, rank: int, world_size: int) -> dict:
        return {}

    def __enter__(self) -> ShapedLink:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


class ShapedNodes(ShapedLink):
    """Two nodes: a network namespace each, joined by a veth pair shaped by tbf at ``rate_gbps``
    in each direction (None: unshaped). Node i's ranks (consecutive: ``world_size / 2`` each)
    run in its namespace and bind Gloo to its end of the pair, address 127.0.i+1.1 (a loopback
    address, routed over the pair with ``route_localnet``): inside a node they talk over that
    namespace's loopback, unshaped; between the nodes over the pair, every rank of a node
    sharing its end. The rank store listens on node 0's address.
    """

    NODES = 2

    def __init__(self, rate_gbps: float | None = None, burst_bytes: int | None = None,
                 queue_ms: float = QUEUE_MS):
        super().__init__(rate_gbps, None, burst_bytes, queue_ms)
        self.nodes = [f"{self.name}-node{i}" for i in range(self.NODES)]

    @staticmethod
    def interface(node: int) -> str:
        return f"gcnode{node}"

    @staticmethod
    def address(node: int) -> str:
        return f"127.0.{node + 1}.1"

    @property
    def store_address(self) -> str:
        return self.address(0)

    def node_of(self, rank: int, world_size: int) -> int:
        if world_size % self.NODES:
            raise ValueError(f"{world_size} ranks do not split into {self.NODES} equal nodes")
        return rank // (world_size // self.NODES)

    def rank_prefix(self, rank: int, world_size: int) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[self.node_of(rank, world_size)]]

    def rank_env(self, rank: int, world_size: int) -> dict:
        return {"GLOO_SOCKET_IFNAME": self.interface(self.node_of(rank, world_size))}

    def open(self) -> ShapedNodes:
        reason = unavailable_reason()
        if reason:
            raise EmulationUnavailable(reason)
        self.opened = True
        try:
            for node in self.nodes:
                _run(["ip", "netns", "add", node])
                _open_namespaces.add(node)
            first, second = (["ip", "netns", "exec", node] for node in self.nodes)
            _run(first + ["ip", "link", "add", self.interface(0), "type", "veth", "peer", "name",
                          self.interface(1)])
            _run(first + ["ip", "link", "set", self.interface(1), "netns", self.nodes[1]])
            for node, prefix in enumerate((first, second)):
                device, here, there = self.interface(node), self.address(node), self.address(1 - node)
                _run(prefix + ["ip", "link", "set", "lo", "up"])
                _run(prefix + ["sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1",
                               f"net.ipv4.conf.{device}.route_localnet=1"])
                _run(prefix + ["ip", "addr", "add", f"{here}/32", "dev", device])
                _run(prefix + ["ip", "link", "set", device, "up"])
                _run(prefix + ["ip", "route", "add", f"{there}/32", "dev", device, "src", here])
            self.set_rate(self.rate_gbps)
        except BaseException:
            self.close()
            raise
        return self

    def set_rate(self, rate_gbps: float | None) -> None:
        """Shape both directions of the pair to ``rate_gbps`` (None: unshaped)."""
        for node, name in enumerate(self.nodes):
            prefix = ["ip", "netns", "exec", name]
            if rate_gbps is None:
                subprocess.run(prefix + ["tc", "qdisc", "del", "dev", self.interface(node), "root"],
                               capture_output=True, timeout=30)
            else:
                _run(prefix + ["tc", "qdisc", "replace", "dev", self.interface(node), "root", "tbf",
                               "rate", f"{int(rate_gbps * 1e9)}bit", "burst", str(self.burst(rate_gbps)),
                               "latency", f"{self.queue_ms:g}ms"])
        self.rate_gbps = rate_gbps

    def close(self) -> None:
        if self.opened:
            for node in self.nodes:
                _delete_namespace(node)
            self.opened = False


# ---- workloads ---------------------------------------------------------------------------------

def mlp(width: int = 1024, depth: int = 4, classes: int = 10) -> nn.Module:
    """``depth`` square Linear+ReLU layers of ``width`` and a classifier (depth * width^2 weights)."""
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def _mlp_workload(width: int, depth: int):
    def build(batch_size: int, seed: int = 0):
        torch.manual_seed(seed)
        module = mlp(width, depth)
        gen = torch.Generator().manual_seed(seed + 1)
        batch = (torch.randn(batch_size, width, generator=gen), torch.randint(10, (batch_size,), generator=gen))
        return module, batch, classification_loss
    return build


def classification_loss(module: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(module(x), y)


WORKLOADS = {
    "mlp": _mlp_workload(1024, 4),          # 4.2M parameters, 16.8 MB of fp32 gradients
    "mlp-small": _mlp_workload(512, 4),     # 1.1M parameters
}


def workload(name: str, batch_size: int, seed: int = 0):
    """(module, batch, loss_fn) of a name in WORKLOADS, or of ``package.module:factory`` where
    ``factory(batch_size, seed)`` returns that triple."""
    if name in WORKLOADS:
        return WORKLOADS[name](batch_size, seed)
    if ":" not in name:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)} "
                         "or give package.module:factory")
    return _import(name)(batch_size, seed)


def _import(path: str):
    module_name, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {path!r}: {exc}") from None


# ---- launching ranks ---------------------------------------------------------------------------

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
    parser = argparse.ArgumentParser(description="one rank of gradcomp.emulate.launch_ranks")
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


# ---- the training worker -----------------------------------------------------------------------

def hook_options(method: str, options: dict) -> dict:
    """A method's options (``Choice.options``) as keywords of its hook state, which may name some
    of them differently (``METHOD_OPTION_NAMES`` of the state class, e.g. PowerSGDState's)."""
    from .hooks import HOOKS

    renamed = getattr(HOOKS[method][1], "METHOD_OPTION_NAMES", {}) if method in HOOKS else {}
    return {renamed.get(name, name): value for name, value in options.items()}


def attach_hook(ddp, method: str, scheme: str = "", options: dict | None = None,
                node_size: int | None = None):
    """Register the gradcomp hook of ``method`` ("none": gradcomp's allreduce_hook, the same
    machinery without compression) on ``ddp`` with ``scheme`` and the method's ``options``
    (with ``node_size``: the hierarchical hook, nodes of that many consecutive ranks); the hook
    state."""
    from . import hooks
    from .analysis.costmodel import schemes

    options = hook_options(method, options or {})
    if scheme and len(schemes(method)) > 1:
        options["scheme"] = scheme
    if node_size is not None:
        options.update(hierarchical=True, node_size=node_size)
    return hooks.register(ddp, method, **options)


def node_groups(node_size: int) -> tuple:
    """(this rank's node group, its group across nodes: the ranks with its place in their
    node), nodes being ``node_size`` consecutive ranks; collective (every rank builds every
    group in the same order)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = world // node_size
    intra = [dist.new_group(list(range(n * node_size, (n + 1) * node_size))) for n in range(nodes)]
    inter = [dist.new_group(list(range(i, world, node_size))) for i in range(node_size)]
    return intra[rank // node_size], inter[rank % node_size]


def _collective_max(value: float) -> float:
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


HOOK_STAGES = ("compress_s", "decompress_s")
"""The hook's own per-step seconds that :func:`timed_training` records beside each step time."""


def timed_training(method: str, scheme: str, options: dict, config: dict, rank: int,
                   node_size: int | None = None) -> tuple[list[float], list[list[float]]]:
    """Seconds of each training step (after warm-up) of a fresh workload under one hook, and
    per step the hook's own :data:`HOOK_STAGES` seconds (its ``state.stats``: what the model's
    compress and decompress stages predict).

    Every step starts after a barrier; the run stops after ``steps`` steps or once ``budget_s``
    is spent (decided collectively, so all ranks stop together).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    module, batch, loss_fn = workload(config["workload"], config["batch_size"], seed=0)
    ddp = DDP(module, bucket_cap_mb=config["bucket_cap_mb"])
    state = attach_hook(ddp, method, scheme, options, node_size)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    times, stages, started = [], [], time.perf_counter()
    for step in range(config["warmup"] + config["steps"]):
        dist.barrier()
        state.stats.reset()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        loss_fn(ddp, batch).backward()
        optimizer.step()
        elapsed = time.perf_counter() - t0
        if step >= config["warmup"]:
            times.append(elapsed)
            tally = state.stats.tally()
            stages.append([tally.seconds(name) for name in HOOK_STAGES])
        if _collective_max(time.perf_counter() - started) > config.get("budget_s", float("inf")) \
                and len(times) >= 2:
            break
    return times, stages


def train_worker(rank: int, world_size: int, config: dict) -> dict:
    """Inside each rank: time training under each of ``config["runs"]`` ([method, scheme, options]
    or [method, scheme, options, hierarchical]: the hierarchical hook with nodes of
    ``config["node_size"]`` ranks), ``config["rounds"]`` times in turn (steps[label] is a list
    per round). With ``config["calibrate"]``, first sweep the collectives once (with
    ``node_size`` also inside the nodes and across them: ``network_intra``, ``network_inter``), and right before
    each run measure what the model needs for it (forward/backward/optimizer, the bucket averaging
    pass and the run's hook costs, at ``sizes`` elements), so that prediction and measurement see
    the same load. Plain numbers, for the parent to model and compare."""
    from .analysis import Choice, calibrate
    from .hooks.calibrate import measure_method
    from .methods import UNCOMPRESSED

    result: dict = {"rank": rank, "steps": {}, "hook_stages": {}, "calibration": {}}
    runs = [(Choice(m, o, s, *h).label, m, s, o, *h) for m, s, o, *h in config.get("runs", [])]
    node_size = config.get("node_size")
    calibration = config.get("calibrate")
    if calibration:
        repeats, sizes = calibration["repeats"], calibration["sizes"]
        groups = {"network": None}
        if node_size:  # also each link class alone: every node's group at once, then across
            groups["network_intra"], groups["network_inter"] = node_groups(node_size)
        for key, group in groups.items():
            allreduce, allgather = calibrate.sweep_collectives(calibration["network_sizes"], repeats, group)
            result[key] = {"sizes": calibration["network_sizes"], "allreduce_s": allreduce,
                           "allgather_s": allgather}
        alone = calibrate.single_rank_groups()

        def build():  # a fresh (module, batch, loss_fn) of the workload
            return workload(config["workload"], config["batch_size"], seed=0)

    for _ in range(config.get("rounds", 1)):  # rounds interleave the runs: load drifts hit all alike
        for label, method, scheme, options, *hierarchical in runs:
            if calibration:
                module, batch, loss_fn = build()
                measured = {"compute": calibrate.measure_compute(module, batch, loss_fn, repeats,
                                                                       group=alone).__dict__,
                            "average": calibrate.measure_average(sizes, repeats).__dict__}
                if method != UNCOMPRESSED:
                    cost = measure_method(method, sizes, repeats, alone, build, config["bucket_cap_mb"],
                                          **hook_options(method, options))
                    measured["method"] = {"compress": cost.compress.__dict__,
                                          "decompress": cost.decompress.__dict__}
                result["calibration"].setdefault(label, []).append(measured)
            times, stages = timed_training(method, scheme, options, config, rank,
                                           node_size if any(hierarchical) else None)
            result["steps"].setdefault(label, []).append(times)
            result["hook_stages"].setdefault(label, []).append(stages)
    return result


def median_step_s(results: list[dict], label: str) -> float:
    """The slowest rank's median step seconds of run ``label`` over all its rounds."""
    return max(statistics.median([t for times in r["steps"][label] for t in times]) for r in results)


if __name__ == "__main__":
    _rank_main()
