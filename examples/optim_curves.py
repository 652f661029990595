"""Held-out and training loss against wire bytes per rank, for runs of examples/experiment.py.

    python examples/optim_curves.py --out docs/results/optim/gpt_loss_vs_bytes.png \
        none=docs/results/gpt/none sign+EF=docs/results/gpt/sign zeroone=results/optim/gpt/zeroone-w32-r16-int8

Each LABEL=DIR names a configuration folder holding seed<S>/ runs (steps.csv, evals.csv); seeds
are averaged step by step. The x axis is the cumulative wire bytes of rank 0 (log scale).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("runs", nargs="+", metavar="LABEL=DIR")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    return parser


if __name__ == "__main__":  # --help and argument errors answer before torch is imported
    build_parser().parse_args()

import numpy as np  # noqa: E402

if __package__ in (None, ""):  # run as a script: make ``examples`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.experiment import moving_average, read_csv, save_figure  # noqa: E402


def seed_runs(folder: Path) -> list[Path]:
    runs = sorted(p for p in folder.glob("seed*") if (p / "evals.csv").is_file())
    if not runs:
        raise FileNotFoundError(f"no seed*/evals.csv under {folder}")
    return runs


def curves(folder: Path) -> dict:
    """Seed means: wire bytes and held-out loss at each evaluation, training loss at each step."""
    runs = seed_runs(folder)
    steps = [read_csv(r / "steps.csv") for r in runs]
    evals = [read_csv(r / "evals.csv") for r in runs]
    length = min(len(s) for s in steps)
    wire = np.mean([[row["wire_bytes"] for row in s[:length]] for s in steps], axis=0)
    loss = np.mean([[row["loss"] for row in s[:length]] for s in steps], axis=0)
    eval_steps = [int(row["step"]) for row in evals[0] if row["step"] <= length]
    heldout = np.mean([[row["heldout_loss"] for row in e[:len(eval_steps)]] for e in evals], axis=0)
    return {"wire": wire, "loss": loss, "eval_wire": wire[np.array(eval_steps) - 1], "heldout": heldout,
            "seeds": len(runs)}


def plot(runs: dict[str, Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (heldout_axis, train_axis) = plt.subplots(1, 2, figsize=(13, 5))
    for label, folder in runs.items():
        c = curves(folder)
        name = f"{label} ({c['seeds']} seed{'s' if c['seeds'] > 1 else ''})"
        heldout_axis.plot(c["eval_wire"] / 1e6, c["heldout"], marker="o", markersize=3, label=name)
        smooth, window = moving_average(c["loss"])
        train_axis.plot(c["wire"][window - 1:] / 1e6, smooth, label=name)
    heldout_axis.set(xscale="log", xlabel="wire MB sent per rank (cumulative)", ylabel="held-out loss",
                     title="held-out loss vs bytes")
    train_axis.set(xscale="log", xlabel="wire MB sent per rank (cumulative)",
                   ylabel="training loss (moving average)", title="training loss vs bytes")
    save_figure(plt, fig, (heldout_axis, train_axis), heldout_axis, out)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    runs = {}
    for item in args.runs:
        label, sep, folder = item.partition("=")
        if not sep or not label or not folder:
            parser.error(f"expected LABEL=DIR, got {item!r}")
        runs[label] = Path(folder)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
