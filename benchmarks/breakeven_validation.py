"""Validate the break-even model against real DDP training on an emulated link.

For each link rate (tbf-shaped loopback in a private network namespace, and unshaped), one launch
of N Gloo ranks first calibrates in place (all-reduce/all-gather/reduce-scatter sweeps over the
shaped link, forward/backward/optimizer time, compress/decompress time of every method), then
trains a real model for a bounded number of steps under each hook. The analyser predicts every step
time from that launch's calibration alone; the crossover bandwidth is predicted from a link model
fitted over all launches (seconds per byte = per_byte + 8 / (rate * efficiency), alpha = median).
With ``--sweeps N`` every rate is launched N times (the whole sweep, then again): each point is the
median over its launches, and the measured crossover comes from the median speedups (each launch's
run against its own ``none``).

    python benchmarks/breakeven_validation.py --quick --json validation.json     # < 5 minutes
    python benchmarks/breakeven_validation.py                                   # full grid
    python benchmarks/breakeven_validation.py --sweeps 3                        # full grid, 3 launches per rate
    python benchmarks/breakeven_validation.py --smoke   # seconds: checks the script end to end
    python benchmarks/breakeven_validation.py --replay validation.json   # the model again, no training
    python benchmarks/breakeven_validation.py --published   # seconds: predict the published measurements

Needs root with ip and tc (see gradcomp.emulate); otherwise it says so and exits with status 0.
``--smoke`` needs neither: one launch on the host's plain loopback (no namespace, no shaping) of
the mlp-small workload, 1 warm-up and 1 timed step per run, one round; its errors mean nothing and
it has no crossovers (those need two shaped rates).
Compression runs eager (GRADCOMP_CPU_COMPILE=0) in the ranks unless --compile: compiling every
method in every launch would not fit the time bound. The ranks' glibc malloc keeps what it frees
(gradcomp.emulate.KEEP_FREED_MEMORY), so that a hook allocates alike in its calibration and in
training.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="reduced grid (under 5 minutes)")
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--rates", help="comma-separated Gbit/s, 'none' for unshaped (overrides the grid)")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default 2; --nodes 2: 4)")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                        help="2: the ranks in two nodes joined by the shaped link (gradcomp.emulate.ShapedNodes), "
                             "flat and hierarchical hooks")
    parser.add_argument("--workload", default=None, help="default mlp (quick: mlp-small)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 6, quick 4)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None,
                        help="times every run is repeated in turn, each with its own calibration (default 3, quick 2)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per calibration point")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds per run at most (default 20, quick 8)")
    parser.add_argument("--sweeps", type=int, default=1,
                        help="make the rate sweep this many times over (every rate, then again): each point is "
                             "the median over its launches, each predicted from its own calibration")
    parser.add_argument("--compile", action="store_true",
                        help="the ranks run the compiled CPU fast path from the first call")
    parser.add_argument("--replay", metavar="JSON",
                        help="no training: predict again the launches a --json of this script recorded")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: one unshaped launch without a namespace, mlp-small, 1 step per run")
    parser.add_argument("--published", action="store_true",
                        help="no training: predict each published measurement of gradcomp.published "
                             "again, print the table and each row's gradcomp breakeven command")
    return parser


if __name__ == "__main__":  # --help and argument errors answer before torch is imported
    build_parser().parse_args()

import numpy  # noqa: E402
from tabulate import tabulate  # noqa: E402

from gradcomp.analysis import Choice, Compute, Link, LinearCost, MethodCost, Network, Profile, Scenario, \
    breakeven_gbps, ddp_buckets, from_module, simulate
from gradcomp.analysis.calibrate import fit_sweep, ranks_per_core  # noqa: E402
from gradcomp.emulate import KEEP_FREED_MEMORY, EmulationUnavailable, ShapedLink, ShapedNodes, launch_ranks, \
    median_step_s, unavailable_reason, workload

# the runs compared, as [hier:]method[:scheme] labels: a scheme left out is the method's own (Choice)
RUNS = [Choice.parse(label) for label in ("none", "fp16", "int8:allgather", "int8:twophase", "sign:allgather",
                                          "topk", "powersgd")]
NODE_RUNS = [Choice.parse(label) for label in ("none", "int8:allgather", "hier:int8:allgather",
                                               "hier:int8:twophase", "hier:fp16", "hier:sign:allgather")]
"""--nodes 2: flat and hierarchical hooks on 2 nodes (ShapedNodes: the rate is the link between them)."""
QUICK_RATES = [0.25, 1.0, 4.0, 16.0, None]
FULL_RATES = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, None]
CROSSOVER_TOLERANCE = 1.25
ERROR_TARGET_PCT = {"quick": 15.0, "full": 10.0}


def runs_of(args) -> list[Choice]:
    """The runs of this validation: :data:`NODE_RUNS` on two nodes, else :data:`RUNS`."""
    return NODE_RUNS if args.nodes > 1 else RUNS


def launch_config(args, choices: list[Choice], model, rate: float | None) -> dict:
    """What every rank of one launch does. Collective sweeps up to the model's gradient bytes and
    hook timings up to its largest bucket (so nothing is extrapolated); below 1 Gbit/s the sweep
    stops at a quarter of that to bound the time."""
    grad_bytes = 4 * model.numel
    top = grad_bytes if rate is None or rate >= 1 else grad_bytes // 4
    largest_bucket = max(b.numel for b in ddp_buckets(model, args.bucket_mb))
    return {
        "workload": args.workload, "batch_size": args.batch_size, "bucket_cap_mb": args.bucket_mb,
        "warmup": args.warmup, "steps": args.steps, "budget_s": args.budget_s, "rounds": args.rounds,
        "calibrate": {"repeats": args.repeats, "network_sizes": [top // 64, top // 16, top // 4, top],
                      "sizes": [largest_bucket // 16, largest_bucket // 4, largest_bucket]},
        "runs": [[c.method, c.scheme, c.options, c.hierarchical] for c in choices],
        "node_size": args.world_size // args.nodes if args.nodes > 1 else None,
    }


def run_profile(results: list[dict], world_size: int, label: str, round_index: int) -> Profile:
    """The profile measured right before run ``label`` in one round, each number the median over
    the ranks (the ranks run the same work; how long a collective waits for the slowest of them
    is ``sync_wait``, measured apart)."""
    calibrations = [r["calibration"][label][round_index] for r in results]

    def typical(key, part=None):
        return LinearCost(*(statistics.median((c[key][part] if part else c[key])[field] for c in calibrations)
                            for field in ("fixed_s", "per_element_s")))

    methods = {}
    if "method" in calibrations[0]:
        methods[Choice.parse(label).method] = MethodCost(typical("method", "compress"),
                                                         typical("method", "decompress"))
    compute = Compute(*(statistics.median(c["compute"][k] for c in calibrations)
                        for k in ("forward_s", "backward_s", "optimizer_s")))
    return Profile("cpu-emulated", methods, compute, average=typical("average"))


def launch_links(results: list[dict], world_size: int, node_size: int | None) -> dict[str, dict[str, Link]]:
    """One launch's collective sweeps (rank 0's), fitted: ``network`` over all ranks and, on
    nodes, ``network_intra`` (a node's ranks, every node at once) and ``network_inter`` (one rank
    per node, every such group at once: they share the link between the nodes)."""
    ranks = {"network": world_size}
    if node_size:
        ranks.update(network_intra=node_size, network_inter=world_size // node_size)
    return {key: fit_sweep(p, results[0][key]) for key, p in ranks.items()}


def network_for(choice: Choice, links: dict, world_size: int, node_size: int | None,
                host: dict | None = None) -> Network:
    """The network a run's prediction uses, as Gloo runs it: a flat hook's collectives are one
    ring over all ranks (``network``); a hierarchical hook's run inside the nodes
    (``network_intra``) and between them (``network_inter``). With ``host`` (the unshaped
    launch's links, where the wire is free) that share of each link's cost, per byte and per
    message step, is host work, which competes with backward for the CPU
    (``Scenario.host_contends``)."""
    def link(key, kind):
        if kind not in links[key]:  # launches recorded before the all-to-all was swept
            return None
        return links[key][kind] if host is None else links[key][kind].with_host_share(host[key][kind])

    if choice.hierarchical:
        return Network(world_size, link("network_inter", "allreduce"), gpus_per_node=node_size,
                       intra=link("network_intra", "allgather"),
                       allgather_link=link("network_inter", "allgather"), algorithm="ring",
                       intra_reduce_scatter=link("network_intra", "reduce_scatter"),
                       alltoall_link=link("network_inter", "alltoall"))
    return Network(world_size, link("network", "allreduce"), allgather_link=link("network", "allgather"),
                   algorithm="ring", reduce_scatter_link=link("network", "reduce_scatter"),
                   alltoall_link=link("network", "alltoall"))


def fitted_links(rates: list[float | None], links: list[dict], host: dict | None) -> dict[str, dict[str, Link]]:
    """Link models over all launches (``links[i]``: :func:`launch_links` of the launch at
    ``rates[i]``). Links through the shaped pair: beta(rate) = per_byte + 8 / (rate * efficiency),
    least squares in 1/rate (unshaped launches are points at 1/rate = 0), alpha the median, of
    which ``host``'s alpha (an unshaped launch's links) is host work; the links inside nodes
    (never shaped): the launch with the median beta. Raises ValueError when the launches at the
    lowest rate are no slower per byte than those at the highest (the shaping did not show)."""
    x = [0.0 if r is None else 1.0 / r for r in rates]
    fitted = {}
    for key in links[0]:
        fitted[key] = {}
        for kind in links[0][key]:
            per_launch = [launch[key][kind] for launch in links]
            if key == "network_intra":
                fitted[key][kind] = sorted(per_launch, key=lambda link: link.beta_s)[len(per_launch) // 2]
                continue
            slope, per_byte_s = (float(c) for c in numpy.polyfit(x, [link.beta_s for link in per_launch], 1))
            # compared directly as well as by the slope's sign: a fit of equal seconds gives a
            # slope of +-1e-20 or so, its sign depending on the CPU's rounding
            slowest, fastest = (statistics.median(link.beta_s for link, at in zip(per_launch, x) if at == edge)
                                for edge in (max(x), min(x)))
            if not (slope > 0 and slowest > fastest):
                betas = ", ".join(f"{link.beta_s:.3g} at {r}" for link, r in zip(per_launch, rates))
                raise ValueError(f"the {key} {kind} link is no slower at lower rates (seconds per byte "
                                 f"{betas} Gbit/s): the shaping did not show in these launches")
            alpha_us = statistics.median(link.latency_us for link in per_launch)
            host_us = min(host[key][kind].latency_us, alpha_us) if host is not None else 0.0
            fitted[key][kind] = Link(f"tbf-{kind}", 1.0, alpha_us, 8.0 / (slope * 1e9), max(per_byte_s, 0.0),
                                     host_us)
    return fitted


def host_links(rates: list[float | None], links: list[dict]) -> dict | None:
    """The host's share of a collective: the links of the unshaped launch (the one with the
    median all-reduce beta when there are several), where the wire is free; None without one
    (all of a collective's cost then counts as wire)."""
    unshaped = sorted((links[i] for i, r in enumerate(rates) if r is None),
                      key=lambda launch: launch["network"]["allreduce"].beta_s)
    return unshaped[len(unshaped) // 2] if unshaped else None


def sync_wait(results: list[dict]) -> LinearCost:
    """One launch's measured wait of a collective for the slowest rank's compute (0 for launches
    recorded before it was measured)."""
    return LinearCost(**results[0]["sync_wait"]) if "sync_wait" in results[0] else LinearCost(0.0, 0.0)


def median_hook_s(results: list[dict], label: str) -> float:
    """The slowest rank's median seconds per step that run ``label``'s hook spent compressing and
    decompressing (its own statistics, over all rounds' timed steps)."""
    return max(statistics.median(sum(stages) for rounds in r["hook_stages"][label] for stages in rounds)
               for r in results)


def merged_profile(profiles: list[Profile]) -> Profile:
    """Per-field medians over all runs and launches of compute, averaging and hook costs."""
    def median_cost(costs):
        return LinearCost(statistics.median(c.fixed_s for c in costs), statistics.median(c.per_element_s for c in costs))
    names = {name for p in profiles for name in p.methods}
    methods = {name: MethodCost(median_cost([p.methods[name].compress for p in profiles if name in p.methods]),
                                median_cost([p.methods[name].decompress for p in profiles if name in p.methods]))
               for name in names}
    compute = Compute(*(statistics.median(getattr(p.compute, k) for p in profiles)
                        for k in ("forward_s", "backward_s", "optimizer_s")))
    return Profile("cpu-emulated", methods, compute, average=median_cost([p.average for p in profiles]))


def measured_crossover(rates: list[float], speedups: list[float]) -> float | None:
    """The rate where the measured speedup falls through 1 for good (log-log interpolation)
    among shaped rates sorted ascending; None when it pays at all of them or at none."""
    pairs = sorted(zip(rates, speedups))
    flips = [i for i in range(len(pairs) - 1) if pairs[i][1] > 1.0 >= pairs[i + 1][1]]
    if not flips or any(s > 1.0 for _, s in pairs[flips[-1] + 1:]):
        return None
    (r0, s0), (r1, s1) = pairs[flips[-1]], pairs[flips[-1] + 1]
    t = math.log(s0) / (math.log(s0) - math.log(s1))
    return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))


def crossover_table(args, rates, profiles, links, host, waits, speedups, model, choices,
                    sweep_speedups=()) -> list[dict]:
    """Predicted (links fitted over all launches, medians of every run's costs and of the
    launches' sync waits) against measured crossover (from ``speedups[rate][label]``) per choice,
    and with several sweeps each sweep's own (``sweep_speedups``: a ``speedups`` per sweep),
    printed; [] when fewer than two shaped rates were run."""
    shaped = [r for r in speedups if r is not None]
    if len(shaped) < 2:
        print("\ncrossovers: not measured (they need at least two shaped rates)")
        return []
    every_run = [p for launch in profiles for rounds in launch.values() for p in rounds]
    merged = merged_profile(every_run)
    fitted = fitted_links(rates, links, host)
    wait = LinearCost(statistics.median(w.fixed_s for w in waits),
                      statistics.median(w.per_element_s for w in waits))

    def scenario(choice):
        network = network_for(choice, fitted, args.world_size, args.node_size)
        return Scenario(model, network, merged, merged.compute, args.bucket_mb, host_contends=True,
                        ranks_per_core=args.ranks_per_core, sync_wait=wait)

    baseline = scenario(Choice("none"))
    crossovers, cross_rows = [], []
    for choice in choices:
        predicted = breakeven_gbps(scenario(choice), choice, (0.01, 1000.0), baseline=baseline)
        actual = measured_crossover(shaped, [speedups[r][choice.label] for r in shaped])
        within = None if predicted is None or actual is None else \
            1 / CROSSOVER_TOLERANCE <= actual / predicted <= CROSSOVER_TOLERANCE
        record = {"method": choice.label, "predicted_gbps": predicted, "measured_gbps": actual,
                  "within_tolerance": within}
        row = [choice.label, "none" if predicted is None else f"{predicted:.3g}",
               "none in range" if actual is None else f"{actual:.3g}",
               "" if within is None else ("yes" if within else "NO")]
        if sweep_speedups:
            record["measured_gbps_per_sweep"] = [
                measured_crossover(shaped, [sweep[r][choice.label] for r in shaped]) for sweep in sweep_speedups]
            row.append(" / ".join("none" if g is None else f"{g:.3g}" for g in record["measured_gbps_per_sweep"]))
        crossovers.append(record)
        cross_rows.append(row)
    print()
    print(tabulate(cross_rows, headers=["method", "predicted crossover Gbit/s", "measured Gbit/s",
                                        f"within {CROSSOVER_TOLERANCE:g}x"]
                   + (["measured in each sweep"] if sweep_speedups else [])))
    return crossovers


REPLAYED = ("rates_gbps", "workload", "world_size", "nodes", "batch_size", "bucket_mb", "rounds", "malloc")
"""What --replay takes from the JSON of the run it replays (besides the launches)."""


def published(args) -> int:
    """Predict every published measurement again (gradcomp.published), (a) from presets and the
    stated hardware and (b) with the measured link where the source gives one, and print the
    table and confusion tables docs/breakeven.md shows, each row's commands, and (with --json) the
    rows."""
    from dataclasses import asdict

    from gradcomp import published as pub

    rows = [replace(m, predicted=round(pub.predict(m)[0], 3),
                    predicted_measured=round(pub.predict(m, "measured")[0], 3) if m.measured_argv else None)
            if m.argv else m for m in pub.MEASUREMENTS]
    print(pub.table(rows))
    print()
    print(pub.commands(rows))
    cuts = pub.powersgd_cut_grid()
    print(f"\nPowerSGD rank 2, ResNet-18 (CIFAR), 16 GPUs: communication cut over {len(cuts)} preset settings "
          f"(the paper's: {pub.POWERSGD_CUT:.0%}; within 1.5x: {pub.POWERSGD_CUT / 1.5:.0%}-{pub.POWERSGD_CUT * 1.5:.0%})")
    for c in cuts:
        print(f"  {c['link']:7s} {c['gpus_per_node']} per node {c['device']}: SGD {c['sgd_comm_ms']:7.2f} ms, "
              f"PowerSGD {c['powersgd_comm_ms']:5.2f} ms: cut {c['cut']:.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": args.command, "rows": [asdict(m) for m in rows],
                       "summary_presets": pub.summary(rows, "preset"),
                       "summary_measured_link": pub.summary(rows, "measured")}, f, indent=1)
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] if argv is None else argv))
    if args.published:
        return published(args)
    if args.replay:
        return replay(args)
    args.world_size = args.world_size or 2 * args.nodes
    if args.world_size % args.nodes or args.world_size < 2 * args.nodes:
        parser.error(f"--world-size {args.world_size} does not split into {args.nodes} nodes of 2 or more ranks")
    if args.sweeps < 1:
        parser.error(f"--sweeps must be >= 1, got {args.sweeps}")
    if args.smoke:
        args.rates, args.workload, args.batch_size = "none", "mlp-small", 8
        args.steps, args.warmup, args.rounds, args.repeats, args.budget_s = 1, 1, 1, 1, 2.0
    args.steps = args.steps or (3 if args.quick else 4)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.workload = args.workload or ("mlp-small" if args.quick else "mlp")
    args.budget_s = args.budget_s or (8.0 if args.quick else 20.0)

    reason = None if args.smoke and args.nodes == 1 else unavailable_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    rates = QUICK_RATES if args.quick else FULL_RATES
    if args.rates:
        rates = [None if r.strip().lower() == "none" else float(r) for r in args.rates.split(",")]
    rates = rates * args.sweeps
    env = {**KEEP_FREED_MEMORY, **({"GRADCOMP_CPU_COMPILE_AFTER_S": "0"} if args.compile else {"GRADCOMP_CPU_COMPILE": "0"})}
    args.malloc = KEEP_FREED_MEMORY  # the ranks' glibc malloc settings (runs before 4c142e2: "default";
    # 4c142e2 to 7392dde: "keep-freed", the first two of them)
    module, _, _ = workload(args.workload, args.batch_size)
    model = from_module(module, args.workload)
    started, load_before = time.time(), os.getloadavg()

    launches = []
    for rate in rates:
        t0 = time.time()
        try:
            shaped = ShapedNodes(rate) if args.nodes > 1 else ShapedLink(rate)
            with contextlib.nullcontext() if args.smoke and args.nodes == 1 else shaped as link:
                launches.append(launch_ranks("gradcomp.emulate:train_worker", args.world_size,
                                             launch_config(args, runs_of(args), model, rate), link=link,
                                             timeout_s=900, env=env))
        except EmulationUnavailable as exc:
            print(f"skipped: {exc}")
            return 0
        print(f"rate {'unshaped' if rate is None else f'{rate:g} Gbit/s'}: {time.time() - t0:.0f} s", flush=True)
    load_after = os.getloadavg()
    return report(args, rates, launches, model, time.time() - started, [load_before[0], load_after[0]])


def replay(args) -> int:
    """Predict again the launches a JSON written by this script recorded (no training: the
    model's current code against the measurements of that run)."""
    with open(args.replay) as f:
        recorded = json.load(f)
    if "launches" not in recorded:
        raise SystemExit(f"{args.replay}: no launches recorded (written before --replay existed)")
    for key in REPLAYED:
        setattr(args, "rates" if key == "rates_gbps" else key,
                recorded.get(key, {"nodes": 1, "malloc": "default"}.get(key)))
    module, _, _ = workload(args.workload, args.batch_size)
    return report(args, args.rates, recorded["launches"], from_module(module, args.workload),
                  recorded["elapsed_s"], recorded["load_average"])


def report(args, rates: list[float | None], launches: list[list[dict]], model, elapsed_s: float,
           load_average: list[float]) -> int:
    """Predict every run of ``launches`` (one per entry of ``rates``, several per rate with
    --sweeps: every rank's measurements) from its own calibration; per rate and run, the medians
    over its launches of the measured and predicted steps and of the speedup over ``none`` in the
    same launch; print the tables and write the JSON (with the launches, for --replay)."""
    args.node_size = args.world_size // args.nodes if args.nodes > 1 else None
    args.ranks_per_core = ranks_per_core(args.world_size, launches[0][0].get("cpus"))
    waits = [sync_wait(results) for results in launches]
    profiles = [{label: [run_profile(results, args.world_size, label, i) for i in range(args.rounds)]
                 for label in results[0]["steps"]} for results in launches]
    links = [launch_links(results, args.world_size, args.node_size) for results in launches]
    host = host_links(rates, links)

    choices = runs_of(args)
    per_launch = {}  # (rate, label) -> per launch [measured, predicted, hook measured, hook predicted, speedup]
    for results, rate, own_links, wait, launch_profiles in zip(launches, rates, links, waits, profiles):
        steps = {label: median_step_s(results, label) for label in results[0]["steps"]}
        for choice in choices:
            network = network_for(choice, own_links, args.world_size, args.node_size, host)

            def step(profile):
                return simulate(Scenario(model, network, profile, profile.compute, args.bucket_mb,
                                         host_contends=True, ranks_per_core=args.ranks_per_core,
                                         sync_wait=wait), choice)

            run_profiles = launch_profiles[choice.label]
            # the hook's compress and decompress stages alone: the step's compute stages without
            # the averaging pass (PowerSGD's hook makes none)
            per_launch.setdefault((rate, choice.label), []).append([
                steps[choice.label],
                statistics.median(step(profile).step_s for profile in run_profiles),
                median_hook_s(results, choice.label),
                statistics.median(step(replace(profile, average=LinearCost(0.0, 0.0))).compress_s
                                  for profile in run_profiles),
                steps["none"] / steps[choice.label]])

    rows, records, errors, speedups = [], [], [], {}
    for (rate, label), values in per_launch.items():
        actual, predicted, hook_actual, hook_predicted, speedup = (statistics.median(v) for v in zip(*values))
        speedups.setdefault(rate, {})[label] = speedup
        error = abs(predicted - actual) / actual * 100
        errors.append(error)
        rows.append(["unshaped" if rate is None else f"{rate:g}", label, f"{actual * 1e3:.1f}",
                     f"{predicted * 1e3:.1f}", f"{error:.0f}%",
                     "" if label == "none" else f"{hook_actual * 1e3:.1f} / {hook_predicted * 1e3:.1f}"])
        records.append({"rate_gbps": rate, "method": label, "measured_s": actual,
                        "predicted_s": predicted, "abs_error_pct": error, "launches": len(values),
                        "hook_measured_s": hook_actual, "hook_predicted_s": hook_predicted})
    print(tabulate(rows, headers=["Gbit/s", "method", "measured ms", "predicted ms", "error",
                                  "hook compute ms: in training / predicted"]))
    median_error = statistics.median(errors)

    # the k-th launch at each rate belongs to the k-th sweep: each sweep's speedups, when several
    sweeps = min(len(values) for values in per_launch.values())
    sweep_speedups = [{rate: {label: values[k][4] for (r, label), values in per_launch.items() if r == rate}
                       for rate in speedups} for k in range(sweeps)] if sweeps > 1 else []
    crossovers = crossover_table(args, rates, profiles, links, host, waits, speedups, model, choices[1:],
                                 sweep_speedups)
    target = ERROR_TARGET_PCT["quick" if args.workload == "mlp-small" else "full"]
    print(f"\nmedian |error| {median_error:.1f}% (target <= {target:g}%); "
          f"{elapsed_s:.0f} s; load average {load_average[0]:.1f} -> {load_average[1]:.1f} on {os.cpu_count()} CPUs"
          + (f"; replayed from {args.replay}" if args.replay else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_abs_error_pct": median_error, "crossovers": crossovers, "points": records,
                       "rates_gbps": rates, "workload": args.workload, "world_size": args.world_size,
                       "nodes": args.nodes, "malloc": args.malloc,
                       "batch_size": args.batch_size, "bucket_mb": args.bucket_mb, "rounds": args.rounds,
                       "elapsed_s": elapsed_s, "load_average": load_average, "command": args.command,
                       "replayed": args.replay, "launches": launches}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
