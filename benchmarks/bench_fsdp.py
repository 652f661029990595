"""FSDP2 step time and wire bytes, plain vs gradcomp.fsdp, on 2 and 4 Gloo ranks on 127.0.0.1.

    python benchmarks/bench_fsdp.py            # prints a table, writes benchmarks/results/bench_fsdp.json

Model: an MLP of 4 Linear(512, 512) layers (1.05M parameters), each layer and the root wrapped
with fully_shard; batch 64; SGD. Step time: median over the timed steps, max over ranks.
Wire bytes per step: what each rank hands to the reduce-scatter (plain: (p-1)/p x 4 bytes per
parameter, what a ring reduce-scatter sends; compressed: from the handle's statistics).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dist_utils import run_ranks  # noqa: E402

WIDTH, LAYERS, BATCH = 512, 4, 64
WARMUP_STEPS, TIMED_STEPS = 3, 12
METHODS = (None, "bf16", "int8", "int4", "sign")


def measure(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    import gradcomp.fsdp

    rows = {}
    for method in METHODS:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        handle = gradcomp.fsdp.compress(model, method) if method else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        data = torch.Generator().manual_seed(rank)
        times = []
        for step in range(WARMUP_STEPS + TIMED_STEPS):
            x = torch.randn(BATCH, WIDTH, generator=data)
            dist.barrier()
            start = time.perf_counter()
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step >= WARMUP_STEPS:
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


def main() -> None:
    results = {"model": f"MLP {LAYERS} x Linear({WIDTH}, {WIDTH}), batch {BATCH}",
               "timed_steps": TIMED_STEPS, "torch": torch.__version__, "cpus": os.cpu_count(),
               "runs": {}}
    print(f"{'p':>2} {'method':>6} {'step ms':>8} {'vs plain':>8} {'wire KB/step':>12} "
          f"{'ratio':>6} {'compress ms':>11} {'comm ms':>8} {'decode ms':>9}")
    for world_size in (2, 4):
        per_rank = run_ranks(measure, world_size, timeout_s=600)
        table = {}
        for method in per_rank[0]:
            row = dict(per_rank[0][method])
            row["step_s"] = max(r[method]["step_s"] for r in per_rank)
            table[method] = row
        results["runs"][str(world_size)] = table
        for method, row in table.items():
            comm_ms = "-" if row["comm_s_per_step"] is None else f"{1e3 * row['comm_s_per_step']:.1f}"
            print(f"{world_size:>2} {method:>6} {1e3 * row['step_s']:>8.1f} "
                  f"{row['step_s'] / table['plain']['step_s']:>8.2f} "
                  f"{row['wire_bytes_per_step'] / 1024:>12.1f} "
                  f"{row['raw_bytes_per_step'] / row['wire_bytes_per_step']:>6.2f} "
                  f"{1e3 * row['compress_s_per_step']:>11.1f} {comm_ms:>8} "
                  f"{1e3 * row['decompress_s_per_step']:>9.1f}")
    out = Path(__file__).resolve().parent / "results" / "bench_fsdp.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
