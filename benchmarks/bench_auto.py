"""The "auto" hook against every fixed hook and no compression, same run, on emulated links.

For each link (the unshaped loopback of a private namespace, then tc-shaped rates: gradcomp.emulate),
2 Gloo ranks train the examples' ResNet-20 and GPT (examples/models.py, DDP's default buckets) under
DDP's built-in all-reduce ("none"), gradcomp's uncompressed hook ("allreduce", the Python hook
auto runs for its "none"), every fixed gradcomp hook, and auto (default policy: none, fp16,
bf16, int8; with the opt-in sign and top-k under the default quality budget; and the same on
speed alone, quality_budget=None). The variants take turns in rounds of steps (the
order rotates; bench_powersgd.interleaved_step_times), each step after a barrier; medians over the
timed steps, the slower rank's. Targets per link and model: auto within 5% of the best fixed hook
its policy allows, and at most 3% slower than none.

Then the mid-run test: GPT under auto on the unshaped loopback; after --slow-at steps the link is
shaped to --slow-gbps (tc change while training), after --restore-at steps unshaped again; it reports
the steps auto took to switch to compression and back (target: within evaluate_every steps).

    python benchmarks/bench_auto.py [--rates none,1,0.1] [--models resnet20,gpt] [--rounds 4]
        [--steps-per-round 3] [--evaluate-every 10] [--slow-at 25] [--restore-at 60] [--steps 95]
        [--json PATH] [--smoke]

Needs root with ip and tc (gradcomp.emulate); otherwise it says so and exits with status 0. Prints
the tables; writes JSON only with ``--json``. ``--smoke``: the GPT on the plain loopback (no
namespace, no shaping, so no root), one round of one step, no mid-run test (seconds; checks the
script end to end, its times mean nothing).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="none,1,0.1")
    parser.add_argument("--models", default="resnet20,gpt")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--evaluate-every", type=int, default=10)
    parser.add_argument("--slow-gbps", type=float, default=0.1)
    parser.add_argument("--slow-at", type=int, default=25)
    parser.add_argument("--restore-at", type=int, default=60)
    parser.add_argument("--steps", type=int, default=95)
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: the GPT on the plain loopback, one round of one step, no mid-run test")
    return parser


if __name__ == "__main__":  # --help and argument errors answer before torch is imported
    build_parser().parse_args()
    # the compiled CPU fast path from the first call, as a long run has it (by default gradcomp runs
    # a function eagerly until that has taken as long as compiling it: gradcomp.methods.fast)
    os.environ.setdefault("GRADCOMP_CPU_COMPILE_AFTER_S", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_powersgd import MODELS, _loss, interleaved_step_times, write_report  # noqa: E402

from gradcomp.analysis.auto import DEFAULT_POLICY, DEFAULT_QUALITY_BUDGET, allowed_labels  # noqa: E402
from gradcomp.emulate import EmulationUnavailable, ShapedLink, attach_hook, launch_ranks, \
    unavailable_reason  # noqa: E402
from gradcomp.hooks.auto import AutoState, auto_hook  # noqa: E402

OPT_IN_POLICY = (*DEFAULT_POLICY, "sign", "topk")
# label -> (method, scheme, options); "none" is DDP's built-in all-reduce
FIXED = {
    "none": None,
    "allreduce": ("none", "", {}),  # gradcomp's uncompressed hook: what auto's "none" runs
    "fp16": ("fp16", "", {}),
    "bf16": ("bf16", "", {}),
    "int8:allgather": ("int8", "allgather", {}),
    "int8:twophase": ("int8", "twophase", {}),
    "sign:allgather": ("sign", "allgather", {}),
    "sign:twophase": ("sign", "twophase", {}),
    "topk": ("topk", "", {}),
    "powersgd": ("powersgd", "", {"rank": 4}),
}
AUTO = {"auto": (DEFAULT_POLICY, DEFAULT_QUALITY_BUDGET), "auto+opt-in": (OPT_IN_POLICY, DEFAULT_QUALITY_BUDGET),
        "auto+opt-in, speed only": (OPT_IN_POLICY, None)}
"""label -> (methods, quality_budget) of each auto variant."""
ALLOWED = {label: allowed_labels(policy, budget) for label, (policy, budget) in AUTO.items()}
"""The fixed hooks each auto variant may choose among (its best is what auto is held to): the
policy's choices, less those the measured table refuses where the variant has a quality budget
(the noise ratios may refuse more during a run; those are not taken out)."""
PYTHONPATH = os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")])


def _auto(ddp, methods, budget, config) -> AutoState:
    state = AutoState(None, methods=methods, evaluate_every=config["evaluate_every"], quality_budget=budget,
                      cache=config["cache"]).bind(ddp)
    ddp.register_comm_hook(state, auto_hook)
    return state


def rate_worker(rank: int, world: int, config: dict) -> dict:
    """Inside each rank: every variant on every model, interleaved; per model the median step
    seconds by variant and each auto state's decisions."""
    out = {}
    for name in config["models"]:
        build, make_batch, batch_size = MODELS[name]
        models, autos = {}, {}
        for label in (*FIXED, *AUTO):
            torch.manual_seed(0)
            models[label] = DDP(build())
            if label in AUTO:
                autos[label] = _auto(models[label], *AUTO[label], config)
            elif FIXED[label] is not None:
                attach_hook(models[label], *FIXED[label])
        optimizers = {label: torch.optim.SGD(m.parameters(), lr=0.01) for label, m in models.items()}
        batch = make_batch(torch.Generator().manual_seed(rank), batch_size)
        times = interleaved_step_times(models, optimizers, batch, config["rounds"], config["steps_per_round"])
        out[name] = {"step_s": {label: statistics.median(t) for label, t in times.items()},
                     "decisions": {label: s.stats.decisions for label, s in autos.items()},
                     "choices": {label: sorted({c.label for c in s.choices.values()}) or ["none"]
                                 for label, s in autos.items()}}
    return out


def switch_worker(rank: int, world: int, config: dict) -> dict:
    """Inside each rank: GPT under auto for ``steps`` steps; rank 0 writes each finished step's
    number to ``progress`` (the parent changes the link meanwhile). Per step: seconds, choice."""
    build, make_batch, batch_size = MODELS["gpt"]
    torch.manual_seed(0)
    ddp = DDP(build())
    state = _auto(ddp, *AUTO["auto"], config)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = make_batch(torch.Generator().manual_seed(rank), batch_size)
    steps = []
    for step in range(config["steps"]):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        _loss(ddp, x, y).backward()
        optimizer.step()
        choice = sorted({c.label for c in state.choices.values()}) or ["none"]
        steps.append({"step": step, "s": time.perf_counter() - start, "choice": "+".join(choice)})
        if rank == 0:
            Path(config["progress"]).write_text(str(step))
    return {"steps": steps, "decisions": state.stats.decisions}


def _slowest_medians(results: list[dict], model: str) -> dict:
    return {label: max(r[model]["step_s"][label] for r in results) for label in results[0][model]["step_s"]}


def run_rates(args, config, shaped: bool = True) -> list[dict]:
    """Rows per link rate, model and auto policy; ``shaped=False``: the host's loopback as it is
    (no namespace: args.rates must be [None])."""
    rows = []
    for rate in args.rates:
        started = time.time()
        with ShapedLink(rate) if shaped else contextlib.nullcontext() as link:
            results = launch_ranks("bench_auto:rate_worker", 2, config, link=link, timeout_s=900,
                                   env={"PYTHONPATH": PYTHONPATH})
        for model in args.models:
            medians = _slowest_medians(results, model)
            none = medians["none"]
            for label, policy in ALLOWED.items():
                best = min(policy, key=medians.get)
                rows.append({"link": "unshaped" if rate is None else f"{rate:g} Gbit/s", "model": model,
                             "auto": label, "auto_choice": results[0][model]["choices"][label],
                             "auto_s": medians[label], "best_fixed": best, "best_fixed_s": medians[best],
                             "none_s": none, "vs_best": medians[label] / medians[best],
                             "vs_none": medians[label] / none, "step_s": medians,
                             "decisions": results[0][model]["decisions"][label]})
        print(f"link {'unshaped' if rate is None else f'{rate:g} Gbit/s'}: {time.time() - started:.0f} s", flush=True)
    return rows


def run_switch(args, config) -> dict:
    """The mid-run test; the steps at which the link changed and at which auto followed."""
    progress = Path(tempfile.mkdtemp(prefix="gradcomp-auto-")) / "progress"
    progress.write_text("-1")
    config = {**config, "steps": args.steps, "progress": str(progress)}
    changed, box = {}, {}
    with ShapedLink(None) as link:
        runner = threading.Thread(target=lambda: box.update(results=launch_ranks(
            "bench_auto:switch_worker", 2, config, link=link, timeout_s=900, env={"PYTHONPATH": PYTHONPATH})))
        runner.start()
        while runner.is_alive():
            step = int(progress.read_text() or -1)
            if "slowed" not in changed and step + 1 >= args.slow_at:
                link.set_rate(args.slow_gbps)
                changed["slowed"] = step + 1
            if "restored" not in changed and step + 1 >= args.restore_at:
                link.set_rate(None)
                changed["restored"] = step + 1
            time.sleep(0.005)
        runner.join()
    steps = box["results"][0]["steps"]

    def first(after, compressed):
        return next((s["step"] for s in steps if s["step"] >= after and (s["choice"] != "none") == compressed), None)

    compressed_at = first(changed["slowed"], True)
    uncompressed_at = first(changed["restored"], False) if "restored" in changed else None
    return {**changed, "slow_gbps": args.slow_gbps, "evaluate_every": args.evaluate_every,
            "compressed_at": compressed_at, "uncompressed_at": uncompressed_at,
            "steps_to_compress": None if compressed_at is None else compressed_at - changed["slowed"],
            "steps_to_restore": None if uncompressed_at is None else uncompressed_at - changed["restored"],
            "steps": steps, "decisions": box["results"][0]["decisions"]}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args.rates, args.models, args.rounds, args.steps_per_round = "none", "gpt", 1, 1
    args.rates = [None if r.strip().lower() == "none" else float(r) for r in args.rates.split(",")]
    args.models = args.models.split(",")
    reason = None if args.smoke else unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    cache = Path(tempfile.mkdtemp(prefix="gradcomp-auto-cache-")) / "costs.json"  # measured once per run
    config = {"models": args.models, "rounds": args.rounds, "steps_per_round": args.steps_per_round,
              "evaluate_every": args.evaluate_every, "cache": str(cache)}
    started, load = time.time(), os.getloadavg()
    try:
        rows = run_rates(args, config, shaped=not args.smoke)
        switch = None if args.smoke else run_switch(args, config)
    except EmulationUnavailable as exc:
        print(f"skipped: {exc}")
        return 0
    print(tabulate([[r["link"], r["model"], r["auto"], ",".join(r["auto_choice"]), f"{1e3 * r['auto_s']:.1f}",
                     r["best_fixed"], f"{1e3 * r['best_fixed_s']:.1f}", f"{1e3 * r['none_s']:.1f}",
                     f"{r['vs_best']:.3f}", f"{r['vs_none']:.3f}",
                     "yes" if r["vs_best"] <= 1.05 and r["vs_none"] <= 1.03 else "no"] for r in rows],
                   headers=["link", "model", "auto", "chose", "auto ms", "best fixed", "best ms", "none ms",
                            "vs best", "vs none", "targets met"]))
    labels = list(rows[0]["step_s"])
    print()
    print(tabulate([[r["link"], r["model"]] + [f"{1e3 * r['step_s'][label]:.1f}" for label in labels]
                    for r in rows if r["auto"] == "auto"], headers=["link", "model"] + labels))
    if switch is None:
        print("\nmid-run: not run (--smoke)")
    else:
        print(f"\nmid-run: link slowed to {switch['slow_gbps']:g} Gbit/s before step {switch['slowed']}, "
              f"auto compressed from step {switch['compressed_at']} ({switch['steps_to_compress']} steps); "
              f"restored before step {switch.get('restored')}, uncompressed from step "
              f"{switch['uncompressed_at']} ({switch['steps_to_restore']} steps); "
              f"evaluate_every {switch['evaluate_every']}")
    write_report(args.json, {"rates": [r if r is not None else "unshaped" for r in args.rates],
                             "rounds": args.rounds, "steps_per_round": args.steps_per_round,
                             "rows": rows, "switch": switch, "wall_s": time.time() - started,
                             "load_before": load, "load_after": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
