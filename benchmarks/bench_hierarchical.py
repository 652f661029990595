"""Hierarchical vs flat compression: bytes per link class counted by the hooks on 4 Gloo ranks as
2 nodes x 2, and the analyser's step-time prediction on real node presets.

    python benchmarks/bench_hierarchical.py [--json PATH] [--smoke]

Prints two tables; writes JSON only with ``--json``. ``--smoke``: the ``mlp-small`` workload for 2
steps (seconds; checks the script end to end).

Part 1 (measured): the ``mlp`` workload (4 x Linear(1024), 4.2M parameters, DDP's default
buckets) trained for a few steps on 4 ranks under DDP's uncompressed all-reduce, the flat int8
hooks (all-gather, two-phase) and the hierarchical hooks (node_size 2: int8 all-gather and
two-phase, fp16); bytes per rank per step after DDP's bucket rebuild, as the hooks count them
(bytes handed to collectives). The flat hooks run one collective over all 4 ranks, so their
payload crosses both link classes; the hierarchical hook counts its exact intra-node
reduce-scatter + all-gather inputs and its compressed inter-node payloads apart. Beside each, the
analyser's bytes for the same model (``simulate(...).wire_bytes`` / ``exact_bytes``).

Part 2 (predicted): step time of GPT-2 1.5B and Llama-7B on 64 GPUs in nodes of 8 (preset
nodes: NVLink inside, InfiniBand NDR or 100 GbE per GPU between nodes): uncompressed, flat and
hierarchical compression.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--smoke", action="store_true", help="seconds: the mlp-small workload for 2 steps")
    return parser


if __name__ == "__main__":  # --help and argument errors answer before torch is imported
    build_parser().parse_args()
    # the compiled CPU fast path from the first call, as a long run has it (by default gradcomp runs
    # a function eagerly until that has taken as long as compiling it: gradcomp.methods.fast)
    os.environ.setdefault("GRADCOMP_CPU_COMPILE_AFTER_S", "0")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from dist_utils import run_ranks  # noqa: E402

NODE_SIZE, WORLD_SIZE, STEPS, BATCH = 2, 4, 4, 16
WORKLOAD = "mlp"
RUNS = {  # label: (hierarchical, method, options)
    "none": (False, "none", {}),
    "int8:allgather": (False, "int8", {}),
    "int8:twophase": (False, "int8", {"scheme": "twophase"}),
    "hier:int8:allgather": (True, "int8", {}),
    "hier:int8:twophase": (True, "int8", {"scheme": "twophase"}),
    "hier:fp16": (True, "fp16", {}),
}
PREDICTIONS = [("gpt2-1.5b", "dgx-h100"), ("gpt2-1.5b", "hgx-h100-100gbe"),
               ("llama-7b", "dgx-h100"), ("llama-7b", "hgx-h100-100gbe")]


def measure(rank: int, world_size: int, workload_name: str = WORKLOAD, steps: int = STEPS) -> dict:
    """Per run label: bytes per rank per step by link class (``wire``: a flat hook's total),
    averaged over steps 2..``steps`` (after DDP's bucket rebuild)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcomp.hooks
    from gradcomp.emulate import workload

    out = {}
    for label, (is_hierarchical, method, options) in RUNS.items():
        module, batch, loss_fn = workload(workload_name, BATCH, seed=0)
        ddp = DDP(module)
        placement = {"hierarchical": True, "node_size": NODE_SIZE} if is_hierarchical else {}
        state = gradcomp.hooks.register(ddp, method, **placement, **options)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        marks = []
        for _ in range(steps):
            optimizer.zero_grad()
            loss_fn(ddp, batch).backward()
            optimizer.step()
            marks.append(dict(getattr(state, "link_bytes", {"wire": state.stats.totals["wire_bytes"]})))
        out[label] = {k: (marks[-1][k] - marks[0][k]) / (steps - 1) for k in marks[0]}
    return out


def predicted_bytes(workload_name: str = WORKLOAD) -> dict:
    """The analyser's bytes per rank per step for the same model and ranks (2 x 2)."""
    from gradcomp.analysis import Choice, Compute, Link, Network, Scenario, from_module, preset_profile, simulate
    from gradcomp.analysis.presets import device
    from gradcomp.emulate import workload

    spec = from_module(workload(workload_name, BATCH)[0], workload_name)
    network = Network(WORLD_SIZE, Link("inter", 1.0, 10.0), NODE_SIZE, Link("intra", 10.0, 1.0))
    scenario = Scenario(spec, network, preset_profile(device("cpu")), Compute(0.01, 0.02))
    out = {}
    for label, (is_hierarchical, method, options) in RUNS.items():
        choice = Choice(method, {}, options.get("scheme", ""), is_hierarchical)
        step = simulate(scenario, choice)
        out[label] = {"wire": step.wire_bytes, "exact": step.exact_bytes}
    return out


def predictions() -> list[dict]:
    from gradcomp.analysis import Choice, estimate, make_scenario, node

    choices = [Choice("none"), Choice("int8", {}, "twophase"), Choice("int4", {}, "twophase"),
               Choice("int8", {}, "twophase", True), Choice("int4", {}, "twophase", True),
               Choice("fp16", {}, "", True)]
    rows = []
    for model, node_name in PREDICTIONS:
        preset = node(node_name)
        for world_size in (8, 64):
            scenario = make_scenario(model, world_size, preset.device, preset.inter, gpus_per_node=preset.gpus,
                                     intra_link=preset.intra)
            usable = [c for c in choices if world_size > preset.gpus or not c.hierarchical]
            for e in estimate(scenario, usable, crossovers=False):
                rows.append({"model": model, "node": node_name, "world_size": world_size, "method": e.method,
                             "step_ms": 1e3 * e.step_s, "speedup": e.speedup,
                             "inter_or_wire_mib": e.wire_bytes / 2 ** 20, "exact_mib": e.exact_bytes / 2 ** 20})
    return rows


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    workload_name, steps = ("mlp-small", 2) if args.smoke else (WORKLOAD, STEPS)
    per_rank = run_ranks(measure, WORLD_SIZE, workload_name, steps, timeout_s=300)
    guess = predicted_bytes(workload_name)
    print(f"{workload_name} on {WORLD_SIZE} ranks as {WORLD_SIZE // NODE_SIZE} x {NODE_SIZE}; "
          "KB per rank per step (rank 0)")
    print(f"{'hook':>20} {'intra exact':>12} {'inter compr.':>13} {'flat total':>11} {'pred. exact':>12} "
          f"{'pred. wire':>11}")
    for label, counted in per_rank[0].items():
        intra, inter = counted.get("intra"), counted.get("inter")
        flat = counted.get("wire")
        print(f"{label:>20} {'-' if intra is None else f'{intra / 1024:.1f}':>12} "
              f"{'-' if inter is None else f'{inter / 1024:.1f}':>13} {'-' if flat is None else f'{flat / 1024:.1f}':>11} "
              f"{guess[label]['exact'] / 1024:>12.1f} {guess[label]['wire'] / 1024:>11.1f}")
    rows = predictions()
    print()
    print(f"{'model':>10} {'node':>16} {'p':>3} {'method':>20} {'step ms':>8} {'speedup':>8} {'wire MiB':>9} "
          f"{'exact MiB':>10}")
    for r in rows:
        print(f"{r['model']:>10} {r['node']:>16} {r['world_size']:>3} {r['method']:>20} {r['step_ms']:>8.1f} "
              f"{r['speedup']:>8.2f} {r['inter_or_wire_mib']:>9.1f} {r['exact_mib']:>10.1f}")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"torch": torch.__version__, "cpus": os.cpu_count(), "workload": workload_name,
                                   "counted": per_rank, "predicted_bytes": guess, "predictions": rows},
                                  indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
