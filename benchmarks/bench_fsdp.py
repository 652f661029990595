"""FSDP2 step time and wire bytes, plain vs gradcomp.fsdp, on 2 and 4 Gloo ranks.

    python benchmarks/bench_fsdp.py [--json PATH]                  # loopback
    python benchmarks/bench_fsdp.py --rate-gbps 1 [--json PATH]    # over an emulated 1 Gbit/s link
                                                                   # (root, ip, tc), with the analyser's
                                                                   # prediction beside each row
    python benchmarks/bench_fsdp.py --rate-gbps 0.25,1,4,none     # one launch per rate ("none": the
                                                                   # namespace unshaped), and the median
                                                                   # |error| of the predictions
    python benchmarks/bench_fsdp.py --replay PATH   # predict a recorded --rate-gbps run again, no training
    python benchmarks/bench_fsdp.py --smoke    # 2 ranks, one unshaped launch on the host's loopback
                                               # (no namespace), 1 warm-up + 1 timed step, predicted:
                                               # seconds; checks the script, its times mean nothing

Prints the table; writes JSON only with ``--json`` (with every launch's measurements, for
``--replay``). Without root, ip and tc, ``--rate-gbps`` says so and exits with status 0.

Model: an MLP of 4 Linear(512, 512) layers (1.05M parameters), each layer and the root wrapped
with fully_shard; batch 64; SGD. Step time: median over the timed steps, max over ranks.
Wire bytes per step: what each rank sends in the gradient reduce-scatter (plain: (p-1)/p x 4 bytes
per parameter, what a ring reduce-scatter sends; compressed: from the handle's statistics).

Over an emulated link (gradcomp.emulate.ShapedLink: every rank in one namespace whose loopback is
shaped by tbf, so all ranks share the rate), each launch first calibrates what the prediction
needs, inside the shaped namespace and with every rank running: the all-reduce / all-gather /
reduce-scatter sweep (the links' alpha and beta, ``calibrate.fit_network``), the step's forward /
backward / optimizer seconds through fully_shard with FSDP2's collectives made wire-free
(:class:`WireFreeAllGather`, :class:`WireFreeReduceScatter`: FSDP2's own per-step work, its copies
and hooks, at this world size, without the network), and each method's seconds per element to
encode p - 1 rows and to decode-and-sum them (``gradcomp.fsdp.encode_rows`` / ``decode_and_sum`` on
the largest unit); ranks that outnumber the cores take these in turn, each on a core of its own
(``calibrate.in_waves``), and the prediction shares the cores out (``Scenario.ranks_per_core``);
and, every rank at once, how long a collective waits for the slowest rank's compute before it
(``calibrate.measure_sync_wait`` on the plain MLP's forward, forward + backward and two of those:
``Scenario.sync_wait``). The prediction is ``Scenario(..., sharded=True)`` on those numbers (each
the median over the ranks: ``sync_wait`` is the wait for the slowest), with the sweep's own
reduce-scatter as ``Network.reduce_scatter_link`` (Gloo's reduce-scatter costs more than its
all-reduce; launches recorded before it was swept price it as their all-reduce) and, when the run
has an unshaped launch of the same world size, the host's share of each collective (its cost per
byte and per step there, where the wire is free) as compute beside backward
(``Scenario.host_contends``), as breakeven_validation.py predicts. The ranks' glibc malloc keeps
what it frees (gradcomp.emulate.KEEP_FREED_MEMORY), as there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def rates_arg(text: str) -> list[float | None]:
    """``0.25,1,none`` -> [0.25, 1.0, None] (None: the namespace's link unshaped)."""
    try:
        rates = [None if r.strip().lower() == "none" else float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates are Gbit/s or 'none', comma-separated: {text!r}") from None
    if any(r is not None and not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 Gbit/s: {text!r}")
    return rates


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--rate-gbps", type=rates_arg, default=None,
                        help="emulated link rates, comma-separated Gbit/s or 'none' (unshaped namespace); needs root")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per method over the emulated link")
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--replay", metavar="JSON",
                        help="no training: predict again the launches a --rate-gbps --json run recorded")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: 2 ranks, one unshaped launch on the host's loopback, 1 warm-up and "
                             "1 timed step per method, predicted")
    return parser


if __name__ == "__main__":  # --help and argument errors answer before torch is imported
    build_parser().parse_args()
    # the compiled CPU fast path from the first call, as a long run has it (by default gradcomp runs
    # a function eagerly until that has taken as long as compiling it: gradcomp.methods.fast)
    os.environ.setdefault("GRADCOMP_CPU_COMPILE_AFTER_S", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from dist_utils import run_ranks  # noqa: E402

WIDTH, LAYERS, BATCH = 512, 4, 64
WARMUP_STEPS, TIMED_STEPS = 3, 12
METHODS = (None, "bf16", "int8", "int4", "sign")
CALIBRATION_REPEATS = 3
NO_NAMESPACE = "loopback"
"""--smoke's one rate: a calibrated launch on the host's loopback, no namespace (no root needed)."""


def build_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)])


def sharded_mlp() -> nn.Module:
    """:func:`build_mlp` with every layer and the root wrapped by fully_shard (default mesh)."""
    from torch.distributed.fsdp import fully_shard

    model = build_mlp()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


class WireFreeAllGather(AllGather):
    """FSDP2's parameter all-gather without the network: this rank's shard copied into every
    rank's slot of the output (the values are wrong, the shapes and FSDP2's own work are not).
    For calibrating FSDP2's per-step host work only."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        world = dist.get_world_size(group)
        output_tensor.view(world, -1).copy_(input_tensor.view(1, -1).expand(world, -1))


class WireFreeReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter without the network: this rank's own row is its shard."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        output_tensor.copy_(input_tensor.view(world, -1)[rank].view_as(output_tensor))


def sharded_compute(repeats: int):
    """Forward / backward / optimizer seconds of the fully_shard-ed MLP with wire-free collectives
    (every rank must call it; ranks that outnumber the cores measure in turn:
    ``calibrate.in_waves``). The optimizer's seconds are scaled to the whole model's (times the
    world size), the unit ``Scenario(..., sharded=True)`` divides by the world size."""
    from gradcomp.analysis import Compute
    from gradcomp.analysis.calibrate import in_waves, measure_compute

    model = sharded_mlp()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(WireFreeAllGather())
            module.set_custom_reduce_scatter(WireFreeReduceScatter())
    batch = (torch.randn(BATCH, WIDTH), torch.zeros(BATCH, dtype=torch.long))
    measured = in_waves(lambda: measure_compute(model, batch, lambda m, b: m(b[0]).square().mean(), repeats,
                                                optimizer=torch.optim.SGD(model.parameters(), lr=0.01)))
    return Compute(measured.forward_s, measured.backward_s, measured.optimizer_s * dist.get_world_size())


def train_methods(rank: int, world_size: int, methods=METHODS, warmup: int = WARMUP_STEPS,
                  steps: int = TIMED_STEPS) -> dict:
    """Per method (None: plain FSDP2): median step seconds of this rank, bytes and phase seconds."""
    import gradcomp.fsdp

    rows = {}
    for method in methods:
        model = sharded_mlp()
        handle = gradcomp.fsdp.compress(model, method) if method else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.Generator().manual_seed(rank)
        times = []
        for step in range(warmup + steps):
            x = torch.randn(BATCH, WIDTH, generator=data)
            dist.barrier()
            start = time.perf_counter()
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step >= warmup:
                times.append(time.perf_counter() - start)
        parameters = sum(p.numel() for p in model.parameters())  # sharded DTensors: global numel
        plain_bytes = (world_size - 1) / world_size * 4 * parameters
        stats = handle.stats() if handle else None
        rows[method or "plain"] = {
            "step_s": statistics.median(times),
            "wire_bytes_per_step": stats["wire_bytes_per_step"] if stats else plain_bytes,
            "raw_bytes_per_step": stats["raw_bytes_per_step"] if stats else plain_bytes,
            "compress_s_per_step": stats["compress_s_per_step"] if stats else 0.0,
            "comm_s_per_step": stats["comm_s_per_step"] if stats else None,
            "decompress_s_per_step": stats["decompress_s_per_step"] if stats else 0.0,
        }
    return rows


def row_costs(method: str, world_size: int, shard_numel: int, repeats: int) -> dict:
    """Seconds per element to encode p - 1 rows of ``shard_numel`` (error feedback as the handle
    keeps it) and to decode and sum them: gradcomp.fsdp's own functions, no network."""
    import gradcomp.fsdp as gfsdp
    from gradcomp.analysis.calibrate import median_seconds

    chosen = gfsdp.check_method(method)
    rows = torch.randn(world_size, shard_numel)
    residuals = torch.zeros(world_size, shard_numel) if not chosen.summable else None
    states = [{} for _ in range(world_size)]
    payloads = gfsdp.encode_rows(chosen, rows, 0, world_size, residuals, states)
    received = gfsdp.pack_payloads(payloads).view(world_size - 1, -1)
    elements = (world_size - 1) * shard_numel
    encode = median_seconds(lambda: gfsdp.encode_rows(chosen, rows, 0, world_size, residuals, states), repeats)
    decode = median_seconds(lambda: gfsdp.decode_and_sum(chosen, payloads[0], received, rows[0]), repeats)
    return {"compress_per_element_s": encode / elements, "decode_per_element_s": decode / elements}


def emulated_worker(rank: int, world_size: int, config: dict) -> dict:
    """Inside each rank of a launch on the shaped link: calibrate, then train every method."""
    from gradcomp.analysis import calibrate

    repeats = config["repeats"]
    network = {"sizes": config["network_sizes"], **calibrate.sweep_collectives(config["network_sizes"], repeats)}
    plain, x = build_mlp(), torch.randn(BATCH, WIDTH)

    def step():
        plain(x).square().mean().backward()

    sync_wait = calibrate.measure_sync_wait([lambda: plain(x), step, lambda: (step(), step())])
    compute = sharded_compute(repeats)
    shard = -(-WIDTH * (WIDTH + 1) // world_size)  # one layer's rows (weight + bias) per rank
    costs = calibrate.in_waves(lambda: {m: row_costs(m, world_size, shard, repeats) for m in METHODS if m})
    return {"network": network,
            "compute": {k: getattr(compute, k) for k in ("forward_s", "backward_s", "optimizer_s")},
            "costs": costs, "cpus": calibrate.host_cores(), "sync_wait": sync_wait.__dict__,
            "runs": train_methods(rank, world_size, METHODS, config["warmup"], config["steps"])}


def predict(results: list[dict], world_size: int, host: list[dict] | None = None) -> dict:
    """Predicted step seconds and wire bytes per method from one launch's calibration (the
    median rank's number of each), by the analyser's FSDP2 scenario; ``host``: the unshaped launch
    of the same world size, whose links' cost per byte is the host's share of each collective."""
    from gradcomp.analysis import (Choice, Compute, LinearCost, MethodCost, Network, Profile, Scenario,
                                   from_module, simulate)
    from gradcomp.analysis.calibrate import fit_sweep, ranks_per_core

    links = fit_sweep(world_size, results[0]["network"])
    if host is not None:
        host_links = fit_sweep(world_size, host[0]["network"])
        links = {kind: link.with_host_share(host_links[kind]) for kind, link in links.items()}
    compute = Compute(*(statistics.median(r["compute"][k] for r in results)
                        for k in ("forward_s", "backward_s", "optimizer_s")))
    methods = {}
    for method in results[0]["costs"]:
        typical = {k: statistics.median(r["costs"][method][k] for r in results) for k in results[0]["costs"][method]}
        methods[method] = MethodCost(LinearCost(0.0, typical["compress_per_element_s"]),
                                     LinearCost(0.0, typical["decode_per_element_s"]))
    profile = Profile("cpu-emulated", methods, compute, links, world_size)
    network = Network(world_size, links["allreduce"], allgather_link=links["allgather"], algorithm="ring",
                      reduce_scatter_link=links["reduce_scatter"])
    scenario = Scenario(from_module(build_mlp(), "mlp-512x4"), network, profile, compute, sharded=True,
                        host_contends=host is not None,
                        ranks_per_core=ranks_per_core(world_size, results[0].get("cpus")),
                        sync_wait=LinearCost(**results[0].get("sync_wait", {"fixed_s": 0.0, "per_element_s": 0.0})))
    out = {}
    for method in results[0]["runs"]:
        step = simulate(scenario, Choice("none" if method == "plain" else method))
        out[method] = {"step_s": step.step_s, "wire_bytes": step.wire_bytes, "exact_bytes": step.exact_bytes}
    out["links"] = {k: {"gbps": v.bandwidth_gbps, "latency_us": v.latency_us} for k, v in links.items()}
    return out


def print_table(world_size: int, table: dict, predicted: dict | None = None) -> None:
    for method, row in table.items():
        comm_ms = "-" if row["comm_s_per_step"] is None else f"{1e3 * row['comm_s_per_step']:.1f}"
        line = (f"{world_size:>2} {method:>6} {1e3 * row['step_s']:>8.1f} "
                f"{row['step_s'] / table['plain']['step_s']:>8.2f} "
                f"{row['wire_bytes_per_step'] / 1024:>12.1f} "
                f"{row['raw_bytes_per_step'] / row['wire_bytes_per_step']:>6.2f} "
                f"{1e3 * row['compress_s_per_step']:>11.1f} {comm_ms:>8} "
                f"{1e3 * row['decompress_s_per_step']:>9.1f}")
        if predicted:
            guess = predicted[method]
            line += (f" {1e3 * guess['step_s']:>9.1f} {100 * (guess['step_s'] / row['step_s'] - 1):>+6.0f}% "
                     f"{guess['wire_bytes'] / 1024:>10.1f}")
        print(line)


def slowest(runs: list[dict]) -> dict:
    """The table of one launch: rank 0's row per method with the slowest rank's step time."""
    table = {}
    for method in runs[0]:
        table[method] = dict(runs[0][method])
        table[method]["step_s"] = max(r[method]["step_s"] for r in runs)
    return table


def launch(world_size: int, rate, emulated: bool, warmup: int, steps: int) -> tuple[list[dict], list[dict] | None]:
    """(every rank's runs, every rank's calibration and runs, or None on the host's loopback
    without calibration) of one launch: on the host's loopback (``emulated`` False: trained by
    run_ranks; with ``rate`` NO_NAMESPACE: launched without a namespace, calibrated) or a
    ShapedLink at ``rate`` (None: unshaped)."""
    if not emulated:
        return run_ranks(train_methods, world_size, METHODS, warmup, steps, timeout_s=600), None
    import contextlib

    from gradcomp.emulate import KEEP_FREED_MEMORY, ShapedLink, launch_ranks

    grad_bytes = 4 * LAYERS * WIDTH * (WIDTH + 1)
    config = {"repeats": CALIBRATION_REPEATS, "warmup": warmup, "steps": steps,
              "network_sizes": [grad_bytes // 64, grad_bytes // 16, grad_bytes // 4, grad_bytes]}
    shaped = contextlib.nullcontext() if rate == NO_NAMESPACE else ShapedLink(rate)
    with shaped as link:
        launched = launch_ranks("benchmarks.bench_fsdp:emulated_worker", world_size, config, link=link,
                                timeout_s=900, env={"PYTHONPATH": str(ROOT), **KEEP_FREED_MEMORY})
    return [r["runs"] for r in launched], launched


def report(results: dict, launches: dict, args) -> None:
    """Print every launch's table (with the prediction when it was calibrated) and the median
    |error|; write the JSON."""
    header = (f"{'p':>2} {'method':>6} {'step ms':>8} {'vs plain':>8} {'wire KB/step':>12} "
              f"{'ratio':>6} {'compress ms':>11} {'comm ms':>8} {'decode ms':>9}")
    errors = []
    for label, entry in results["links"].items():
        rate = entry["rate_gbps"]
        print(f"\n{label}{' Gbit/s' if rate else ''}")
        print(header + (f" {'pred. ms':>9} {'error':>7} {'pred. KB':>10}" if label in launches else ""))
        for world, table in entry["runs"].items():
            predicted = None
            if label in launches:
                host = launches.get("unshaped", {}).get(world)
                predicted = entry["predicted"][world] = predict(launches[label][world], int(world), host)
                errors += [abs(predicted[m]["step_s"] / row["step_s"] - 1) * 100 for m, row in table.items()]
            print_table(int(world), table, predicted)
    if errors:
        results["median_abs_error_pct"] = statistics.median(errors)
        print(f"\nmedian |error| of the predicted step times: {results['median_abs_error_pct']:.1f}% "
              f"({len(errors)} rows)" + (f"; replayed from {args.replay}" if args.replay else ""))
    results["launches"] = launches
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


def replay(args) -> None:
    """Predict the launches a --json run recorded again, with the model's current code."""
    recorded = json.loads(Path(args.replay).read_text())
    if not recorded.get("launches"):
        raise SystemExit(f"{args.replay}: no launches recorded (written before --replay existed)")
    recorded["replayed"] = args.replay
    for entry in recorded["links"].values():
        entry["predicted"] = {}
    report(recorded, recorded["launches"], args)


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replay:
        return replay(args)
    rates = [NO_NAMESPACE] if args.smoke else args.rate_gbps
    emulated = rates is not None
    if args.smoke:
        args.world_sizes, (warmup, steps) = "2", (1, 1)
    else:
        warmup, steps = (2, args.steps) if emulated else (WARMUP_STEPS, TIMED_STEPS)
    if emulated and not args.smoke:
        from gradcomp.emulate import unavailable_reason

        reason = unavailable_reason()
        if reason:
            print(f"skipped: {reason}")
            return
    results = {"model": f"MLP {LAYERS} x Linear({WIDTH}, {WIDTH}), batch {BATCH}",
               "torch": torch.__version__, "cpus": os.cpu_count(),
               "load_average_before": os.getloadavg(), "links": {}}
    if emulated:
        from gradcomp.emulate import KEEP_FREED_MEMORY

        results["malloc"] = KEEP_FREED_MEMORY  # the ranks' glibc malloc settings (4c142e2 to 7392dde: "keep-freed")
    launches = {}
    for rate in rates if emulated else [None]:
        label = ("unshaped" if rate is None else rate if rate == NO_NAMESPACE else f"{rate:g}") \
            if emulated else "loopback"
        entry = results["links"][label] = {"rate_gbps": rate if isinstance(rate, float) else None,
                                           "runs": {}, "predicted": {}}
        for world_size in (int(p) for p in args.world_sizes.split(",")):
            runs, launched = launch(world_size, rate, emulated, warmup, steps)
            entry["runs"][str(world_size)] = slowest(runs)
            if launched is not None:
                launches.setdefault(label, {})[str(world_size)] = launched
    results["load_average_after"] = os.getloadavg()
    report(results, launches, args)


if __name__ == "__main__":
    main()
