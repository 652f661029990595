"""The noise ratio `auto`'s quality budget reads (gradcomp.analysis.auto.noise_ratio), measured on
the byte-level GPT of docs/convergence.md as it trains uncompressed with AdamW.

    python benchmarks/noise_ratios.py [--steps 300] [--every 50] [--json PATH]
    python benchmarks/noise_ratios.py --smoke     # a tiny model, 6 steps: seconds

Each step, P simulated ranks (one process) each take a minibatch of the same seeded corpus windows
as the convergence runs' ranks would (batch 16, context 128), their gradients are averaged and
AdamW steps on the average: the uncompressed run. At every ``--every`` steps, each rank's flat
gradient is also compressed and decoded by each method (no error feedback) and the method's noise
ratio computed from the sums over ranks, as the auto hook does for one bucket holding the whole
model. Prints a table (rows: steps; columns: methods) and the JSON.

What it shows: where each method's ratio sits against the default budget over a run. What it
cannot show: whether a method within the budget trains as well (that is the convergence runs'
question), nor the ratio under error feedback (the residual changes what is compressed).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--every", type=int, default=50, help="steps between measurements (default 50)")
    parser.add_argument("--ranks", type=int, default=4, help="simulated ranks (default 4)")
    parser.add_argument("--smoke", action="store_true", help="seconds: a tiny model, 6 steps")
    parser.add_argument("--json", help="write the rows here")
    return parser


if __name__ == "__main__":  # --help and argument errors answer before torch is imported
    build_parser().parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tabulate import tabulate  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradcomp  # noqa: E402
from examples.data import batch_generator, split_text, stdlib_corpus, text_batch  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402
from gradcomp.analysis.auto import DEFAULT_QUALITY_BUDGET, compression_error_sq, noise_ratio  # noqa: E402

METHODS = ("fp16", "int8", "int4", "sign", "topk")


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def ratios(gradients: list[torch.Tensor]) -> dict[str, float]:
    """Each method's noise ratio over the ranks' flat gradients (fp32 [n] each)."""
    mean = torch.stack(gradients).mean(0)
    local_sq = sum(float(g.double().square().sum()) for g in gradients)
    mean_sq = float(mean.double().square().sum())
    out = {}
    for name in METHODS:
        method = gradcomp.get_method(name)
        error_sq = sum(float(compression_error_sq(method, g)) for g in gradients)
        out[name] = noise_ratio(local_sq, error_sq, mean_sq, len(gradients))
    return out


def run(steps: int, every: int, ranks: int, config: GPTConfig, corpus_mb: float, seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    text = split_text(stdlib_corpus(int(corpus_mb * 2**20)), config.context)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    rows = []
    for step in range(steps + 1):
        gradients = []
        for rank in range(ranks):
            x, y = text_batch(text.train, config.context, 16, batch_generator(seed, step, rank))
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            gradients.append(flat_grad(model).clone())
        if step % every == 0:
            rows.append({"step": step, **ratios(gradients)})
            print(f"step {step}: " + ", ".join(f"{m} {rows[-1][m]:.3g}" for m in METHODS),
                  file=sys.stderr, flush=True)
        offset = 0
        average = torch.stack(gradients).mean(0)
        for p in model.parameters():
            p.grad = average[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
    return rows


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("steps", "every", "ranks"):
        if getattr(args, name) < (2 if name == "ranks" else 1):
            build_parser().error(f"--{name} must be >= {2 if name == 'ranks' else 1}, got {getattr(args, name)}")
    if args.smoke:
        config, steps, every, corpus_mb = GPTConfig(context=32, n_layer=1, d_model=32, n_head=2), 6, 3, 0.05
    else:
        config, steps, every, corpus_mb = GPTConfig(), args.steps, args.every, 8.0
    rows = run(steps, every, args.ranks, config, corpus_mb)
    print(tabulate([[r["step"], *(f"{r[m]:.3g}" for m in METHODS)] for r in rows],
                   headers=["step", *METHODS]))
    print(f"budget (auto's default): {DEFAULT_QUALITY_BUDGET}")
    if args.json:
        out = {"workload": "byte-level GPT, AdamW, uncompressed, batch 16 per rank",
               "ranks": args.ranks, "steps": steps, "model": {k: getattr(config, k) for k in
                                                              ("n_layer", "d_model", "n_head", "context")},
               "budget": DEFAULT_QUALITY_BUDGET, "methods": list(METHODS), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
