"""Ops benchmark: every method's compress and decompress on float32 tensors, against memcpy.

For each size (1M, 25M, 100M elements; ``--quick``: 1M and 25M) and method: median compress and
decompress time over repeats, GB/s (fp32 input bytes / time), compression ratio, and the fraction
of the memory-copy bandwidth measured in the same run, beside the method: copy time / (compress
+ decompress time), where copy is ``out.copy_(x)`` into a preallocated fp32 tensor (the target
is >= 0.25 for fp16/bf16/int8/int4/sign). Decompress writes into a preallocated tensor (``decompress(p, out=)``,
as a DDP hook writes into its bucket); ``decompress new`` allocates its result (fresh pages cost
a page fault each, see docs/methods.md). Plus the top-k threshold selector against exact
``torch.topk`` at 25M elements, ratio 0.01, with the count each keeps.

    python benchmarks/bench_ops.py [--quick] [--repeats N] [--threads N] [--json PATH] [--smoke]

``--smoke``: 64K elements only, top-k included, one timed call each (seconds; checks the script
end to end, its times mean nothing).

Every time is reported as wall time and as CPU time of this process (``copy fraction (CPU
time)``): on a machine shared with other jobs the wall time also holds the time spent waiting for
a core. The load average before and after goes into the JSON. Prints a tabulate table; writes JSON
only with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M and 25M elements only")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per measurement")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice, one per core)")
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: 64K elements, one timed call each (checks the script; times mean nothing)")
    return parser


if __name__ == "__main__":  # --help and argument errors answer before torch is imported
    build_parser().parse_args()
    # the compiled CPU fast path from the first call, as a long run has it (by default gradcomp runs
    # a function eagerly until that has taken as long as compiling it: gradcomp.methods.fast)
    os.environ.setdefault("GRADCOMP_CPU_COMPILE_AFTER_S", "0")

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import gradcomp  # noqa: E402
from gradcomp.methods.fast import compile_min_numel  # noqa: E402

SIZES = {"1M": 1_000_000, "25M": 25_000_000, "100M": 100_000_000}
QUICK = ("1M", "25M")
SMOKE_SIZE = 1 << 16
TARGET_METHODS = ("fp16", "bf16", "int8", "int4", "sign")
"""Held to the copy-fraction target: a subset by intent, the streaming encoders (top-k selects,
PowerSGD multiplies matrices; top-k has its own target)."""
TARGET_COPY_FRACTION = 0.25
TOPK_SIZE, TOPK_RATIO, TOPK_TARGET = 25_000_000, 0.01, 20.0
MIN_ELEMENTS = 200_000_000
"""Elements a measurement covers at least: a 1M-element copy takes ~0.14 ms, and 7 calls of it
measured anywhere from 0.14 to 0.29 ms between runs."""


def median_times(fn, repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds of ``fn()``, medians over ``repeats`` calls after one warm-up call.

    CPU time (all threads of this process) is the work done; on a shared machine wall time also
    holds the time spent waiting for a core, so both are reported.
    """
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def bench_size(label: str, n: int, repeats: int, min_elements: int = MIN_ELEMENTS) -> list[dict]:
    """One row per method at n elements. Each measurement is the median of max(repeats,
    min_elements / n) calls (1M: 200), and the copy is timed again beside every method, so that a
    ratio compares two timings taken under the same machine state."""
    calls = max(repeats, min_elements // n)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    rows = []
    for name in gradcomp.METHODS:  # compile, and let the allocator settle at this size, untimed
        method = gradcomp.get_method(name)
        method.decompress(method.compress(x), out)
    for name in gradcomp.METHODS:
        method = gradcomp.get_method(name)
        payload = method.compress(x)
        copy, copy_cpu = median_times(lambda: out.copy_(x), calls)
        t_compress, cpu_compress = median_times(lambda: method.compress(x), calls)
        t_decompress, cpu_decompress = median_times(lambda: method.decompress(payload, out), calls)
        t_new, _ = median_times(lambda: method.decompress(payload), calls)
        rows.append({
            "size": label, "numel": n, "method": name,
            "compress_ms": 1e3 * t_compress, "decompress_ms": 1e3 * t_decompress,
            "decompress_new_ms": 1e3 * t_new, "copy_ms": 1e3 * copy,
            "compress_gbps": 4 * n / t_compress / 1e9, "decompress_gbps": 4 * n / t_decompress / 1e9,
            "ratio": payload.ratio, "copy_fraction": copy / (t_compress + t_decompress),
            "copy_fraction_cpu_time": copy_cpu / (cpu_compress + cpu_decompress),
        })
    return rows


def bench_topk(repeats: int, n: int = TOPK_SIZE) -> dict:
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    exact = gradcomp.get_method("topk", ratio=TOPK_RATIO, selector="exact")
    threshold = gradcomp.get_method("topk", ratio=TOPK_RATIO, selector="threshold")
    t_exact, cpu_exact = median_times(lambda: exact.compress(x), max(1, repeats // 3))
    t_threshold, cpu_threshold = median_times(lambda: threshold.compress(x), repeats)
    p_exact, p_threshold = exact.compress(x), threshold.compress(x)
    same = set(p_exact.parts["indices"].tolist()) == set(p_threshold.parts["indices"].tolist())
    return {"numel": n, "ratio": TOPK_RATIO, "k": exact.k(n),
            "exact_ms": 1e3 * t_exact, "threshold_ms": 1e3 * t_threshold,
            "speedup": t_exact / t_threshold, "speedup_cpu_time": cpu_exact / cpu_threshold,
            "kept_exact": p_exact.parts["indices"].numel(),
            "kept_threshold": p_threshold.parts["indices"].numel(), "same_set": same}


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    if args.smoke:
        args.repeats = 1
        rows = bench_size("64K", SMOKE_SIZE, args.repeats, min_elements=0)
        topk = bench_topk(args.repeats, SMOKE_SIZE)
    else:
        labels = QUICK if args.quick else tuple(SIZES)
        rows = [row for label in labels for row in bench_size(label, SIZES[label], args.repeats)]
        topk = bench_topk(args.repeats)
    table = [[r["size"], r["method"], f"{r['compress_ms']:.2f}", f"{r['decompress_ms']:.2f}",
              f"{r['decompress_new_ms']:.2f}", f"{r['copy_ms']:.2f}", f"{r['compress_gbps']:.1f}",
              f"{r['decompress_gbps']:.1f}", f"{r['ratio']:.1f}", f"{r['copy_fraction']:.2f}",
              f"{r['copy_fraction_cpu_time']:.2f}",
              ("ok" if r["copy_fraction"] >= TARGET_COPY_FRACTION else "MISS")
              if r["method"] in TARGET_METHODS else ""] for r in rows]
    print(tabulate(table, headers=["size", "method", "compress ms", "decompress ms",
                                   "decompress new ms", "copy ms", "compress GB/s",
                                   "decompress GB/s", "ratio", "copy fraction",
                                   "copy fraction (CPU time)", ">= 0.25"]))
    print()
    print(tabulate([[f"{topk['numel']:,}", topk["ratio"], topk["k"],
                     f"{topk['exact_ms']:.1f}", f"{topk['threshold_ms']:.1f}",
                     f"{topk['speedup']:.1f}x", f"{topk['speedup_cpu_time']:.1f}x", topk["kept_exact"], topk["kept_threshold"],
                     topk["same_set"], "ok" if topk["speedup"] >= TOPK_TARGET else "MISS"]],
                   headers=["topk size", "ratio", "k", "exact ms", "threshold ms", "speedup",
                            "speedup (CPU time)", "kept (exact)", "kept (threshold)", "same set", ">= 20x"]))
    result = {
        "command": "python benchmarks/bench_ops.py" + (" --quick" if args.quick else "")
                   + (" --smoke" if args.smoke else "")
                   + f" --repeats {args.repeats}"
                   + (f" --threads {args.threads}" if args.threads is not None else ""),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads":
                    torch.get_num_threads(), "python": platform.python_version(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg(),
                    "compile_min_numel": compile_min_numel()},
        "ops": rows, "topk": topk,
    }
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
