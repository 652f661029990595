"""Every DDP hook side by side: step time, wire bytes per step and compression ratio, one run.

Gloo ranks on 127.0.0.1 (one thread each) train a ResNet-20 (CIFAR-shaped images) and a small GPT
(examples/models.py) on a fixed synthetic batch. Each rank wraps the same model once per variant:
DDP's built-in all-reduce, gradcomp's allreduce / fp16 / bf16 / int8 / sign (both schemes) / topk /
powersgd hooks, and torch's fp16_compress_hook and powerSGD_hook. One bucket per model
(``bucket_cap_mb`` above its size), because torch's powerSGD_hook crashes Gloo with several.
Variants take turns in rounds of steps (the order rotates) so that load drifts on a shared
machine hit all of them; each step starts after a barrier and ends after ``optimizer.step()``.

Reported per variant: median step time and its ratio to DDP's built-in all-reduce; wire bytes per
step (bytes this rank hands to collectives: gradcomp's ``state.stats()``, torch's fp16 2 bytes per
element, torch's PowerSGD 4 x its compressed element count) and ratio = uncompressed fp32 bytes /
wire bytes; per-rank bytes received by the scheme's collectives (alpha-beta volumes, see
docs/hooks.md); and the gradcomp hook's own time per step (compress + decompress + communication).

    python benchmarks/bench_hooks.py [--world 2] [--rounds 6] [--steps-per-round 3]
                                     [--models resnet20,gpt] [--json PATH] [--smoke]

Prints the table; writes JSON only with ``--json``. ``--smoke``: the GPT alone, one round of one
step (seconds; checks the script end to end, its times mean nothing).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=3)
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
from tabulate import tabulate  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_powersgd import (MODELS, WARMUP_STEPS, interleaved_step_times, run_per_model,  # noqa: E402
                            write_report)  # same models, batches, timing and report

from examples.models import count_parameters  # noqa: E402
from gradcomp.hooks import register  # noqa: E402

POWERSGD_RANK, START_ITER = 4, 2  # torch's PowerSGD needs start_iter > 1
# label -> (gradcomp method or torch hook, options)
VARIANTS = {
    "ddp default": (None, {}),
    "torch fp16_compress_hook": ("torch_fp16", {}),
    "torch powerSGD_hook r4": ("torch_powersgd", {}),
    "allreduce": ("none", {}),  # gradcomp's uncompressed hook (allreduce_hook)
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "int8 allgather": ("int8", {"scheme": "allgather"}),
    "int8 twophase": ("int8", {"scheme": "twophase"}),
    "sign allgather": ("sign", {"scheme": "allgather"}),
    "sign twophase": ("sign", {"scheme": "twophase"}),
    "topk 1%": ("topk", {"ratio": 0.01}),
    "powersgd r4": ("powersgd", {"matrix_rank": POWERSGD_RANK, "start_iter": START_ITER}),
}


def received_bytes(method: str | None, options: dict, wire: float, world: int) -> float:
    """Bytes one rank receives per step for ``wire`` bytes handed to the scheme's collectives."""
    if method in ("int8", "sign") and options["scheme"] == "allgather" or method == "topk":
        return (world - 1) * wire  # everyone's payload
    if method in ("int8", "sign"):  # wire = p chunks (all-to-all) + 1 chunk (all-gather)
        chunk = wire / (world + 1)
        return 2 * (world - 1) * chunk
    return 2 * (world - 1) / world * wire  # ring all-reduce


def _attach(model: DDP, method, options):
    """Register the variant's hook; returns totals(steps) -> (wire bytes so far, hook seconds)."""
    numel = count_parameters(model.module)
    if method is None:
        return lambda steps: (4.0 * numel * steps, 0.0)
    if method == "torch_fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return lambda steps: (2.0 * numel * steps, 0.0)
    if method == "torch_powersgd":
        state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=POWERSGD_RANK,
                                             start_powerSGD_iter=START_ITER)
        model.register_comm_hook(state, torch_powersgd.powerSGD_hook)
        return lambda steps: (4.0 * state.total_numel_after_compression, 0.0)
    state = register(model, method, **options)

    def totals(steps):
        t = state.stats.state_dict()["totals"]
        return t["wire_bytes"], t["compress_s"] + t["decompress_s"] + t["comm_s"]
    return totals


def _worker(rank, world, model_name, rounds, steps_per_round):
    build, make_batch, batch_size = MODELS[model_name]
    models, optimizers, totals = {}, {}, {}
    for label, (method, options) in VARIANTS.items():
        torch.manual_seed(0)
        net = build()
        model = DDP(net, bucket_cap_mb=4 * count_parameters(net) / 2**20 + 1)
        totals[label] = _attach(model, method, options)
        models[label], optimizers[label] = model, torch.optim.SGD(model.parameters(), lr=0.01)
    batch = make_batch(torch.Generator().manual_seed(rank), batch_size)
    before = {}
    times = interleaved_step_times(models, optimizers, batch, rounds, steps_per_round,
                                   lambda: before.update({label: totals[label](WARMUP_STEPS) for label in VARIANTS}))
    timed = rounds * steps_per_round
    params = count_parameters(models["ddp default"].module)
    out = {"model": model_name, "parameters": params, "batch_per_rank": batch_size, "variants": {}}
    for label, (method, options) in VARIANTS.items():
        wire, hook_s = (after - first for after, first in
                        zip(totals[label](WARMUP_STEPS + timed), before[label]))
        wire /= timed
        out["variants"][label] = {
            "step_s": statistics.median(times[label]),
            "wire_bytes_per_step": wire,
            "ratio": 4 * params / wire,
            "received_bytes_per_step": received_bytes(method, options, wire, world),
            "hook_s_per_step": hook_s / timed if method not in (None, "torch_fp16", "torch_powersgd") else None,
        }
    return out


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.rounds, args.steps_per_round = "gpt", 1, 1
    results = run_per_model(args.models, _worker, args.world, args.rounds, args.steps_per_round,
                            timeout_s=900)
    rows = []
    for res in results:
        baseline = res["variants"]["ddp default"]["step_s"]
        for label, v in res["variants"].items():
            rows.append([res["model"], label, f"{1e3 * v['step_s']:.1f}", f"{v['step_s'] / baseline:.2f}",
                         f"{v['wire_bytes_per_step'] / 1e3:.1f}", f"{v['ratio']:.1f}",
                         f"{v['received_bytes_per_step'] / 1e3:.1f}",
                         "" if v["hook_s_per_step"] is None else f"{1e3 * v['hook_s_per_step']:.1f}"])
    print(tabulate(rows, headers=["model", "hook", "step ms (median)", "vs ddp", "wire KB/step",
                                  "ratio", "received KB/step", "hook ms/step"]))
    return write_report(args.json, {"world_size": args.world, "rounds": args.rounds,
                                    "steps_per_round": args.steps_per_round, "results": results})


if __name__ == "__main__":
    main()
