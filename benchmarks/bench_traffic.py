"""Bytes moved per gradient element by one step of every front on the CUDA path, beside the minimum.

No timing: the traffic account (tests/traffic_account.py) counts, on Gloo ranks on 127.0.0.1 with
GRADCOMP_BACKEND=triton and the Triton interpreter, the global-memory bytes of every kernel launch
(its own loads and stores) and every torch operator on the data (operands read once, results
written once) in one step of each front: every DDP hook (hierarchical and auto's choices
included), gradcomp.fsdp's collectives and the optimizers' exchange. The collectives' own traffic
is not counted. Every count is affine in n at a fixed shape class, so the line through the account
at two sizes gives the bytes at 1M, 16M and 100M elements, and the account at a third size checks
the line. The minimum per front and its formula: docs/kernels.md, "Traffic account".

    python benchmarks/bench_traffic.py [--world 2] [--base 32768] [--fronts LABEL,...]
                                       [--json PATH] [--smoke]

Prints the table; writes JSON only with ``--json``. ``--smoke``: base 8192, four fronts
(fp16, int8, fsdp int8, exchange int8; seconds).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

SIZES = (1 << 20, 16 << 20, 100 << 20)
"""The sizes the table is given at (elements)."""
SMOKE_FRONTS = ("fp16", "int8", "fsdp int8", "exchange int8")


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="Gloo ranks (>= 2)")
    parser.add_argument("--base", type=int, default=32768,
                        help="the account runs at base, 2 base and 3 base elements (a multiple of 8192)")
    parser.add_argument("--fronts", help="comma-separated front labels (default: every front)")
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--smoke", action="store_true", help="base 8192, four fronts (seconds)")
    return parser


if __name__ == "__main__":  # --help and argument errors answer before torch is imported
    args = build_parser().parse_args()
    if args.world < 2 or args.base <= 0 or args.base % 8192:
        build_parser().error("--world must be >= 2 and --base a positive multiple of 8192")

import json  # noqa: E402
import os  # noqa: E402

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels run on this CPU
os.environ["TRITON_DEFAULT_FP_FUSION"] = "0"
# the interpreter runs kernels in numpy, which warns at every inf / NaN a kernel makes on purpose
os.environ.setdefault("PYTHONWARNINGS", "ignore::RuntimeWarning")

from tabulate import tabulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from dist_utils import run_ranks  # noqa: E402
from traffic_account import BOUND, FRONTS, account, fit, table_at, worst_fit_error  # noqa: E402


def _largest(torch_ops: dict, n: int, shown: int = 4) -> str:
    """The ``shown`` torch operators that moved the most, in bytes per element."""
    return ", ".join(f"{name} {moved / n:.2f}" for name, moved in list(torch_ops.items())[:shown])


def main(args) -> dict:
    base = 8192 if args.smoke else args.base
    labels = SMOKE_FRONTS if args.smoke else (args.fronts.split(",") if args.fronts else None)
    unknown = set(labels or ()) - {f.label for f in FRONTS}
    if unknown:
        raise SystemExit(f"bench_traffic: unknown fronts {sorted(unknown)}; known: "
                         f"{', '.join(f.label for f in FRONTS)}")
    accounts = {n: run_ranks(account, args.world, n, labels, timeout_s=600)[0]
                for n in (base, 2 * base, 3 * base)}
    lines = fit(accounts)
    error = worst_fit_error(lines, accounts[3 * base])
    rows = [row for n in SIZES for row in table_at(lines, accounts[base], n)]
    # numbers formatted here, kept as written (tabulate would print a ratio of 1.00 as 1)
    print(tabulate([[r["front"], r["method"], r["scheme"], f"{r['n']:,}", f"{r['bytes_per_element']:.2f}",
                     "-" if r["ratio"] is None else f"{r['minimum_per_element']:.2f}",
                     "-" if r["ratio"] is None else f"{r['ratio']:.2f}"] for r in rows],
                   headers=["front", "method", "scheme", "n", "bytes/elem", "minimum", "ratio"],
                   disable_numparse=True, colalign=("left",) * 3 + ("right",) * 4))
    print("\nwhere the bytes go (at the largest counted size, per element): kernels, torch operators")
    print(tabulate([[r["front"], f"{r['kernel_bytes'] / r['n']:.2f}", f"{r['torch_bytes'] / r['n']:.2f}",
                     _largest(r["torch_ops"], r["n"])] for r in accounts[3 * base]],
                   headers=["front", "kernels", "torch ops", "largest torch ops"],
                   disable_numparse=True, colalign=("left", "right", "right", "left")))
    over = sorted({r["front"] for r in rows if r["ratio"] is not None and r["ratio"] > BOUND})
    print(f"\n{args.world} ranks; counted at {base}, {2 * base}, {3 * base} elements; the line through "
          f"the first two predicts the third within {error:.2%} (fronts whose path depends on the data "
          f"excepted: {', '.join(f.label for f in FRONTS if f.data_dependent)})")
    print(f"above {BOUND}x the minimum: {', '.join(over) if over else 'none'}")
    return {"world": args.world, "counted_at": [base, 2 * base, 3 * base], "fit_error": error,
            "bound": BOUND, "above_bound": over, "rows": rows,
            "accounts": {str(n): rows_n for n, rows_n in accounts.items()}}


if __name__ == "__main__":
    report = main(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
