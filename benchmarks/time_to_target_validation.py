"""Validate the analyser's time to target (step time x steps factor) against measured training.

    python benchmarks/time_to_target_validation.py calibrate --models resnet20 gpt --links none 1 0.1
    python benchmarks/time_to_target_validation.py calibrate --what quality --models resnet20 gpt
    python benchmarks/time_to_target_validation.py report --json docs/results/time-to-target/report.json
    python benchmarks/time_to_target_validation.py --smoke [--json PATH]   # seconds: the pipeline, tiny GPT

The check, per workload (the byte-level GPT with AdamW, ResNet-20 with SGD; examples/experiment.py,
4 ranks), emulated link (0.1 Gbit/s, 1 Gbit/s, unshaped) and method:

- **measured time to target** = the measured steps to target x the step time measured over that
  link. Steps to target: the full runs under docs/results/<model>/<config>/seed<k> against the
  uncompressed run of the same seed, by gradcomp.analysis.quality's one rule (target: the
  uncompressed run's final held-out loss + the tolerance of the workload's quality calibration,
  1% or its null's spread: :func:`target_of`; the first held-out evaluation at or below it;
  ``steps_factor``). Step time: the first 30 steps of the same configuration over the link
  (docs/results/auto/<model>/link-<rate>/<config>/steps.csv, benchmarks/auto_quality.py ``run
  --what links``), each step at the median of its block of 10 and steps past them at the
  median of their second half
  (examples/time_to_loss.seconds_to_step). Several seeds: the median of the seeds' times, "not
  reached" counting as the largest (quality.median_factor's rule).
- **predicted time to target** = the analyser's step time x the steps factor of a short quality
  calibration x the uncompressed run's steps to target. The step time: costmodel.simulate on a
  calibration of this machine that reads none of the link runs (``calibrate``: one launch of the
  workload's ranks per link, inside the shaped namespace, that sweeps the collectives and times
  each configuration's compute and hook, as benchmarks/breakeven_validation.py calibrates in
  place; its functions model it; the compute and DDP's averaging pass, the same work under every
  configuration, pooled over them: :func:`pooled_work`). The steps factor: the quality calibration files (``gradcomp
  calibrate --quality``: 100 of the GPT's 750 steps, 55 of ResNet-20's 110), looked up as
  ``gradcomp breakeven --quality FILE`` looks a choice up, with no fallback to gradcomp's own table
  (it is made of the full runs checked here). The uncompressed run's steps to target is the
  question's unit (how long the user trains uncompressed), not a prediction: on the uncompressed
  row the check is of the step time alone.
- **the null** (benchmarks/auto_quality.py NULL): uncompressed again with another bucket layout,
  measured as the rows are and set against uncompressed's prediction, never scored: what the
  measured side says of uncompressed training against itself.
- **agreement**: within 25% (|predicted / measured - 1| <= 0.25); a calibration that says "not
  reached" has no finite time and agrees only with a measured "not reached"; a configuration with
  no calibration row is "quality unmeasured", counted, never dropped. **Best**: the predicted
  fastest to target is the measured fastest, or its measured time within 10% of it.

``calibrate`` writes one small JSON per model and link under docs/results/time-to-target/
calibration/ and skips what is there (resumable); ``--what quality`` runs ``gradcomp calibrate
--quality`` for the configurations the shipped calibration files lack (int4, PowerSGD rank 1 and
2), with the same steps, seeds and ranks, into docs/results/time-to-target/quality/. Shaped links
need root with ip and tc (gradcomp.emulate.ShapedLink); unshaped runs on the plain loopback, as the
measured link runs did. ``--smoke``: the real calibration code (a tiny GPT, 2 ranks, unshaped, one
repeat) and the real report code on synthetic measured files, all in a temporary folder; its
numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
OUT = RESULTS / "time-to-target"
LINKS = ("none", "1", "0.1")
MODELS = ("gpt", "resnet20")
WITHIN = 0.25
BEST_WITHIN = 0.10
QUALITY_FILES = {"gpt": RESULTS / "quality-calibration" / "gpt-100steps.json",
                 "resnet20": RESULTS / "quality-calibration" / "resnet20-55steps.json"}
"""The shipped short quality calibrations (docs/breakeven.md: their limits)."""
SMOKE_FLAGS = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--context", "32", "--corpus-mb", "0.2",
               "--eval-windows", "8", "--batch-size", "4"]
SMOKE_CONFIGS = ("none", "int8", "topk-1pct", "powersgd-r1")


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: calibrate a tiny GPT on 2 unshaped ranks and report on synthetic runs, "
                             "in a temporary folder")
    parser.add_argument("--json", type=Path, help="--smoke: write its report here")
    commands = parser.add_subparsers(dest="command")
    cal = commands.add_parser("calibrate", help="the calibrations the prediction reads (skips what is done)",
                              allow_abbrev=False)
    cal.add_argument("--what", choices=("timing", "quality"), default="timing",
                     help="timing: per model and link, the network sweep and each configuration's compute and "
                          "hook costs; quality: gradcomp calibrate --quality for the configurations the shipped "
                          "calibration files lack")
    cal.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    cal.add_argument("--links", nargs="+", default=list(LINKS), help="Gbit/s, or none (unshaped)")
    cal.add_argument("--world-size", type=int, default=4)
    cal.add_argument("--repeats", type=int, default=5, help="timed repeats per calibration point (median)")
    cal.add_argument("--out", type=Path, default=OUT, help=f"default {OUT.relative_to(ROOT)}")
    cal.add_argument("--configs", nargs="+", default=None, help="configurations (default: every linked one)")
    cal.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                     help="flags passed on to examples/experiment.py's workload (last)")
    rep = commands.add_parser("report", help="the table, the goals, and the JSON", allow_abbrev=False)
    rep.add_argument("--json", type=Path, help="write the report here")
    rep.add_argument("--markdown", action="store_true",
                     help="also print one summary row per model and link as a markdown table")
    rep.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    rep.add_argument("--links", nargs="+", default=list(LINKS))
    rep.add_argument("--calibrations", type=Path, default=OUT, help=f"default {OUT.relative_to(ROOT)}")
    rep.add_argument("--results", type=Path, default=RESULTS, help="full runs: RESULTS/<model>/<config>/seed<k>")
    rep.add_argument("--link-runs", type=Path, default=RESULTS / "auto",
                     help="link runs: LINK_RUNS/<model>/link-<rate>/<config>/steps.csv")
    rep.add_argument("--quality", nargs="+", type=Path, default=None,
                     help="quality calibration files, first match wins (default: the shipped ones, then "
                          "CALIBRATIONS/quality/<model>-extra.json)")
    rep.add_argument("--configs", nargs="+", default=None, help="configurations (default: every linked one)")
    return parser


if __name__ == "__main__":  # --help and argument errors answer before torch is imported
    build_parser().parse_args()

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.auto_quality import BLOCK, FIXED, NULL, NULL_WHAT, link_folder  # noqa: E402
from benchmarks.breakeven_validation import launch_config, launch_links, network_for, run_profile, \
    sync_wait  # noqa: E402
from examples.time_to_loss import seconds_to_step  # noqa: E402
from gradcomp.analysis import Choice, Scenario, simulate  # noqa: E402
from gradcomp.analysis.calibrate import ranks_per_core  # noqa: E402
from gradcomp.analysis.models import ModelSpec, Parameter  # noqa: E402
from gradcomp.analysis.profile import Compute, LinearCost  # noqa: E402
from gradcomp.analysis.quality import TARGET_RULE, TARGET_TOLERANCE, Evidence, Run, StepsFactor, load_table, \
    median_factor, read_curve, rows_from_runs, tolerance_text  # noqa: E402


# ---- configurations ----------------------------------------------------------------------------

def choice_of(config: str) -> Choice:
    """The analyser's Choice of an examples/experiment.py configuration name (its hook at its
    default scheme, error feedback as the runner sets it: on for every method that has it)."""
    from examples.experiment import parse_config

    flags = parse_config(config)
    if "--no-ef" in flags:
        raise ValueError(f"{config}: the validation prices the hooks with error feedback (as breakeven does)")
    values = dict(zip(flags[::2], flags[1::2]))
    method = values["--hook"]
    options = {"ratio": float(values["--ratio"])} if method == "topk" else \
        {"rank": int(values["--rank"])} if method == "powersgd" else {}
    return Choice(method, options)


def rate_value(rate: str) -> float | None:
    if rate == "none":
        return None
    value = float(rate)
    if not value > 0:
        raise ValueError(f"a link rate is > 0 Gbit/s or none, got {rate!r}")
    return value


# ---- the calibration (inside each rank) ---------------------------------------------------------

class _Update:
    """A step's update as examples/experiment.py runs it (gradient clipping for AdamW, the
    optimizer, the schedule), shaped as the optimizer calibrate.measure_compute drives."""

    def __init__(self, module, optimizer, scheduler, clip: bool):
        self.module, self.optimizer, self.scheduler, self.clip = module, optimizer, scheduler, clip

    def step(self):
        import torch

        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _task(model: str, world_size: int, rank: int, extra: list[str]):
    """examples/experiment.py's Task and resolved arguments for ``model`` (its defaults)."""
    import torch

    from examples import experiment

    args = experiment.build_parser().parse_args(["run", "--model", model, "--out", os.devnull,
                                                 "--world-size", str(world_size), *extra])
    args = experiment.resolve_defaults(args)
    return experiment.Task(args, torch.device("cpu"), rank, world_size), args


def calibration_worker(rank: int, world_size: int, config: dict) -> dict:
    """Inside each rank (gradcomp.emulate.launch_ranks): what train_worker calibrates in place for
    benchmarks/breakeven_validation.py, on examples/experiment.py's workload as it trains (its
    model, batches, loss, optimizer with clipping and schedule; DDP's default buckets): the
    collective sweep over the launch's link, the collective's wait for the slowest rank, then per
    configuration, ranks in waves of the host's cores, the compute (forward with the batch's
    making, backward, update), DDP's averaging pass and the hook's compress/decompress. No
    training is timed. The result has train_worker's form (one round per configuration)."""
    import copy
    import itertools
    from types import SimpleNamespace

    from examples import experiment
    from gradcomp.analysis import calibrate, from_module
    from gradcomp.emulate import hook_options
    from gradcomp.hooks.calibrate import measure_method
    from gradcomp.methods import UNCOMPRESSED

    task, args = _task(config["model"], world_size, rank, config["extra"])
    spec = from_module(task.model, config["model"])
    # the sweep's and the hooks' sizes as breakeven_validation sizes them, on the runner's buckets
    # (experiment.py gives DDP no cap: its default)
    sizing = launch_config(SimpleNamespace(workload=config["model"], batch_size=args.batch_size,
                                           bucket_mb=args.bucket_mb, warmup=0, steps=0, budget_s=0,
                                           rounds=1, repeats=config["repeats"], nodes=1), [], spec, config["rate"])
    repeats, sizes = config["repeats"], sizing["calibrate"]["sizes"]
    result = {"rank": rank, "cpus": calibrate.host_cores(), "calibration": {},
              "network": {"sizes": sizing["calibrate"]["network_sizes"],
                          **calibrate.sweep_collectives(sizing["calibrate"]["network_sizes"], repeats)}}
    counter = itertools.count()

    def loss_fn(module, _batch):  # the batch's making counts as forward, as in the runner's step
        return task.loss(module, *task.batch(next(counter)))

    def step():
        loss_fn(task.model, None).backward()

    result["sync_wait"] = calibrate.measure_sync_wait(
        [lambda: loss_fn(task.model, None), step, lambda: (step(), step())]).__dict__
    alone = calibrate.single_rank_groups()

    def build():  # (module, batch, loss_fn) for a hook timed on the model's own buckets (PowerSGD)
        module = copy.deepcopy(task.model)
        return module, task.batch(0), lambda m, batch: task.loss(m, *batch)

    for label, method, _scheme, options in config["runs"]:
        def measure(method=method, options=options):
            module = copy.deepcopy(task.model)
            optimizer, scheduler = experiment.build_optimizer(
                SimpleNamespace(model=module, total_steps=task.total_steps), args)
            update = _Update(module, optimizer, scheduler, clip=args.optimizer == "adamw")
            measured = {"compute": calibrate.measure_compute(module, None, loss_fn, repeats, name=config["model"],
                                                             optimizer=update, group=alone).__dict__,
                        "average": calibrate.measure_average(sizes, repeats).__dict__}
            if method != UNCOMPRESSED:
                cost = measure_method(method, sizes, repeats, alone, build, args.bucket_mb,
                                      **hook_options(method, options))
                measured["method"] = {"compress": cost.compress.__dict__, "decompress": cost.decompress.__dict__}
            return measured

        result["calibration"][label] = [calibrate.in_waves(measure)]
    if rank == 0:
        result["parameters"] = [[p.name, list(p.shape)] for p in spec.parameters]
    return result


def calibration_path(out: Path, model: str, rate: str) -> Path:
    return out / "calibration" / model / f"{link_folder(rate)}.json"


def calibrate_timing(args, model: str, rate: str, configs: list[str], extra: list[str], smoke: bool = False) -> Path:
    """One launch of ``args.world_size`` ranks of ``model`` over the link at ``rate`` (none: the
    plain loopback, as the measured link runs), written to its calibration file; skipped when that
    file exists."""
    import contextlib

    from gradcomp.emulate import EmulationUnavailable, ShapedLink, launch_ranks

    path = calibration_path(args.out, model, rate)
    if path.is_file():
        print(f"{path}: done, skipped")
        return path
    runs = []
    for config in configs:
        choice = choice_of(config)
        runs.append([config, choice.method, choice.scheme, choice.options])
    config = {"model": model, "extra": extra, "runs": runs, "repeats": args.repeats, "rate": rate_value(rate)}
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    started = time.time()
    link = contextlib.nullcontext() if rate == "none" else ShapedLink(rate_value(rate))
    try:
        with link as shaped:
            results = launch_ranks("benchmarks.time_to_target_validation:calibration_worker", args.world_size,
                                   config, link=shaped, timeout_s=3600, env=env)
    except EmulationUnavailable as exc:
        print(f"{model} link {rate}: skipped: {exc}")
        return path
    record = {"model": model, "link_gbps": rate_value(rate), "world_size": args.world_size, "configs": configs,
              "extra": extra, "repeats": args.repeats, "seconds": round(time.time() - started, 1),
              "load_average": os.getloadavg()[0], "smoke": smoke,
              "command": " ".join(["python benchmarks/time_to_target_validation.py calibrate --models", model,
                                   "--links", rate, "--world-size", str(args.world_size), "--repeats",
                                   str(args.repeats), "--configs", *configs, *(["--extra", *extra] if extra else [])]),
              "parameters": results[0].pop("parameters"), "ranks": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    print(f"{model} link {rate}: {record['seconds']:.0f} s -> {path}")
    return path


def quality_candidates(model: str, configs: list[str], files: list[Path]) -> list[str]:
    """``gradcomp calibrate --quality`` candidates of the ``configs`` no row of ``files`` covers."""
    missing = []
    for config in configs:
        choice = choice_of(config)
        if choice.method == "none" or predicted_factor(model, choice, files)[0] is not None:
            continue
        options = ",".join(f"{k}={v}" for k, v in choice.options.items())
        scheme = f":{choice.scheme}" if ":" in choice.label else ""
        missing.append(choice.method + scheme + (f",{options}" if options else ""))
    return missing


def resnet20_distort8_workload() -> dict:
    """``gradcomp calibrate --quality --model benchmarks.time_to_target_validation:resnet20_distort8_workload``:
    ResNet-20 on distorted digits as ``examples/experiment.py --digits-distort 8`` trains it on 4
    ranks (docs/results/distort8): the check on a third workload (docs/breakeven.md)."""
    from gradcomp.emulate.quality import resnet20_workload

    return resnet20_workload(world_size=4, distort_copies=8)


def quality_command(model: str, candidates: list[str], out: Path) -> list[str]:
    """The ``gradcomp calibrate --quality`` flags of the extra calibration: the shipped file's
    steps, evaluation interval, seeds and ranks."""
    shipped = json.loads(QUALITY_FILES[model].read_text())["calibration"]
    return ["calibrate", "--quality", "--model", model, "--world-size", str(shipped["world_size"]),
            "--steps", str(shipped["steps"]), "--eval-every", str(shipped["eval_every"]),
            "--seeds", *map(str, shipped["seeds"]), "--candidates", *candidates, "--out", str(out)]


def run_calibrate(args) -> None:
    from gradcomp.emulate import unavailable_reason

    for model in args.models:
        configs = args.configs or list(FIXED[model])
        if args.what == "quality":
            out = args.out / "quality" / f"{model}-extra.json"
            candidates = quality_candidates(model, configs, [QUALITY_FILES[model]])
            if out.is_file() or not candidates:
                print(f"{out}: {'done' if out.is_file() else 'nothing to calibrate'}, skipped")
                continue
            from gradcomp.cli import main as gradcomp_main

            out.parent.mkdir(parents=True, exist_ok=True)
            flags = quality_command(model, candidates, out)
            print("+ gradcomp", " ".join(flags), flush=True)
            if gradcomp_main(flags) != 0:
                raise SystemExit(f"gradcomp {' '.join(flags)} failed")
            continue
        for rate in args.links:
            rate_value(rate)
            reason = unavailable_reason() if rate != "none" else None
            if reason:
                print(f"{model} link {rate}: skipped: {reason}")
                continue
            calibrate_timing(args, model, rate, configs, args.extra)


# ---- the prediction -----------------------------------------------------------------------------

def predicted_factor(model: str, choice: Choice, files: list[Path]) -> tuple[StepsFactor | None, dict | None]:
    """The steps factor of ``choice`` in the first of the quality calibration ``files`` that has a
    row for it (gradcomp.analysis.quality.Evidence.lookup: what ``breakeven --quality FILE`` finds,
    without gradcomp's own table, which holds the full runs); (None, None): quality unmeasured.
    The uncompressed run is the reference: factor 1."""
    if choice.method == "none":
        return StepsFactor(1.0, True, 1.0), {"file": None, "row": "the reference (factor 1 by definition)"}
    for path in files:
        if not Path(path).is_file():
            continue
        table = load_table(path)
        family = table.get("calibration", {}).get("optimizer_family")
        match = Evidence(family, {}, table, str(path)).lookup(
            "hook", choice.method, choice.options, choice.scheme,
            None if choice.method in ("fp16", "bf16") else True)
        if match is not None:
            row = match.row
            calibration = table.get("calibration", {})
            return match.factor, {"file": _rel(path), "row": row.get("config"), "exact": match.exact,
                                  "note": match.note, "basis": row.get("basis", "curves"),
                                  "noise_ratio": (row.get("noise_ratio") or {}).get("median"),
                                  "curve_factor": row.get("curve_factor", row["steps_factor"]),
                                  "seeds": row.get("seeds"), "spread": row.get("spread"),
                                  "steps": calibration.get("steps"), "world_size": calibration.get("world_size"),
                                  "per_seed": [{k: s.get(k) for k in ("seed", "value", "reached", "steps",
                                                                     "baseline_steps", "final_gap")}
                                               for s in row.get("per_seed", [])]}
    return None, None


def target_of(files: list[Path]) -> tuple[float, str]:
    """The target's tolerance and rule of the first quality calibration file there (a calibration
    sets it from its own null: gradcomp.analysis.quality.null_tolerance; a file without one, 1%):
    the measured side answers the question the prediction does."""
    for path in files:
        if Path(path).is_file():
            table = load_table(path)
            return table.get("target_tolerance", TARGET_TOLERANCE), table.get("target_rule", TARGET_RULE)
    return TARGET_TOLERANCE, TARGET_RULE


def _rel(path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def predicted_steps(calibration: dict, host: dict | None) -> dict[str, float]:
    """The analyser's step seconds of each configuration the ``calibration`` (one launch's file)
    timed: costmodel.simulate on that launch's links and costs, as
    benchmarks/breakeven_validation.py predicts each run (its functions: the profile of the run's
    own calibration, the launch's links with the unshaped launch's host share, CPU contention,
    the ranks per core and the measured wait for the slowest rank). The compute and DDP's averaging
    pass are the same work under every configuration (the same model, batches and optimizer; the
    hook is timed apart), so each configuration's measurement of them is a sample of one quantity:
    every configuration takes the median over all of them (:func:`pooled_work`), not its own."""
    results, world = calibration["ranks"], calibration["world_size"]
    spec = ModelSpec(calibration["model"], tuple(Parameter(n, tuple(s)) for n, s in calibration["parameters"]))
    links = launch_links(results, world, None)
    host_links = launch_links(host["ranks"], world, None) if host is not None else None
    per_core = ranks_per_core(world, results[0].get("cpus"))
    wait = sync_wait(results)
    compute, average = pooled_work(calibration)
    steps = {}
    for config in calibration["configs"]:
        choice = choice_of(config)
        # run_profile reads a run's calibration under its Choice label: one configuration at a time
        view = [{**r, "calibration": {choice.label: r["calibration"][config]}} for r in results]
        profile = replace(run_profile(view, world, choice.label, 0), compute=compute, average=average)
        network = network_for(choice, links, world, None, host_links)
        scenario = Scenario(spec, network, profile, profile.compute, None, host_contends=True,
                            ranks_per_core=per_core, sync_wait=wait)
        steps[config] = simulate(scenario, choice).step_s
    return steps


def pooled_work(calibration: dict) -> tuple[Compute, LinearCost]:
    """The compute (forward, backward, optimizer seconds) and DDP's averaging pass of a launch: each
    the median over every configuration's and rank's measurement of it."""
    measured = [c for r in calibration["ranks"] for config in calibration["configs"]
                for c in r["calibration"][config]]
    compute = Compute(*(statistics.median(c["compute"][k] for c in measured)
                        for k in ("forward_s", "backward_s", "optimizer_s")))
    average = LinearCost(*(statistics.median(c["average"][k] for c in measured) for k in ("fixed_s", "per_element_s")))
    return compute, average


# ---- the measurement ----------------------------------------------------------------------------

def finished_runs(folder: Path) -> list[Run]:
    """The finished runs (summary.json present) under ``folder``/seed*/."""
    runs = []
    for seed_dir in sorted(folder.glob("seed*")):
        if (seed_dir / "summary.json").is_file() and (seed_dir / "evals.csv").is_file():
            runs.append(Run(int(seed_dir.name[4:]), read_curve(seed_dir / "evals.csv"), (_rel(seed_dir),)))
    return runs


def measured_side(results: Path, link_runs: Path, model: str, rate: str, config: str,
                  folder: Path | None = None, tolerance: float = TARGET_TOLERANCE) -> dict:
    """Measured steps to target (each seed against the uncompressed run of its seed, the target
    ``tolerance`` above its final loss: quality.rows_from_runs, the analyser's rule), each priced
    over ``config``'s link run (each step at its block's median, as benchmarks/auto_quality.py
    prices them: time_to_loss.seconds_to_step),
    and the median over seeds (not reached: the largest). The runs: ``folder`` (default
    ``results``/model/config)."""
    from examples.experiment import read_csv

    baseline = finished_runs(results / model / "none")
    runs = [r for r in finished_runs(folder or results / model / config) if r.seed in {b.seed for b in baseline}]
    link_file = link_runs / model / link_folder(rate) / config / "steps.csv"
    link_steps = read_csv(link_file)
    out = {"runs": [f for r in runs for f in r.files], "link_run": _rel(link_file) if link_steps else None,
           "link_steps": len(link_steps)}
    if link_steps:
        tail = link_steps[len(link_steps) - max(len(link_steps) // 2, 1):]
        out["step_s"] = statistics.median(r["step_s"] for r in tail)
    if not baseline or not runs:
        return {**out, "status": "no full run"}
    row = rows_from_runs({}, baseline, runs, tolerance=tolerance)
    per_seed = []
    for s in row["per_seed"]:
        seconds = seconds_to_step(link_steps, s["steps"], block=BLOCK) if link_steps and s["reached"] else None
        per_seed.append({"seed": s["seed"], "steps": s["steps"], "reached": s["reached"], "within": s["within"],
                         "baseline_steps": s["baseline_steps"], "target": s["target"], "seconds": seconds})
    factor = median_factor([StepsFactor.from_dict(s) for s in row["per_seed"]])
    out.update(per_seed=per_seed, steps_factor=factor.to_dict(),
               steps=_median_or_none([s["steps"] if s["reached"] else None for s in per_seed]),
               baseline_steps=statistics.median(s["baseline_steps"] for s in per_seed),
               status="reached" if factor.reached else "not reached", within=factor.within)
    if not link_steps:
        out["status_time"] = "no link run"
        return out
    out["time_s"] = _median_or_none([s["seconds"] for s in per_seed])
    return out


def _median_or_none(values: list) -> float | None:
    """The median with None counted as the largest (not reached); None when the median is."""
    middle = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(middle) else middle


# ---- agreement and scoring ----------------------------------------------------------------------

AGREE = ("within", "both not reached")


def agreement(predicted: dict, measured: dict) -> tuple[str, float | None]:
    """(how a prediction and a measurement of time to target agree, predicted / measured)."""
    if predicted["status"] in ("quality unmeasured", "no calibration"):
        return f"no prediction ({predicted['status']})", None
    if measured.get("status") in (None, "no full run"):
        return "no measurement (no full run)", None
    p_reached, m_reached = predicted["status"] == "reached", measured["status"] == "reached"
    if not p_reached and not m_reached:
        return "both not reached", None
    if not p_reached:
        return "predicted not reached, measured reached", None
    if not m_reached:
        return "predicted reached, measured not reached", None
    if measured.get("time_s") is None:
        return "no measurement (no link run)", None
    ratio = predicted["time_s"] / measured["time_s"]
    return ("within" if abs(ratio - 1) <= WITHIN else "outside"), ratio


def best_check(rows: list[dict], key: str = "predicted") -> dict:
    """The predicted fastest to target (finite time) against the measured fastest: met when its
    measured time is the best's or within BEST_WITHIN of it."""
    predicted = [(r[key]["time_s"], r["config"]) for r in rows if r[key].get("time_s") is not None]
    measured = {r["config"]: r["measured"].get("time_s") for r in rows}
    finite = [(t, c) for c, t in measured.items() if t is not None]
    if not predicted or not finite:
        return {"predicted_best": min(predicted)[1] if predicted else None,
                "measured_best": min(finite)[1] if finite else None, "met": None,
                "why": "no finite predicted time" if not predicted else "no finite measured time"}
    pick, best = min(predicted)[1], min(finite)
    over = None if measured.get(pick) is None else measured[pick] / best[0]
    return {"predicted_best": pick, "measured_best": best[1], "measured_best_s": best[0],
            "predicted_best_measured_s": measured.get(pick), "over_measured_best": over,
            "met": over is not None and over <= 1 + BEST_WITHIN}


def score(rows: list[dict], key: str = "predicted") -> dict:
    """Counts of each agreement of ``rows[i][key]`` with the measurement, and the best check."""
    counts: dict[str, int] = {}
    for r in rows:
        kind = agreement(r[key], r["measured"])[0]
        counts[kind] = counts.get(kind, 0) + 1
    agreed = sum(counts.get(k, 0) for k in AGREE)
    best = best_check(rows, key)
    return {"rows": len(rows), "agree": agreed, "counts": counts, "best": best,
            "met": agreed == len(rows) and bool(best["met"])}


REFERENCES = {
    "step time only": "every steps factor 1 (the analyser before time to target: a verdict on step time)",
    "always uncompressed": "uncompressed the best: every compressed method ruled out ('not reached'), "
                           "uncompressed at the analyser's step time",
    "measured step x calibration factor": "the measured step time with the calibration's factor: what the "
                                          "quality side alone scores (reads the link runs: a diagnostic)",
    "predicted step x measured factor": "the analyser's step time with the full runs' factor: what the "
                                        "step-time side alone scores (reads the full runs: a diagnostic)",
}


def reference_rows(rows: list[dict], n0: float | None) -> dict[str, list[dict]]:
    """The rows again with each reference predictor's time in ``predicted`` (REFERENCES)."""
    out = {name: [] for name in REFERENCES}
    for r in rows:
        m, p = r["measured"], r["predicted"]
        step_pred = p.get("step_s")

        def timed(step, factor, status):
            if status != "reached":
                return {"status": status}
            if step is None or n0 is None:
                return {"status": "no calibration"}
            return {"status": "reached", "time_s": step * factor * n0}

        out["step time only"].append({**r, "predicted": timed(step_pred, 1.0, "reached")})
        none = r["config"] == "none"
        out["always uncompressed"].append(
            {**r, "predicted": timed(step_pred, 1.0, "reached") if none else {"status": "not reached"}})
        out["measured step x calibration factor"].append(
            {**r, "predicted": timed(m.get("step_s"), p.get("steps_factor"), p.get("factor_status"))})
        measured_factor = (m.get("steps_factor") or {}).get("value")
        out["predicted step x measured factor"].append(
            {**r, "predicted": timed(step_pred, measured_factor, m.get("status", "no measurement"))
             if m.get("status") in ("reached", "not reached") else {"status": "no calibration"}})
    return out


# ---- the report ---------------------------------------------------------------------------------

CAN_CATCH = [
    "a step-time prediction off by more than 25% on a method both sides say reaches the target "
    "(the uncompressed row checks the step time alone: its steps are the question's unit)",
    "a calibration that rules out a method the full runs see reach the target (or the reverse): "
    "counted as a mismatch, never dropped",
    "a predicted best method whose measured time to target is more than 10% above the measured best's",
]
CANNOT_CATCH = [
    "a factor error inside the evaluation interval: steps to target move in steps of it (50 of the GPT's "
    "750 steps, 1 of ResNet-20's 110), so a factor is known to +-7% (GPT) or +-1% (ResNet-20) on each side",
    "on the GPT every compressed method but fp16 and int8 is 'not reached' in full, so its rows check "
    "only the categorical answer; a time ratio is checked on the methods that reach the target",
    "'not reached' rows carry no time: a predictor that rules out every compressed method agrees on "
    "every one the full runs rule out, and can only be caught on the ones that reach the target",
    "a predictor that always says 'uncompressed is best' passes the best-method check wherever no "
    "method is more than 10% faster to target than uncompressed (the 'always uncompressed' reference "
    "below is scored on the same rows)",
    "a difference inside the training's own noise: the null (uncompressed again, another bucket layout, "
    "fp32 rounding alone) is measured as the rows are; where it misses the target as a row does, that "
    "row's miss is not evidence against the prediction",
    "one machine, 4 CPU ranks on 2 shared cores, three links: nothing here measures a GPU cluster",
]


def load_calibration(folder: Path, model: str, rate: str) -> dict | None:
    path = calibration_path(folder, model, rate)
    return json.loads(path.read_text()) if path.is_file() else None


def report(args) -> dict:
    """Every model x link x configuration: predicted and measured time to target, agreement, the
    best-method check, and the same rows scored for the reference predictors."""
    out = {"check": "predicted vs measured time to target over emulated links (issue 47's goal)",
           "within": WITHIN, "best_within": BEST_WITHIN,
           "target_rule": "per model: the target_rule of its quality calibration (the question the prediction "
                          "answers), on the full runs",
           "predicted": "analyser step time (costmodel.simulate on this machine's calibration, no link run read) "
                        "x the quality calibration's steps factor x the uncompressed run's steps to target",
           "measured": "the full runs' steps to target (quality.steps_factor's rule, each seed against its "
                       "uncompressed run) priced at the link run's step times (time_to_loss.seconds_to_step); "
                       "median over seeds, not reached the largest",
           "can_catch": CAN_CATCH, "cannot_catch": CANNOT_CATCH, "references": REFERENCES, "models": {}}
    for model in args.models:
        configs = args.configs or list(FIXED[model])
        files = args.quality or [QUALITY_FILES[model], args.calibrations / "quality" / f"{model}-extra.json"]
        files = [Path(f) for f in files]
        host = load_calibration(args.calibrations, model, "none")
        tolerance, rule = target_of(files)
        entry = {"quality_files": [_rel(f) for f in files if f.is_file()], "target_tolerance": tolerance,
                 "target_rule": rule, "links": {}}
        for rate in args.links:
            calibration = load_calibration(args.calibrations, model, rate)
            steps = predicted_steps(calibration, host) if calibration else {}
            rows = []
            measured_of = {config: measured_side(args.results, args.link_runs, model, rate, config,
                                                 tolerance=tolerance)
                           for config in dict.fromkeys(["none", *configs])}
            uncompressed = measured_of["none"].get("baseline_steps")
            for config in configs:
                measured = measured_of[config]
                factor, source = predicted_factor(model, choice_of(config), files)
                n0 = measured.get("baseline_steps", uncompressed)  # the seeds it has, else all
                predicted = {"steps_factor": factor.value if factor else None,
                             "factor_status": ("reached" if factor.reached else "not reached") if factor
                             else "quality unmeasured",
                             "factor_within": factor.within if factor else None, "source": source,
                             "step_s": steps.get(config), "uncompressed_steps": n0}
                if factor is None:
                    predicted["status"] = "quality unmeasured"
                elif not factor.reached:
                    predicted["status"] = "not reached"
                elif steps.get(config) is None or n0 is None:
                    predicted["status"] = "no calibration"
                else:
                    predicted.update(status="reached", time_s=steps[config] * factor.value * n0)
                kind, ratio = agreement(predicted, measured)
                rows.append({"config": config, "predicted": predicted, "measured": measured,
                             "agreement": kind, "ratio": ratio,
                             "within_25pct": None if ratio is None else abs(ratio - 1) <= WITHIN})
            n0 = next((r["measured"].get("baseline_steps") for r in rows if r["config"] == "none"), None)
            references = {name: score(rs) for name, rs in reference_rows(rows, n0).items()}
            entry["links"][rate] = {"calibration": _rel(calibration_path(args.calibrations, model, rate))
                                    if calibration else None, "rows": rows, "score": score(rows),
                                    "references": references,
                                    "null": null_side(args, model, rate, rows, tolerance)}
        out["models"][model] = entry
    out["summary"] = summarize(out)
    return out


def null_side(args, model: str, rate: str, rows: list[dict], tolerance: float) -> dict | None:
    """The null configuration (benchmarks/auto_quality.py NULL: uncompressed, another bucket layout,
    fp32 rounding alone) measured as the rows are, priced at uncompressed's link run, against
    uncompressed's prediction: what the measured side says of uncompressed training against itself.
    Not a row: never scored. None without null runs."""
    none = next((r for r in rows if r["config"] == "none"), None)
    measured = measured_side(args.results, args.link_runs, model, rate, "none", folder=args.results / NULL / model,
                             tolerance=tolerance)
    if none is None or measured.get("status") == "no full run":
        return None
    kind, ratio = agreement(none["predicted"], measured)
    base = none["measured"].get("time_s")
    return {"measured": measured, "agreement": kind, "ratio": ratio,
            "over_uncompressed": None if base is None or measured.get("time_s") is None
            else measured["time_s"] / base}


def summarize(result: dict) -> dict:
    """Totals over every model and link, for the analyser and each reference."""
    def total(pick):
        counts, rows, agree, best_met, best_of, met = {}, 0, 0, 0, 0, 0
        for entry in result["models"].values():
            for link in entry["links"].values():
                s = pick(link)
                rows += s["rows"]
                agree += s["agree"]
                met += s["met"]
                best_met += bool(s["best"]["met"])
                best_of += 1
                for k, v in s["counts"].items():
                    counts[k] = counts.get(k, 0) + v
        return {"rows": rows, "agree": agree, "counts": counts, "best_met": best_met, "settings": best_of,
                "settings_met": met}

    nulls = [link["null"] for entry in result["models"].values() for link in entry["links"].values() if link.get("null")]
    return {"null": {"settings": len(nulls), "agree": sum(n["agreement"] in AGREE for n in nulls),
                     "reached": sum(n["measured"]["status"] == "reached" for n in nulls)},
            "analyser": total(lambda link: link["score"]),
            "references": {name: total(lambda link, name=name: link["references"][name]) for name in REFERENCES}}


def _num(value, digits: int = 3) -> str:
    from gradcomp.numfmt import plain

    return "-" if value is None else plain(value, digits)


def null_text(null: dict) -> str:
    """The null's measured steps per seed, its agreement with uncompressed's prediction, its
    measured time over uncompressed's."""
    over = null["over_uncompressed"]
    return (f"measured steps to target {null_steps(null)}; against uncompressed's prediction: "
            f"{null['agreement']}" + (f" ({null['ratio']:.3f})" if null["ratio"] is not None else "")
            + (f"; measured time over uncompressed's {over:.3f}" if over is not None else ""))


def print_report(result: dict) -> None:
    from tabulate import tabulate

    for model, entry in result["models"].items():
        for rate, link in entry["links"].items():
            print(f"\n{model}, link {'unshaped' if rate == 'none' else rate + ' Gbit/s'} "
                  f"(calibration: {link['calibration'] or 'not run'}; factors: {', '.join(entry['quality_files'])}; "
                  f"target: uncompressed's final held-out loss {tolerance_text(entry['target_tolerance'])})")
            body = []
            for r in link["rows"]:
                p, m = r["predicted"], r["measured"]
                factor = (f"{p['steps_factor']:.2f}x" if p["factor_status"] == "reached" else
                          f"not reached within {p['factor_within']:.3g}x" if p["factor_status"] == "not reached"
                          else "unmeasured")
                source = (p["source"] or {}).get("file")
                basis = {"noise model": "noise model, ", "noise model's floor": "noise model's floor, "}.get(
                    (p["source"] or {}).get("basis"), "")
                seeds = "/".join(str(s["steps"]) if s["reached"] else "-" for s in m.get("per_seed", []))
                body.append([r["config"], factor + (f" ({basis}{Path(source).stem})" if source else ""),
                             _num(p.get("step_s")), f"{p['time_s']:.1f}" if p["status"] == "reached" else p["status"],
                             (seeds or m.get("status", "-")) + (" (not reached)" if m.get("status") == "not reached"
                                                                else ""),
                             _num(m.get("step_s")), f"{m['time_s']:.1f}" if m.get("time_s") is not None
                             else m.get("status_time") or m.get("status", "-"),
                             _num(r["ratio"]), r["agreement"]])
            print(tabulate(body, headers=["config", "pred. steps factor", "pred. step s", "pred. s to target",
                                          "meas. steps to target (per seed)", "meas. step s", "meas. s to target",
                                          "pred./meas.", f"agreement (within {WITHIN:.0%})"]))
            s, best = link["score"], link["score"]["best"]
            counts = ", ".join(f"{k} {v}" for k, v in sorted(s["counts"].items()))
            print(f"agree: {s['agree']} of {s['rows']} ({counts}); "
                  f"best: predicted {best['predicted_best']}, measured {best['measured_best']}"
                  + (f", predicted's measured / best {best['over_measured_best']:.3f}" if best.get("over_measured_best")
                     else "") + f" (within {BEST_WITHIN:.0%}: {best['met']}); goal met: {s['met']}")
            refs = "; ".join(f"{name}: agree {v['agree']}/{v['rows']}, best {v['best']['met']}"
                             for name, v in link["references"].items())
            print(f"references on the same rows: {refs}")
            if link.get("null"):
                print(f"null ({NULL_WHAT}): {null_text(link['null'])}")
    summary = result["summary"]
    a = summary["analyser"]
    print(f"\nall settings: the analyser agrees on {a['agree']} of {a['rows']} rows "
          f"({', '.join(f'{k} {v}' for k, v in sorted(a['counts'].items()))}), best method met in "
          f"{a['best_met']} of {a['settings']} settings, goal met in {a['settings_met']} of {a['settings']}")
    for name, v in summary["references"].items():
        print(f"  reference '{name}' ({REFERENCES[name]}): agrees on {v['agree']} of {v['rows']}, best met in "
              f"{v['best_met']} of {v['settings']}")
    n = summary["null"]
    if n["settings"]:
        print(f"  the null (uncompressed against itself, fp32 rounding alone) agrees with uncompressed's prediction "
              f"in {n['agree']} of {n['settings']} settings and reaches the target in {n['reached']} of them")
    print("what this check can catch: " + "; ".join(CAN_CATCH))
    print("what it cannot: " + "; ".join(CANNOT_CATCH))


# ---- the smoke run ------------------------------------------------------------------------------

def _write_csv(path: Path, fields: list[str], rows: list[list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(",".join(fields) + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))


def write_synthetic_runs(folder: Path, model: str, curves: dict[str, list[tuple[int, float]]],
                         step_s: dict[str, list[float]], rate: str = "none", seed: int = 0) -> None:
    """Full runs (seed ``seed``: evals.csv, summary.json) and link runs (steps.csv) with the given
    held-out curves and step seconds, in the runner's file layout: what the tests and the smoke
    run report on."""
    for config, curve in curves.items():
        run = folder / "results" / model / config / f"seed{seed}"
        _write_csv(run / "evals.csv", ["step", "epoch", "heldout_loss", "heldout_accuracy"],
                   [[s, s, v, 0.5] for s, v in curve])
        (run / "summary.json").write_text("{}\n")
    for config, seconds in step_s.items():
        _write_csv(folder / "links" / model / link_folder(rate) / config / "steps.csv", ["step", "step_s"],
                   [[i + 1, s] for i, s in enumerate(seconds)])


def write_quality_file(path: Path, rows_by_config: dict[str, tuple[list, list]], family: str = "adamw") -> None:
    """A quality file as ``gradcomp calibrate --quality`` writes it (rows from
    quality.rows_from_runs: baseline and candidate curves per configuration, seed 0)."""
    rows = []
    for config, (base, curve) in rows_by_config.items():
        choice = choice_of(config)
        setting = {"front": "hook", "method": choice.method, "options": choice.options, "scheme": choice.scheme,
                   "error_feedback": None if choice.method == "fp16" else True, "optimizer": family,
                   "config": config, "steps": base[-1][0]}
        rows.append(rows_from_runs(setting, [Run(0, tuple(base))], [Run(0, tuple(curve))]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": 1, "rows": rows, "calibration": {"optimizer_family": family}}) + "\n")


def smoke(json_path: Path | None) -> dict:
    """The calibration (tiny GPT, 2 unshaped ranks, one repeat) and the report on synthetic runs,
    in a temporary folder."""
    import shutil
    import tempfile
    from types import SimpleNamespace

    folder = Path(tempfile.mkdtemp(prefix="time_to_target_"))
    try:
        cal = SimpleNamespace(out=folder / "out", world_size=2, repeats=1)
        calibrate_timing(cal, "gpt", "none", list(SMOKE_CONFIGS), SMOKE_FLAGS, smoke=True)
        # synthetic: none reaches its target (2.02) at step 40; int8 at 40 in full and 20 in the
        # calibration (a factor 0.5 against 1.0: outside); top-k never, on both sides; PowerSGD
        # rank 1 has no calibration row (quality unmeasured)
        base = [(10, 3.0), (20, 2.5), (30, 2.2), (40, 2.0), (50, 2.0)]
        curves = {"none": base, "int8": [(10, 3.0), (20, 2.6), (30, 2.3), (40, 2.01), (50, 2.0)],
                  "topk-1pct": [(10, 3.2), (20, 2.9), (30, 2.8), (40, 2.7), (50, 2.6)],
                  "powersgd-r1": [(10, 3.0), (20, 2.6), (30, 2.2), (40, 2.0), (50, 2.0)]}
        write_synthetic_runs(folder, "gpt", curves, {c: [0.2, 0.1, 0.1, 0.1] for c in curves})
        # the null (results/null/gpt/seed0): uncompressed again, ending 1.5% above: never at the target
        write_synthetic_runs(folder, NULL, {"gpt": [(10, 3.0), (20, 2.5), (30, 2.1), (40, 2.05), (50, 2.03)]}, {})
        short = [(5, 3.0), (10, 2.6), (15, 2.5), (20, 2.4)]
        write_quality_file(folder / "quality.json", {"int8": (short, [(5, 3.0), (10, 2.4), (15, 2.45), (20, 2.4)]),
                                                     "topk-1pct": (short, [(5, 3.3), (10, 3.0), (15, 2.9), (20, 2.8)])})
        args = SimpleNamespace(models=["gpt"], links=["none"], calibrations=cal.out, results=folder / "results",
                               link_runs=folder / "links", quality=[folder / "quality.json"],
                               configs=list(SMOKE_CONFIGS))
        result = report(args)
        result["smoke"] = "tiny GPT calibrated on 2 unshaped ranks; measured side and factors synthetic"
        print_report(result)
        print("\n" + markdown_summary(result))
        if json_path:
            json_path.write_text(json.dumps(result, indent=1) + "\n")
        return result
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def markdown_summary(result: dict) -> str:
    """Per model and link: the rows that agree (of all), the predicted and measured best, the
    reference predictors' agreeing rows and the null's measured steps, as a markdown table."""
    names = list(result["references"])
    lines = ["| model | link | rows agree | predicted best / measured best (its time over the best's) | "
             + " | ".join(f"{n}: rows agree" for n in names) + " | null: measured steps to target (per seed) |",
             "|" + " --- |" * (5 + len(names))]
    for model, entry in result["models"].items():
        for rate, link in entry["links"].items():
            score, best = link["score"], link["score"]["best"]
            over = best.get("over_measured_best")
            lines.append(f"| {model} | {'unshaped' if rate == 'none' else rate + ' Gbit/s'} | "
                         f"{score['agree']} of {score['rows']} | {best['predicted_best']} / {best['measured_best']} "
                         f"({'-' if over is None else f'{over:.2f}'}) | "
                         + " | ".join(f"{link['references'][n]['agree']} of {link['references'][n]['rows']}"
                                      for n in names) + f" | {null_steps(link.get('null'))} |")
    return "\n".join(lines)


def null_steps(null: dict | None) -> str:
    """The null's measured steps to target per seed (- not reached) and its status, or -."""
    if not null:
        return "-"
    m = null["measured"]
    return "/".join(str(s["steps"]) if s["reached"] else "-" for s in m["per_seed"]) + f" ({m['status']})"


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke(args.json)
    if args.command is None:
        parser.error("give a command (calibrate, report) or --smoke")
    if args.command == "calibrate":
        if args.world_size < 2:
            parser.error(f"--world-size must be >= 2, got {args.world_size}")
        return run_calibrate(args)
    result = report(args)
    print_report(result)
    if args.markdown:
        print("\n" + markdown_summary(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
