"""Wall-clock time to a held-out loss over a link: a run's losses, its step times on that link.

    python examples/time_to_loss.py --target docs/results/optim/gpt/none/seed0 --within 3 --json out.json \
        "none=docs/results/optim/gpt/none/seed0@results/link100/none" \
        "DiLoCo H10 sign=results/diloco/gpt/h10/seed0@results/link100/diloco-h10"

Each LABEL=RUN@LINK: RUN a finished run of examples/experiment.py (its evals.csv: held-out loss
at each evaluation), LINK a run of the same configuration for its first K steps over the
emulated link (``experiment.py run ... --link-gbps R --stop-after K``: its steps.csv holds each
step's seconds). Step i <= K takes its measured seconds on the link; a later step the mean of
the link run's last ``--tail`` steps (default: its second half, so that periodic exchanges,
e.g. DiLoCo's every H steps, count at their rate: pick K and the tail as whole periods). The
time to the target is the sum over the steps up to the first evaluation at or below it; a run
that never gets there is given its whole run's time, marked not reached.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN@LINK")
    parser.add_argument("--target", required=True,
                        help="held-out loss to reach: a number, or a run folder (its last evaluation's loss)")
    parser.add_argument("--within", type=float, default=0.0,
                        help="percent above the target that counts as reached (default 0)")
    parser.add_argument("--tail", type=int, default=None,
                        help="steps at the end of each link run whose mean prices the steps after it "
                             "(default: half of the link run)")
    parser.add_argument("--json", type=Path, help="write the records here")
    return parser


if __package__ in (None, ""):  # run as a script: make ``examples`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_run(text: str) -> tuple[str, Path, Path]:
    """``LABEL=RUN@LINK`` -> (label, run folder, link run folder)."""
    label, sep, folders = text.partition("=")
    run, at, link = folders.rpartition("@")
    if not sep or not at or not label or not run or not link:
        raise ValueError(f"expected LABEL=RUN@LINK, got {text!r}")
    return label, Path(run), Path(link)


def seconds_to_step(link_steps: list[dict], steps: int, tail: int | None = None, block: int | None = None,
                    exact=()) -> float:
    """Seconds over the link of a run's first ``steps`` steps: step i <= K (the link run's steps)
    at its measured seconds, a later one at the mean of the link run's last ``tail`` steps
    (default: its second half). link_steps: rows with ``step`` and ``step_s``, steps 1..K in order.

    ``block``: each step i <= K at the median of its block of ``block`` steps instead (steps
    1..block, block+1..2 block, ...), a later one at the median of the last ``tail``: a step
    stalled by something outside the work (another process on the cores, a TCP retransmission
    timeout) is not counted, where every step of a block does the same work (a fixed hook).
    ``exact``: steps (1-based) that do other work (auto's evaluations), counted at their measured
    seconds all the same."""
    if not link_steps:
        raise ValueError("the link run has no steps")
    seconds = [row["step_s"] for row in link_steps]
    if [int(row["step"]) for row in link_steps] != list(range(1, len(seconds) + 1)):
        raise ValueError("the link run's steps must be 1, 2, ... K in order")
    tail = tail or max(len(seconds) // 2, 1)
    if not 1 <= tail <= len(seconds):
        raise ValueError(f"--tail must be in [1, {len(seconds)}] (the link run's steps), got {tail}")
    if block is None:
        return sum(seconds[:steps]) + max(steps - len(seconds), 0) * sum(seconds[-tail:]) / tail
    if block < 1:
        raise ValueError(f"block must be >= 1 step, got {block}")
    priced = [statistics.median(seconds[at:at + block]) for at in range(0, len(seconds), block)]
    exact = set(exact)
    measured = sum(seconds[i] if i + 1 in exact else priced[i // block] for i in range(min(steps, len(seconds))))
    return measured + max(steps - len(seconds), 0) * statistics.median(seconds[-tail:])


def time_to_loss(evals: list[dict], link_steps: list[dict], target: float, tail: int | None = None) -> dict:
    """Seconds over the link to the first evaluation at or below ``target`` (see the module doc).

    evals: rows with ``step`` and ``heldout_loss``; link_steps: rows with ``step`` and
    ``step_s``, steps 1..K in order."""
    if not evals:
        raise ValueError("the run has no evaluations")
    reached = next((row for row in evals if row["heldout_loss"] <= target), None)
    steps = int((reached or evals[-1])["step"])
    seconds = seconds_to_step(link_steps, steps, tail)  # checks the link run and the tail
    tail = tail or max(len(link_steps) // 2, 1)
    return {"target": target, "reached": reached is not None, "steps": steps,
            "loss": (reached or evals[-1])["heldout_loss"], "link_steps": len(link_steps),
            "tail_s_per_step": sum(row["step_s"] for row in link_steps[-tail:]) / tail,
            "seconds": seconds}


def target_loss(text: str, read_csv) -> float:
    """``--target``: a number, or a run folder whose last evaluation's held-out loss it is."""
    try:
        return float(text)
    except ValueError:
        evals = read_csv(Path(text) / "evals.csv")
        if not evals:
            raise FileNotFoundError(f"--target {text!r}: neither a number nor a run folder with evals.csv") from None
        return evals[-1]["heldout_loss"]


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    from tabulate import tabulate

    from examples.experiment import read_csv

    if args.within < 0:
        raise ValueError(f"--within must be >= 0 percent, got {args.within}")
    target = target_loss(args.target, read_csv) * (1 + args.within / 100)
    records = []
    for text in args.runs:
        label, run, link = parse_run(text)
        evals, link_steps = read_csv(run / "evals.csv"), read_csv(link / "steps.csv")
        if not evals:
            raise FileNotFoundError(f"{run / 'evals.csv'}: missing or empty")
        if not link_steps:
            raise FileNotFoundError(f"{link / 'steps.csv'}: missing or empty")
        config = link / "config.json"
        rate = json.loads(config.read_text()).get("link_gbps") if config.is_file() else None
        record = {"label": label, "run": str(run), "link_run": str(link), "link_gbps": rate,
                  **time_to_loss(evals, link_steps, target, args.tail)}
        records.append(record)
    print(tabulate([[r["label"], r["link_gbps"], f"{r['tail_s_per_step']:.3f}",
                     r["steps"] if r["reached"] else f"not reached ({r['steps']} steps, {r['loss']:.3f})",
                     f"{r['seconds']:.0f}"] for r in records],
                   headers=["run", "link Gbit/s", "s/step on the link", f"steps to {target:.4g}",
                            "seconds"]))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return records


if __name__ == "__main__":
    main()
