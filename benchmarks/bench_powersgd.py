"""PowerSGD DDP step time: gradcomp's powersgd_hook against torch's powerSGD_hook, same run.

Two Gloo ranks on 127.0.0.1 (one thread each) train a ResNet-20 (CIFAR-shaped images) and a small
GPT (examples/models.py) on synthetic batches. In every rank the same model is wrapped three
times: gradcomp's ``powersgd_hook``, torch's ``powerSGD_hook`` (same rank, both after 2
uncompressed steps) and DDP's default all-reduce. One bucket (``bucket_cap_mb`` above the model
size): torch's hook crashes Gloo with several. The variants take turns in rounds of steps (the
order rotates), so load drifts on a shared machine hit all of them; each step starts after a
barrier and ends after ``optimizer.step()``. Reported: median step time, its ratio to torch's,
wire bytes per step (gradcomp: ``state.stats()``; torch: its compressed element count x 4) and
gradcomp's own time per step in compress, decompress and communication (from its issue to its
arrival, so it includes waiting for the slower rank).

    python benchmarks/bench_powersgd.py [--rank 4] [--rounds 8] [--steps-per-round 4]
                                        [--models resnet20,gpt] [--json PATH] [--smoke]

Prints the table; writes JSON only with ``--json``. ``--smoke``: the GPT alone, one round of one
step (seconds; checks the script end to end, its times mean nothing).

Target: gradcomp step time <= 0.9x torch's at equal wire bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--models", default="resnet20,gpt")
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: the GPT, one round of one step (checks the script; times mean nothing)")
    return parser


if __name__ == "__main__":  # --help and argument errors answer before torch is imported
    build_parser().parse_args()
    # the compiled CPU fast path from the first call, as a long run has it (by default gradcomp runs
    # a function eagerly until that has taken as long as compiling it: gradcomp.methods.fast)
    os.environ.setdefault("GRADCOMP_CPU_COMPILE_AFTER_S", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from dist_utils import run_ranks  # noqa: E402

from examples.models import GPT, GPTConfig, count_parameters, resnet20  # noqa: E402
from gradcomp.hooks import PowerSGDState, powersgd_hook  # noqa: E402

START_ITER = 2  # torch requires > 1 with error feedback
WARMUP_STEPS = 4
VARIANTS = ("gradcomp", "torch", "allreduce")
MODELS = {
    # name: (builder, batch builder(rank, size), per-rank batch size)
    "resnet20": (resnet20, lambda gen, b: (torch.randn(b, 3, 32, 32, generator=gen),
                                           torch.randint(10, (b,), generator=gen)), 8),
    "gpt": (lambda: GPT(GPTConfig()), lambda gen, b: _tokens(gen, b), 4),
}


def _tokens(gen, b, context=64):
    tokens = torch.randint(256, (b, context + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def interleaved_step_times(models: dict, optimizers: dict, batch, rounds: int, steps_per_round: int,
                           after_warmup=None) -> dict:
    """{label: [seconds per step]}: ``WARMUP_STEPS`` untimed steps per model, ``after_warmup()``,
    then ``rounds`` rounds in which each model runs ``steps_per_round`` timed steps, the order
    rotating every round. A step starts after a barrier and ends after ``optimizer.step()``."""
    x, y = batch

    def step(label):
        dist.barrier()
        start = time.perf_counter()
        optimizers[label].zero_grad(set_to_none=True)
        _loss(models[label], x, y).backward()
        optimizers[label].step()
        return time.perf_counter() - start

    labels = list(models)
    for label in labels:
        for _ in range(WARMUP_STEPS):
            step(label)
    if after_warmup is not None:
        after_warmup()
    times = {label: [] for label in labels}
    for r in range(rounds):
        shift = r % len(labels)
        for label in labels[shift:] + labels[:shift]:
            times[label] += [step(label) for _ in range(steps_per_round)]
    return times


def _worker(rank, world, model_name, approx_rank, rounds, steps_per_round):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    build, make_batch, batch_size = MODELS[model_name]
    models = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        net = build()
        models[variant] = DDP(net, bucket_cap_mb=4 * count_parameters(net) / 2**20 + 1)
    ours = PowerSGDState(None, matrix_rank=approx_rank, start_iter=START_ITER).bind(models["gradcomp"])
    models["gradcomp"].register_comm_hook(ours, powersgd_hook)
    theirs = torch_psgd.PowerSGDState(None, matrix_approximation_rank=approx_rank,
                                      start_powerSGD_iter=START_ITER)
    models["torch"].register_comm_hook(theirs, torch_psgd.powerSGD_hook)
    optimizers = {v: torch.optim.SGD(m.parameters(), lr=0.01) for v, m in models.items()}
    batch = make_batch(torch.Generator().manual_seed(rank), batch_size)
    before = {}

    def snapshot():
        before.update(ours=ours.stats.state_dict(), torch=theirs.total_numel_after_compression)

    times = interleaved_step_times(models, optimizers, batch, rounds, steps_per_round, snapshot)
    timed = rounds * steps_per_round
    totals = ours.stats.state_dict()["totals"]
    hook_s = {k: (totals[k] - before["ours"]["totals"][k]) / timed
              for k in ("compress_s", "decompress_s", "comm_s")}
    params = count_parameters(models["allreduce"].module)
    return {
        "model": model_name, "parameters": params, "batch_per_rank": batch_size,
        "buckets": len(ours.lowrank.plans),
        "step_s": {v: statistics.median(t) for v, t in times.items()},
        "wire_bytes_per_step": {
            "gradcomp": (totals["wire_bytes"] - before["ours"]["totals"]["wire_bytes"]) / timed,
            "torch": 4 * (theirs.total_numel_after_compression - before["torch"]) / timed,
            "allreduce": 4 * params},
        "gradcomp_hook_s_per_step": hook_s,
    }


def run_per_model(models_arg: str, worker, world: int, *args, timeout_s: float) -> list:
    """``worker(rank, world, model_name, *args)`` on ``world`` ranks for each comma-separated model
    name; rank 0's result per model."""
    names = models_arg.split(",")
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    return [run_ranks(worker, world, name, *args, timeout_s=timeout_s)[0] for name in names]


def write_report(path: str | None, report: dict) -> dict:
    """``report`` plus the machine it ran on, written as JSON to ``path`` (None: not written)."""
    report.update(torch=torch.__version__, machine=platform.machine(), cpus=os.cpu_count())
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")
    return report


def _hook_ms(seconds: dict) -> str:
    return "/".join(f"{1e3 * seconds[k]:.1f}" for k in ("compress_s", "decompress_s", "comm_s"))


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.rounds, args.steps_per_round = "gpt", 1, 1
    results = run_per_model(args.models, _worker, 2, args.rank, args.rounds, args.steps_per_round,
                            timeout_s=600)
    rows = []
    for res in results:
        torch_s = res["step_s"]["torch"]
        for variant in VARIANTS:
            rows.append([res["model"], f"{res['parameters']:,}", variant,
                         f"{1e3 * res['step_s'][variant]:.1f}", f"{res['step_s'][variant] / torch_s:.2f}",
                         f"{res['wire_bytes_per_step'][variant] / 1e3:.1f}",
                         _hook_ms(res["gradcomp_hook_s_per_step"]) if variant == "gradcomp" else ""])
    print(tabulate(rows, headers=["model", "params", "hook", "step ms (median)", "vs torch",
                                  "wire KB/step", "compress/decompress/comm ms"]))
    return write_report(args.json, {"rank": args.rank, "world_size": 2, "rounds": args.rounds,
                                    "steps_per_round": args.steps_per_round, "results": results})


if __name__ == "__main__":
    main()
