"""The training side of the emulated-link runs: the workloads (WORKLOADS, ``workload``), the
hooks attached to DDP as the runs name them, and ``train_worker``, the worker each rank runs
(``launch_ranks("gradcomp.emulate:train_worker", ...)``): timed training under each run, with
the calibration the model needs measured beside it.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from .launch import _import


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


def hook_options(method: str, options: dict) -> dict:
    """A method's options (``Choice.options``) as keywords of its hook state, which may name some
    of them differently (``METHOD_OPTION_NAMES`` of the state class, e.g. PowerSGDState's)."""
    from ..hooks import HOOKS

    renamed = getattr(HOOKS[method][1], "METHOD_OPTION_NAMES", {}) if method in HOOKS else {}
    return {renamed.get(name, name): value for name, value in options.items()}


def attach_hook(ddp, method: str, scheme: str = "", options: dict | None = None,
                node_size: int | None = None):
    """Register the gradcomp hook of ``method`` ("none": gradcomp's allreduce_hook, the same
    machinery without compression) on ``ddp`` with ``scheme`` and the method's ``options``
    (with ``node_size``: the hierarchical hook, nodes of that many consecutive ranks); the hook
    state."""
    from .. import hooks
    from ..analysis.costmodel import schemes

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
    the same load; after the sweep, how long a collective waits for the slowest rank's compute
    (``sync_wait``: calibrate.measure_sync_wait on the workload's forward, forward + backward and
    two of those); ranks that outnumber the host's cores (``cpus``) measure in turn, each on a
    core of its own (``calibrate.in_waves``). Plain numbers, for the parent to model and compare."""
    from ..analysis import Choice, calibrate
    from ..hooks.calibrate import measure_method
    from ..methods import UNCOMPRESSED

    result: dict = {"rank": rank, "steps": {}, "hook_stages": {}, "calibration": {},
                    "cpus": calibrate.host_cores()}
    runs = [(Choice(m, o, s, *h).label, m, s, o, *h) for m, s, o, *h in config.get("runs", [])]
    node_size = config.get("node_size")
    calibration = config.get("calibrate")
    if calibration:
        repeats, sizes = calibration["repeats"], calibration["sizes"]
        groups = {"network": None}
        if node_size:  # also each link class alone: every node's group at once, then across
            groups["network_intra"], groups["network_inter"] = node_groups(node_size)
        for key, group in groups.items():
            result[key] = {"sizes": calibration["network_sizes"],
                           **calibrate.sweep_collectives(calibration["network_sizes"], repeats, group)}
        alone = calibrate.single_rank_groups()

        def build():  # a fresh (module, batch, loss_fn) of the workload
            return workload(config["workload"], config["batch_size"], seed=0)

        module, batch, loss_fn = build()

        def step():
            loss_fn(module, batch).backward()

        result["sync_wait"] = calibrate.measure_sync_wait(
            [lambda: loss_fn(module, batch), step, lambda: (step(), step())]).__dict__

    for _ in range(config.get("rounds", 1)):  # rounds interleave the runs: load drifts hit all alike
        for label, method, scheme, options, *hierarchical in runs:
            if calibration:
                def measure(method=method, options=options):
                    module, batch, loss_fn = build()
                    measured = {"compute": calibrate.measure_compute(module, batch, loss_fn, repeats,
                                                                     group=alone, set_to_none=False).__dict__,
                                "average": calibrate.measure_average(sizes, repeats).__dict__}
                    if method != UNCOMPRESSED:
                        cost = measure_method(method, sizes, repeats, alone, build, config["bucket_cap_mb"],
                                              **hook_options(method, options))
                        measured["method"] = {"compress": cost.compress.__dict__,
                                              "decompress": cost.decompress.__dict__}
                    return measured

                result["calibration"].setdefault(label, []).append(calibrate.in_waves(measure))
            times, stages = timed_training(method, scheme, options, config, rank,
                                           node_size if any(hierarchical) else None)
            result["steps"].setdefault(label, []).append(times)
            result["hook_stages"].setdefault(label, []).append(stages)
    return result


def median_step_s(results: list[dict], label: str) -> float:
    """The slowest rank's median step seconds of run ``label`` over all its rounds."""
    return max(statistics.median([t for times in r["steps"][label] for t in times]) for r in results)
