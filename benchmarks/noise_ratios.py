"""The noise ratio `auto`'s quality budget reads (gradcomp.analysis.auto.noise_ratio), measured as a
model trains uncompressed: the byte-level GPT of docs/convergence.md (AdamW) or ResNet-20 on the
digits (SGD, or AdamW with --optimizer adamw).

    python benchmarks/noise_ratios.py [--model gpt] [--steps 300] [--every 50] [--json PATH]
    python benchmarks/noise_ratios.py --model resnet20 --optimizer adamw --digits-distort 8 --steps 110 --every 10
    python benchmarks/noise_ratios.py --smoke     # a tiny GPT, 6 steps: seconds

Each step, P simulated ranks (one process) each take a minibatch as examples/experiment.py's
ranks would (GPT: batch 16, context 128; ResNet-20: batch 32), their gradients are averaged and
the optimizer steps on the average (examples/experiment.py's hyper-parameters and schedule over
--steps): the uncompressed run. At every ``--every`` steps, each rank's flat gradient is also
compressed and decoded by each method (no error feedback) and the method's noise ratio computed
from the sums over ranks, as the auto hook does for one bucket holding the whole model. Under
AdamW the ``adam:METHOD`` columns are the same ratio with every vector first divided coordinate
by coordinate as AdamW divides the step's gradient (sqrt(v_hat) + eps, v_hat updated with this
step's average): the error against the noise in the coordinates the update is made in. Prints a
table (rows: steps; columns: methods) and the JSON.

What it shows: where each method's ratio sits against the default budget over a run. What it
cannot show: whether a method within the budget trains as well (that is the convergence runs'
question), nor the ratio under error feedback (the residual changes what is compressed).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--every", type=int, default=50, help="steps between measurements (default 50)")
    parser.add_argument("--ranks", type=int, default=4, help="simulated ranks (default 4)")
    parser.add_argument("--model", choices=("gpt", "resnet20"), default="gpt",
                        help="gpt (docs/convergence.md's byte-level GPT, default) or resnet20 (on the digits)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default=None,
                        help="the model's own by default (gpt: adamw, resnet20: sgd), with examples/experiment.py's "
                             "hyper-parameters and schedule over --steps")
    parser.add_argument("--digits-distort", type=int, default=0, metavar="C",
                        help="resnet20: train on randomly distorted digits (examples/data.py load_digits)")
    parser.add_argument("--seed", type=int, default=0)
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
from examples.data import (batch_generator, image_batch, load_digits, split_text, stdlib_corpus,  # noqa: E402
                           steps_per_epoch, text_batch)
from examples.experiment import MODEL_DEFAULTS, OPTIMIZER_DEFAULTS, build_optimizer  # noqa: E402
from examples.models import GPT, GPTConfig, resnet20  # noqa: E402
from gradcomp.analysis.auto import (DEFAULT_QUALITY_BUDGET, compression_error_sq, noise_ratio,  # noqa: E402
                                    squared_norm, update_weight)

METHODS = ("fp16", "int8", "int4", "sign", "topk")


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def ratios(gradients: list[torch.Tensor], weight: torch.Tensor | None = None) -> dict[str, float]:
    """Each method's noise ratio over the ranks' flat gradients (fp32 [n] each); with ``weight``
    (fp32 [n]), every vector (gradients, errors) is scaled by it first: the ratio as an optimizer
    that divides coordinate j by 1 / weight_j sees it."""
    local_sq = sum(float(squared_norm(g, weight)) for g in gradients)
    mean_sq = float(squared_norm(torch.stack(gradients).mean(0), weight))
    out = {}
    for name in METHODS:
        method = gradcomp.get_method(name)
        error_sq = sum(float(compression_error_sq(method, g, weight)) for g in gradients)
        out[name] = noise_ratio(local_sq, error_sq, mean_sq, len(gradients))
    return out


def make_optimizer(name: str, model: torch.nn.Module, steps: int, family: str):
    """examples/experiment.py's optimizer ``name`` ("sgd", "adamw") with its defaults and the lr
    schedule of model ``family`` ("gpt", "resnet") over ``steps``: build_optimizer itself."""
    args = SimpleNamespace(optimizer=name, warmup=MODEL_DEFAULTS[family]["warmup"], **OPTIMIZER_DEFAULTS[name])
    return build_optimizer(SimpleNamespace(model=model, total_steps=steps), args)


def run(steps: int, every: int, ranks: int, model_name: str, optimizer_name: str, smoke: bool,
        distort: int = 0, seed: int = 0) -> list[dict]:
    """Train uncompressed on ``ranks`` simulated ranks; every ``every`` steps each method's ratio
    (and, under AdamW, its ratio in Adam's normalised coordinates, keys ``adam:METHOD``)."""
    torch.manual_seed(seed)
    if model_name == "gpt":
        config = GPTConfig(context=32, n_layer=1, d_model=32, n_head=2) if smoke else GPTConfig()
        text = split_text(stdlib_corpus(int((0.05 if smoke else 8.0) * 2**20)), config.context)
        model, family = GPT(config), "gpt"

        def batch(step, rank):
            return text_batch(text.train, config.context, 16, batch_generator(seed, step, rank))
    else:
        images = load_digits(16, distort_copies=distort)
        model, family = resnet20(10, in_channels=1), "resnet"
        per_epoch = steps_per_epoch(len(images.train_y), 32, ranks)

        def batch(step, rank):
            return image_batch(images, seed, step // per_epoch, step % per_epoch, rank, ranks, 32)
    optimizer, schedule = make_optimizer(optimizer_name, model, steps, family)
    params = list(model.parameters())
    rows = []
    for step in range(steps + 1):
        gradients = []
        for rank in range(ranks):
            x, y = batch(step, rank)
            model.zero_grad(set_to_none=True)
            logits = model(x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            gradients.append(flat_grad(model).clone())
        average = torch.stack(gradients).mean(0)
        if step % every == 0:
            rows.append({"step": step, **ratios(gradients)})
            if optimizer_name == "adamw":
                weight = update_weight(optimizer, params, average)
                rows[-1].update({f"adam:{m}": r for m, r in ratios(gradients, weight).items()})
            print(f"step {step}: " + ", ".join(f"{k} {v:.3g}" for k, v in rows[-1].items() if k != "step"),
                  file=sys.stderr, flush=True)
        offset = 0
        for p in params:
            p.grad = average[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
        schedule.step()
    return rows


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("steps", "every", "ranks"):
        if getattr(args, name) < (2 if name == "ranks" else 1):
            build_parser().error(f"--{name} must be >= {2 if name == 'ranks' else 1}, got {getattr(args, name)}")
    if args.digits_distort and args.model != "resnet20":
        build_parser().error("--digits-distort is resnet20's (the digits); the gpt trains on text")
    if args.digits_distort < 0:
        build_parser().error(f"--digits-distort must be >= 0, got {args.digits_distort}")
    optimizer = args.optimizer or ("adamw" if args.model == "gpt" else "sgd")
    steps, every = (6, 3) if args.smoke else (args.steps, args.every)
    rows = run(steps, every, args.ranks, args.model, optimizer, args.smoke, args.digits_distort, args.seed)
    columns = [k for k in rows[0] if k != "step"]
    print(tabulate([[r["step"], *(f"{r[k]:.3g}" for k in columns)] for r in rows], headers=["step", *columns]))
    print(f"budget (auto's default): {DEFAULT_QUALITY_BUDGET}")
    if args.json:
        out = {"workload": f"{args.model}, {optimizer}, uncompressed"
                           + (f", digits distorted x{args.digits_distort}" if args.digits_distort else ""),
               "smoke": args.smoke, "ranks": args.ranks, "steps": steps, "seed": args.seed,
               "budget": DEFAULT_QUALITY_BUDGET, "methods": list(METHODS), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
