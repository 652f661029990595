"""Convergence experiments: train a model with DDP under a gradcomp hook, sweep hooks, report.

    python examples/experiment.py run --model resnet20 --hook powersgd --rank 2 --seed 0 --out runs/r20
    python examples/experiment.py sweep --model gpt --seeds 0 --configs none powersgd-r4 --out results/
    python examples/experiment.py report results/

``run`` starts ``--world-size`` Gloo ranks on 127.0.0.1 itself, or joins the process group of
``torchrun`` (RANK/WORLD_SIZE set; NCCL when CUDA is available). It writes into --out:
config.json, steps.csv (per-step loss, lr, wire bytes, wall time), evals.csv (held-out loss and
accuracy), summary.json, and checkpoint/rank<r>.pt (model, optimizer, scheduler, hook state, RNG,
step) from which ``--resume`` continues exactly.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import re
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

if __package__ in (None, ""):  # run as a script: make ``examples`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples import data as datasets  # noqa: E402
from examples.models import GPT, GPTConfig, count_parameters, resnet18, resnet20  # noqa: E402
from gradcomp.analysis.auto import DEFAULT_QUALITY_BUDGET, UPDATE_QUALITY_BUDGET  # noqa: E402
from gradcomp.emulate import free_port  # noqa: E402

MODELS = ("resnet20", "resnet18", "gpt")
HOOKS = ("none", "fp16", "int8", "int4", "sign", "topk", "powersgd", "auto")
AUTO_METHODS = ("none", "fp16", "bf16", "int8", "int4", "sign", "topk", "powersgd")
"""--hook auto's candidates: every method the auto hook can switch a bucket to (PowerSGD at its
default rank, 4)."""
EF_METHODS = ("int8", "int4", "sign", "topk", "powersgd")  # error feedback on unless --no-ef (fp16: off)
# the sweep: none, fp16, int8, sign +-EF, topk 1% +-EF, powersgd rank 1, 2, 4 (EF)
SWEEP_CONFIGS = ("none", "fp16", "int8", "sign", "sign-noef", "topk-1pct", "topk-1pct-noef",
                 "powersgd-r1", "powersgd-r2", "powersgd-r4")
STEP_FIELDS = ("step", "epoch", "lr", "loss", "step_s", "train_s", "wire_bytes", "raw_bytes")
EVAL_FIELDS = ("step", "epoch", "heldout_loss", "heldout_accuracy")


# ----------------------------------------------------------------------------- configurations

def config_name(hook: str, error_feedback: bool, rank: int, ratio: float,
                quality_budget: float | str | None = "default", coordinates: str = "gradient") -> str:
    """The folder name of a hook configuration, e.g. ``powersgd-r4-noef``, ``topk-1pct``, ``auto``
    (every AUTO_METHODS candidate under the default quality budget), ``auto-q0.05`` (another
    budget), ``auto-speed`` (no budget: speed alone); ``auto-upd``, ``auto-upd-q0.1``: the noise
    ratios in the optimizer's update's coordinates (--quality-coordinates update), whose default
    budget is UPDATE_QUALITY_BUDGET."""
    name = hook
    if hook == "auto":
        if quality_budget is None:
            return "auto-speed"
        name += "-upd" if coordinates == "update" else ""
        default = UPDATE_QUALITY_BUDGET if coordinates == "update" else DEFAULT_QUALITY_BUDGET
        return name if quality_budget in ("default", default) else f"{name}-q{quality_budget:g}"
    if hook == "topk":
        name += f"-{ratio * 100:g}pct"
    elif hook == "powersgd":
        name += f"-r{rank}"
    if hook in EF_METHODS and not error_feedback:
        name += "-noef"
    return name


_CONFIG_PATTERN = re.compile(r"^(?P<hook>[a-z0-9]+)(?:-r(?P<rank>\d+))?(?:-(?P<pct>[\d.]+)pct)?(?P<noef>-noef)?$")


_AUTO_PATTERN = re.compile(r"^auto(?:-(?P<budget>speed)|(?P<update>-upd)?(?:-(?P<q>q[\d.]+(?:e-?\d+)?))?)$")


def parse_config(name: str) -> list[str]:
    """The ``run`` flags of a configuration name (the inverse of :func:`config_name` and
    :func:`optimizer_config_name`)."""
    if name.startswith(EXCHANGE_OPTIMIZERS):
        flags = parse_optimizer_config(name)
        if flags is None:
            raise ValueError(f"bad configuration {name!r}: expected zeroone-w<steps>[-r<interval>]"
                             "[-h<sync every>][-g<doubling steps>][-topk<percent>pct|-fp16sync|-ag]"
                             "[-int8|int4|bf16|fp16][-own], dgc-<percent>pct-w<steps>[-i<percent>pct] or "
                             "diloco-h<inner steps>-<fp32|int8|int4|sign|topk<percent>pct>[-olr<outer lr>]"
                             "[-om<outer momentum>][-f<fragments>]")
        return flags
    auto = _AUTO_PATTERN.match(name)
    if auto:
        return ["--hook", "auto", *(["--quality-budget", "none"] if auto["budget"] else []),
                *(["--quality-coordinates", "update"] if auto["update"] else []),
                *(["--quality-budget", auto["q"][1:]] if auto["q"] else [])]
    match = _CONFIG_PATTERN.match(name)
    hook = match and match["hook"]
    if (not match or hook not in HOOKS or (match["rank"] is not None) != (hook == "powersgd")
            or (match["pct"] is not None) != (hook == "topk") or (match["noef"] and hook not in EF_METHODS)):
        raise ValueError(f"bad configuration {name!r}: expected none, fp16, int8, sign[-noef], "
                         "topk-<percent>pct[-noef], powersgd-r<rank>[-noef] or auto[-upd][-q<budget>], auto-speed")
    flags = ["--hook", hook]
    if hook == "powersgd":
        flags += ["--rank", match["rank"]]
    if hook == "topk":
        flags += ["--ratio", repr(float(match["pct"]) / 100)]
    return flags + (["--no-ef"] if match["noef"] else [])


def config_order(name: str) -> tuple:
    """Sort key of configuration names: by hook as in HOOKS, then rank or ratio, EF before -noef;
    the gradcomp.optim optimizers' configurations after every hook's, by name."""
    match = _CONFIG_PATTERN.match(name)
    if _AUTO_PATTERN.match(name):
        return (HOOKS.index("auto"), 0, 0.0, False, name)
    if match is None or match["hook"] not in HOOKS:
        return (len(HOOKS), 0, 0.0, False, name)
    return (HOOKS.index(match["hook"]), int(match["rank"] or 0), -float(match["pct"] or 0), bool(match["noef"]), "")


def quality_budget(text: str) -> float | None:
    """``--quality-budget``: a number > 0, ``none`` (auto chooses on speed alone) or ``default``
    (auto's default for the coordinates: resolved by resolve_defaults)."""
    if text.lower() in ("none", "default"):
        return None if text.lower() == "none" else "default"
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0 or 'none', got {text!r}")
    return value


# ----------------------------------------------------------------------------- gradcomp.optim

EXCHANGE_OPTIMIZERS = ("zeroone", "dgc", "diloco")
"""Optimizers of gradcomp.optim: they exchange gradient information themselves (run with --hook
none: DDP's all-reduce is switched off by gradcomp.optim.local_gradients)."""
_OPTIM_PATTERN = re.compile(r"^(?P<optimizer>zeroone|dgc)(?:-(?P<pct>[\d.]+)pct)?-w(?P<warmup>\d+)"
                            r"(?:-i(?P<initial>[\d.]+)pct)?(?:-r(?P<refresh>\d+))?(?:-h(?P<sync>\d+))?"
                            r"(?:-g(?P<growth>\d+))?(?:-topk(?P<topk>[\d.]+)pct)?(?P<fp16>-fp16sync)?(?P<ag>-ag)?"
                            r"(?:-(?P<method>int8|int4|bf16|fp16))?(?P<own>-own)?$")
_DILOCO_PATTERN = re.compile(r"^diloco-h(?P<sync>\d+)-(?P<method>fp32|int8|int4|sign|topk(?P<pct>[\d.]+)pct)"
                             r"(?:-olr(?P<lr>[\d.]+))?(?:-om(?P<momentum>[\d.]+))?(?:-f(?P<fragments>\d+))?$")
OUTER_METHODS = ("fp32", "int8", "int4", "sign", "topk")
DILOCO_OUTER_DEFAULTS = dict(outer_lr=0.7, outer_momentum=0.9)  # DiLoCo's own defaults


def optimizer_config_name(args: argparse.Namespace) -> str:
    """The folder name of a gradcomp.optim configuration, e.g. ``zeroone-w16-r64-h2-int8``
    (warm-up steps, first variance-refresh interval, sync every, [its doubling steps,] [top-k or
    fp16 momentum, or sign all-gathered: -ag,] warm-up method,
    [``-own``: local_updates="own"]) or
    ``dgc-0.1pct-w10-i5pct`` (final density, sparsity warm-up steps, initial density when not
    the default 25%)."""
    if args.optimizer == "dgc":
        initial = f"-i{args.initial_density * 100:g}pct" if args.initial_density != 0.25 else ""
        return f"dgc-{args.density * 100:g}pct-w{args.exchange_warmup}{initial}"
    if args.optimizer == "diloco":
        return diloco_config_name(args)
    name = f"zeroone-w{args.exchange_warmup}"
    name += f"-r{args.refresh_interval}" if args.refresh_interval else ""
    name += f"-h{args.sync_every}" if args.sync_every > 1 else ""
    name += f"-g{args.sync_growth}" if args.sync_growth else ""
    name += f"-topk{args.momentum_ratio * 100:g}pct" if args.momentum_method == "topk" else ""
    name += "-fp16sync" if args.momentum_method == "fp16" else ""
    name += "-ag" if args.momentum_method == "sign" and args.sign_scheme == "allgather" else ""
    name += f"-{args.warmup_method}" if args.warmup_method else ""
    return name + ("-own" if args.local_updates == "own" else "")


def diloco_config_name(args: argparse.Namespace) -> str:
    """The folder name of a DiLoCo configuration, e.g. ``diloco-h32-sign`` or
    ``diloco-h16-topk1pct-olr0.5-f4`` (inner steps per outer step, the pseudo-gradient's method,
    outer lr and momentum when not the defaults 0.7 and 0.9, streaming fragments when more than 1)."""
    method = f"topk{args.outer_ratio * 100:g}pct" if args.outer_method == "topk" else args.outer_method
    name = f"diloco-h{args.sync_every}-{method}"
    name += f"-olr{args.outer_lr:g}" if args.outer_lr != DILOCO_OUTER_DEFAULTS["outer_lr"] else ""
    name += f"-om{args.outer_momentum:g}" if args.outer_momentum != DILOCO_OUTER_DEFAULTS["outer_momentum"] else ""
    return name + (f"-f{args.fragments}" if args.fragments > 1 else "")


def parse_diloco_config(name: str) -> list[str] | None:
    """The ``run`` flags of a DiLoCo configuration name (see :func:`diloco_config_name`)."""
    match = _DILOCO_PATTERN.match(name)
    if match is None:
        return None
    method = "topk" if match["pct"] is not None else match["method"]
    flags = ["--optimizer", "diloco", "--sync-every", match["sync"], "--outer-method", method]
    if match["pct"] is not None:
        flags += ["--outer-ratio", repr(float(match["pct"]) / 100)]
    for key, flag in (("lr", "--outer-lr"), ("momentum", "--outer-momentum"), ("fragments", "--fragments")):
        if match[key]:
            flags += [flag, match[key]]
    return flags


def parse_optimizer_config(name: str) -> list[str] | None:
    """The ``run`` flags of a gradcomp.optim configuration name; None for a hook's name."""
    if name.startswith("diloco"):
        return parse_diloco_config(name)
    match = _OPTIM_PATTERN.match(name)
    dgc = match is not None and match["optimizer"] == "dgc"
    if match is None or (match["pct"] is not None) != dgc or (match["initial"] is not None and not dgc) or (
            dgc and (match["refresh"] or match["sync"] or match["method"] or match["topk"] or match["own"]
                     or match["fp16"] or match["growth"] or match["ag"])) or (
            match["ag"] and (match["topk"] or match["fp16"])):
        return None
    flags = ["--optimizer", match["optimizer"], "--exchange-warmup", match["warmup"]]
    if match["pct"] is not None:
        flags += ["--density", repr(float(match["pct"]) / 100)]
    if match["initial"] is not None:
        flags += ["--initial-density", repr(float(match["initial"]) / 100)]
    if match["topk"] is not None:
        flags += ["--momentum-method", "topk", "--momentum-ratio", repr(float(match["topk"]) / 100)]
    if match["fp16"]:
        flags += ["--momentum-method", "fp16"]
    if match["ag"]:
        flags += ["--sign-scheme", "allgather"]
    if match["own"]:
        flags += ["--local-updates", "own"]
    for key, flag in (("refresh", "--refresh-interval"), ("sync", "--sync-every"), ("growth", "--sync-growth"),
                      ("method", "--warmup-method")):
        if match[key]:
            flags += [flag, match[key]]
    return flags


MODEL_DEFAULTS = {  # what the issue specifies per model family
    "resnet": dict(optimizer="sgd", batch_size=32, warmup=0.0),
    "gpt": dict(optimizer="adamw", batch_size=16, steps=750, warmup=0.05),
}
OPTIMIZER_DEFAULTS = {"sgd": dict(lr=0.1, weight_decay=5e-4), "adamw": dict(lr=2e-3, weight_decay=0.1),
                      "zeroone": dict(lr=2e-3, weight_decay=0.1), "dgc": dict(lr=0.1, weight_decay=5e-4),
                      "diloco": dict(lr=2e-3, weight_decay=0.1)}  # diloco: its inner AdamW
OPTIMIZERS = tuple(OPTIMIZER_DEFAULTS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="one model x one hook configuration x one seed", allow_abbrev=False)
    add_run_arguments(run)
    sweep = commands.add_parser("sweep", help="several configurations and seeds, one run each", allow_abbrev=False)
    add_run_arguments(sweep, sweep=True)
    sweep.add_argument("--configs", nargs="+", default=list(SWEEP_CONFIGS),
                       help=f"configuration names (default: {' '.join(SWEEP_CONFIGS)})")
    sweep.add_argument("--seeds", nargs="+", type=int, default=[0])
    report = commands.add_parser("report", help="table and plots of a sweep directory", allow_abbrev=False)
    report.add_argument("sweep_dir", type=Path)
    return parser


def add_run_arguments(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    p.add_argument("--model", choices=MODELS, required=True)
    if not sweep:
        p.add_argument("--hook", choices=HOOKS, default="none")
        p.add_argument("--no-ef", dest="error_feedback", action="store_false",
                       help=f"turn error feedback off ({', '.join(EF_METHODS)})")
        p.add_argument("--rank", type=int, default=2, help="powersgd rank")
        p.add_argument("--ratio", type=float, default=0.01, help="topk fraction of elements kept")
        p.add_argument("--quality-budget", type=quality_budget, default="default",
                       help="auto: the largest noise ratio a bucket's method may have, or 'none' for speed "
                            f"alone (default {DEFAULT_QUALITY_BUDGET}; {UPDATE_QUALITY_BUDGET} with "
                            "--quality-coordinates update)")
        p.add_argument("--quality-coordinates", choices=("gradient", "update"), default="gradient",
                       help="auto: measure the noise ratios in the gradient's coordinates, or in the update's "
                            "(the hook is given the optimizer)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint")
        p.add_argument("--stop-after", type=int, default=None,
                       help="stop (with a checkpoint) after this many steps of the schedule")
        p.add_argument("--link-gbps", type=float, default=None,
                       help="train over an emulated link of this rate: every rank in a network namespace "
                            "whose loopback tbf shapes to it (gradcomp.emulate.ShapedLink; needs root, ip, tc)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="total steps (gpt default 750)")
    p.add_argument("--epochs", type=int, default=None, help="resnet: passes over the data (default 10)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (resnet 32, gpt 16)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="sgd (momentum 0.9; resnet default), adamw (gpt default), or gradcomp.optim's "
                        "zeroone (AdamW exchanging 1-bit momentum), dgc (SGD exchanging top-k velocity) or "
                        "diloco (local AdamW steps, outer Nesterov steps on compressed pseudo-gradients)")
    p.add_argument("--exchange-warmup", type=int, default=16,
                   help="zeroone: full-precision warm-up steps; dgc: sparsity warm-up steps (default 16)")
    p.add_argument("--warmup-method", default=None, help="zeroone: method of the warm-up and refresh "
                   "exchanges, e.g. int8 (default: fp32 all-reduce)")
    p.add_argument("--refresh-interval", type=int, default=0,
                   help="zeroone: first variance-refresh interval, doubling (0: frozen after warm-up)")
    p.add_argument("--sync-every", type=int, default=1,
                   help="zeroone: exchange momentum every N steps; diloco: inner steps per outer step (H)")
    p.add_argument("--sync-growth", type=int, default=0,
                   help="zeroone: exchange every step after warm-up, the interval doubling every N steps up "
                        "to --sync-every (0: --sync-every from the start)")
    p.add_argument("--local-updates", choices=("shared", "own"), default="shared",
                   help="zeroone: between exchanges apply the last shared momentum (shared) or move each rank "
                        "with its own and exchange the parameter change (own: 0/1 Adam's local steps)")
    p.add_argument("--momentum-method", choices=("sign", "topk", "fp16"), default="sign",
                   help="zeroone: sign (two-phase all-reduce; default), topk (all-gather) or fp16 "
                        "(all-reduce: a near-exact reference) momentum")
    p.add_argument("--sign-scheme", choices=("twophase", "allgather"), default="twophase",
                   help="zeroone with sign momentum: two-phase compressed all-reduce (default) or all-gather")
    p.add_argument("--momentum-ratio", type=float, default=0.004,
                   help="zeroone with --momentum-method topk: fraction of the momentum sent")
    p.add_argument("--outer-method", choices=OUTER_METHODS, default="int8",
                   help="diloco: method of the pseudo-gradient exchange (fp32: uncompressed all-reduce)")
    p.add_argument("--outer-ratio", type=float, default=0.01, help="diloco with --outer-method topk: fraction sent")
    p.add_argument("--outer-lr", type=float, default=DILOCO_OUTER_DEFAULTS["outer_lr"], help="diloco: outer lr")
    p.add_argument("--outer-momentum", type=float, default=DILOCO_OUTER_DEFAULTS["outer_momentum"],
                   help="diloco: the outer optimizer's Nesterov momentum")
    p.add_argument("--fragments", type=int, default=1,
                   help="diloco: streaming form, the model in N fragments synced at staggered steps (1: off)")
    p.add_argument("--density", type=float, default=0.001, help="dgc: fraction of the velocity sent")
    p.add_argument("--initial-density", type=float, default=0.25, help="dgc: density at step 0 of the warm-up")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (sgd 0.1, adamw 2e-3)")
    p.add_argument("--weight-decay", type=float, default=None, help="sgd 5e-4, adamw 0.1 (matrices only)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="steps between held-out evaluations (resnet: every epoch; gpt: 50; the ResNet-20 runs under docs/results: 1)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end)")
    p.add_argument("--cifar", type=Path, default=None, help="resnet: CIFAR-10 python-batch folder (default: digits)")
    p.add_argument("--digits-side", type=int, default=16, help="resnet on digits: image side after upsampling")
    p.add_argument("--digits-distort", type=int, default=0, metavar="C",
                   help="resnet on digits: train on randomly distorted digits and hold out C fixed distortions "
                        "of each held-out digit (0: the plain digits)")
    p.add_argument("--text", type=Path, default=None, help="gpt: a local text file (default: stdlib .py files)")
    p.add_argument("--corpus-mb", type=float, default=8.0, help="gpt: bytes of the corpus used, in MB (1e6)")
    p.add_argument("--eval-windows", type=int, default=256, help="gpt: held-out windows per evaluation")
    p.add_argument("--n-layer", type=int, default=GPTConfig.n_layer)
    p.add_argument("--d-model", type=int, default=GPTConfig.d_model)
    p.add_argument("--n-head", type=int, default=GPTConfig.n_head)
    p.add_argument("--context", type=int, default=GPTConfig.context)
    p.add_argument("--bucket-mb", type=float, default=None, help="DDP bucket_cap_mb (default: DDP's)")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 instead of DDP: fully_shard on every block and the root; the hook's method "
                        "compresses the reduce-scatter (gradcomp.fsdp; none: FSDP's own, fp32); no --resume")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
    p.add_argument("--quiet", action="store_true", help="no progress bar (the result line is still printed)")


OPTIMIZER_FLAGS = {"exchange_warmup": ("zeroone", "dgc"), "warmup_method": ("zeroone",),
                   "refresh_interval": ("zeroone",), "sync_every": ("zeroone", "diloco"),
                   "sync_growth": ("zeroone",), "local_updates": ("zeroone",), "momentum_method": ("zeroone",),
                   "sign_scheme": ("zeroone",), "momentum_ratio": ("zeroone",), "outer_method": ("diloco",),
                   "outer_ratio": ("diloco",), "outer_lr": ("diloco",), "outer_momentum": ("diloco",),
                   "fragments": ("diloco",), "density": ("dgc",), "initial_density": ("dgc",)}
"""The options that only the named --optimizer reads: given to another, they are refused, not ignored."""
HOOK_FLAGS = {"rank": ("powersgd",), "ratio": ("topk",), "error_feedback": EF_METHODS, "quality_budget": ("auto",),
              "quality_coordinates": ("auto",)}
"""The same for the options of --hook (``error_feedback``: --no-ef)."""


def _run_defaults() -> dict:
    """Every ``run`` option's default (the parser's)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_run_arguments(parser)
    return vars(parser.parse_args(["--model", MODELS[0], "--out", "."]))


def _fill_unset(args: argparse.Namespace, defaults: dict) -> None:
    """Set each of ``defaults`` on ``args`` where the argument was not given (None)."""
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the per-model defaults and check the arguments; returns a new Namespace."""
    args = argparse.Namespace(**vars(args))
    family = "gpt" if args.model == "gpt" else "resnet"
    _fill_unset(args, MODEL_DEFAULTS[family])
    _fill_unset(args, OPTIMIZER_DEFAULTS[args.optimizer])  # the optimizer may be a model default
    if family == "resnet" and args.steps is None and args.epochs is None:
        args.epochs = 10
    if args.steps is not None and args.epochs is not None:
        raise ValueError("give --steps or --epochs, not both")
    if family == "gpt" and args.epochs is not None:
        raise ValueError("--epochs applies to the resnets; give the gpt --steps")
    for key in ("world_size", "batch_size", "threads"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.hook == "powersgd" and args.rank < 1:
        raise ValueError(f"--rank must be >= 1, got {args.rank}")
    if args.hook == "topk" and not 0.0 < args.ratio <= 1.0:
        raise ValueError(f"--ratio must lie in (0, 1], got {args.ratio}")
    defaults = _run_defaults()
    for option, owners, flags in (("optimizer", OPTIMIZER_FLAGS, {}),
                                  ("hook", HOOK_FLAGS, {"error_feedback": "no-ef"})):
        for key, readers in owners.items():
            if getattr(args, option) not in readers and getattr(args, key) != defaults[key]:
                raise ValueError(f"--{flags.get(key, key.replace('_', '-'))} applies to --{option} "
                                 f"{' or '.join(readers)}, not {getattr(args, option)}")
    if args.sign_scheme != "twophase" and args.momentum_method != "sign":
        raise ValueError(f"--sign-scheme applies to --momentum-method sign, not {args.momentum_method}")
    if args.digits_distort and (family == "gpt" or args.cifar):
        raise ValueError("--digits-distort applies to a resnet on the digits (not the gpt, not --cifar)")
    if args.digits_distort < 0:
        raise ValueError(f"--digits-distort must be >= 0, got {args.digits_distort}")
    if args.stop_after is not None and args.stop_after < 1:
        raise ValueError(f"--stop-after must be >= 1, got {args.stop_after}")
    if args.link_gbps is not None and not (math.isfinite(args.link_gbps) and args.link_gbps > 0):
        raise ValueError(f"--link-gbps must be a rate > 0 Gbit/s, got {args.link_gbps}")
    if args.fsdp and (args.hook in ("powersgd", "auto") or args.optimizer in EXCHANGE_OPTIMIZERS or args.resume):
        raise ValueError("--fsdp takes --hook none, fp16, int8, int4, sign or topk, an optimizer that does "
                         "not exchange, and no --resume")
    if args.optimizer == "diloco" and not 1 <= args.fragments <= args.sync_every:
        raise ValueError(f"--fragments must lie in [1, --sync-every = {args.sync_every}], got {args.fragments}")
    if args.optimizer in EXCHANGE_OPTIMIZERS:
        if args.hook != "none":
            raise ValueError(f"--optimizer {args.optimizer} exchanges gradients itself: give --hook none")
        args.config = optimizer_config_name(args)
    else:
        if args.hook == "auto" and args.quality_budget == "default":
            update = args.quality_coordinates == "update"
            args.quality_budget = UPDATE_QUALITY_BUDGET if update else DEFAULT_QUALITY_BUDGET
        args.config = config_name(args.hook, args.error_feedback, args.rank, args.ratio, args.quality_budget,
                                  args.quality_coordinates)
    return args


# ----------------------------------------------------------------------------- hooks

def hook_options(args: argparse.Namespace) -> dict:
    """Keyword options of ``gradcomp.hooks.register`` for the run's configuration."""
    options = {}
    if args.hook == "topk":
        options["ratio"] = args.ratio
    if args.hook == "powersgd":
        options["matrix_rank"] = args.rank
    if args.hook in EF_METHODS:
        options["error_feedback"] = args.error_feedback
    if args.hook == "auto":
        options.update(methods=AUTO_METHODS, quality_budget=args.quality_budget,
                       optimizer_family=args.optimizer if args.optimizer in ("sgd", "adamw") else None)
    return options


class UncompressedFSDP:
    """FSDP2's own fp32 reduce-scatter, with statistics counted as gradcomp.fsdp counts them:
    (p - 1) / p x 4 bytes per parameter per step (what a ring reduce-scatter sends)."""

    def __init__(self, model: torch.nn.Module, world_size: int):
        self.bytes_per_step = (world_size - 1) / world_size * 4 * sum(p.numel() for p in model.parameters())
        self.steps = 0

    def count_step(self) -> None:
        self.steps += 1

    def stats(self) -> dict:
        total = self.steps * self.bytes_per_step
        return {"steps": self.steps, "raw_bytes": total, "wire_bytes": total}

    def state_dict(self) -> dict:
        return {"steps": self.steps}


def shard_model(model: torch.nn.Module, args: argparse.Namespace):
    """fully_shard every block and the root, then gradcomp.fsdp on the hook's method; the handle
    (stats, state_dict), or an UncompressedFSDP for ``--hook none``."""
    import gradcomp.fsdp
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if args.hook == "none":
        return UncompressedFSDP(model, dist.get_world_size())
    options = {k: v for k, v in hook_options(args).items() if k != "error_feedback"}
    error_feedback = args.error_feedback if args.hook in EF_METHODS else None
    return gradcomp.fsdp.compress(model, args.hook, error_feedback=error_feedback, **options)


def register_hook(model: DistributedDataParallel, args: argparse.Namespace, optimizer):
    """Register the configured gradcomp hook (auto measuring in ``optimizer``'s update's coordinates
    with --quality-coordinates update); returns its state (stats, state_dict)."""
    from gradcomp import hooks

    options = hook_options(args)
    if args.hook == "auto" and args.quality_coordinates == "update":
        options["optimizer"] = optimizer
    return hooks.register(model, args.hook, **options)


# ----------------------------------------------------------------------------- the task

class Task:
    """Model, data, batches and evaluation of one experiment (the same on every rank)."""

    def __init__(self, args: argparse.Namespace, device: torch.device, rank: int, world_size: int):
        self.args, self.device, self.rank, self.world_size = args, device, rank, world_size
        torch.manual_seed(args.seed)
        if args.model == "gpt":
            corpus = (datasets.read_text(args.text, int(args.corpus_mb * 1e6)) if args.text
                      else datasets.stdlib_corpus(int(args.corpus_mb * 1e6)))
            self.gpt_config = GPTConfig(context=args.context, n_layer=args.n_layer, n_head=args.n_head,
                                        d_model=args.d_model)
            self.text = datasets.split_text(corpus, args.context)
            self.model = GPT(self.gpt_config)
            self.steps_per_epoch = len(self.text.train) // (args.context * args.batch_size * world_size)
            self.total_steps = args.steps
            self.eval_every = args.eval_every or 50
        else:
            self.images = datasets.load_cifar10(args.cifar) if args.cifar else datasets.load_digits(
                args.digits_side, distort_copies=args.digits_distort)
            build = resnet20 if args.model == "resnet20" else resnet18
            self.model = build(self.images.num_classes, in_channels=self.images.train_x.shape[1])
            self.steps_per_epoch = datasets.steps_per_epoch(len(self.images.train_y), args.batch_size, world_size)
            self.total_steps = args.steps or args.epochs * self.steps_per_epoch
            self.eval_every = args.eval_every or self.steps_per_epoch
        self.model.to(device)

    def epoch(self, step: int) -> float:
        """Passes over the training data completed after ``step`` steps."""
        return step / max(self.steps_per_epoch, 1)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch for (0-based) ``step``, a pure function of seed, step and rank."""
        args = self.args
        if args.model == "gpt":
            gen = datasets.batch_generator(args.seed, step, self.rank)
            x, y = datasets.text_batch(self.text.train, args.context, args.batch_size, gen)
        else:
            epoch, within = divmod(step, self.steps_per_epoch)
            x, y = datasets.image_batch(self.images, args.seed, epoch, within, self.rank,
                                        self.world_size, args.batch_size)
        return x.to(self.device), y.to(self.device)

    def loss(self, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """(held-out mean loss in nats per prediction, accuracy), over all ranks' shards."""
        module = self.model
        for buffer in module.buffers():  # BatchNorm statistics: rank 0's on every rank
            dist.broadcast(buffer, 0)
        was_training = module.training
        module.eval()
        if self.args.model == "gpt":
            xs, ys = datasets.heldout_windows(self.text.heldout, self.args.context, self.args.eval_windows)
        else:
            xs, ys = self.images.test_x, self.images.test_y
        xs, ys = xs[self.rank::self.world_size], ys[self.rank::self.world_size]
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, correct, count
        for start in range(0, len(xs), 256):
            x, y = xs[start:start + 256].to(self.device), ys[start:start + 256].to(self.device)
            logits = module(x)
            logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
            totals[0] += F.cross_entropy(logits, y, reduction="sum").double()
            totals[1] += (logits.argmax(-1) == y).sum()
            totals[2] += y.numel()
        dist.all_reduce(totals)
        module.train(was_training)
        return float(totals[0] / totals[2]), float(totals[1] / totals[2])


def momentum_exchange(args: argparse.Namespace) -> dict:
    """ZeroOneAdam's momentum method, its options and scheme for the run's flags."""
    if args.momentum_method == "topk":
        return dict(method="topk", method_options={"ratio": args.momentum_ratio}, scheme="allgather")
    if args.momentum_method == "fp16":
        return dict(method="fp16", scheme="allreduce")
    return dict(method="sign", scheme=args.sign_scheme)


def build_optimizer(task: Task, args: argparse.Namespace, model=None):
    """SGD with momentum (resnet) or AdamW with decay on matrices only (gpt), or their
    gradcomp.optim counterparts (dgc, zeroone, diloco: its inner AdamW; exchanging over
    ``model``, the DDP model with its all-reduce off), and its lr schedule (diloco: the inner lr)."""
    from gradcomp import optim

    params = list(task.model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    elif args.optimizer == "dgc":
        optimizer = optim.DGC(params, model, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay,
                              density=args.density, warmup_steps=args.exchange_warmup,
                              initial_density=args.initial_density)
    elif args.optimizer == "zeroone":
        optimizer = optim.ZeroOneAdam(groups, model, lr=args.lr, betas=(0.9, 0.95),
                                      warmup_steps=args.exchange_warmup, warmup_method=args.warmup_method,
                                      var_refresh_interval=args.refresh_interval, sync_every=args.sync_every,
                                      sync_growth=args.sync_growth, local_updates=args.local_updates,
                                      **momentum_exchange(args))
    elif args.optimizer == "diloco":
        optimizer = optim.DiLoCo(groups, model, torch.optim.AdamW, dict(lr=args.lr, betas=(0.9, 0.95)),
                                 sync_every=args.sync_every, outer_lr=args.outer_lr,
                                 outer_momentum=args.outer_momentum,
                                 method=None if args.outer_method == "fp32" else args.outer_method,
                                 method_options={"ratio": args.outer_ratio} if args.outer_method == "topk" else None,
                                 fragments=args.fragments)
    else:
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    warmup_steps = int(args.warmup * task.total_steps)

    def lr_factor(step: int) -> float:
        """Linear warmup, then cosine decay to 0 over the rest of the schedule."""
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(task.total_steps - warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


# ----------------------------------------------------------------------------- checkpoints, logs

def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def checkpoint_path(out: Path, rank: int) -> Path:
    return out / "checkpoint" / f"rank{rank}.pt"


def save_checkpoint(out: Path, rank: int, step: int, train_s: float, task: Task, optimizer, scheduler,
                    hook_state) -> None:
    """This rank's full state after ``step`` steps (ranks differ: error-feedback residuals)."""
    path = checkpoint_path(out, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "train_s": train_s, "model": task.model.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "hook": None if hook_state is None else hook_state.state_dict(), "rng": rng_state()}, tmp)
    os.replace(tmp, path)


def read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def truncate_csv(path: Path, fields: tuple[str, ...], last_step: int) -> None:
    """Keep the rows up to ``last_step`` (a resumed run rewrites what came after)."""
    rows = [r for r in read_csv(path) if r["step"] <= last_step]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: _csv_value(r[k]) for k in fields} for r in rows)


def _csv_value(value):
    return int(value) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))


def append_row(path: Path, fields: tuple[str, ...], row: dict) -> None:
    new = not path.is_file()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerow({k: _csv_value(row[k]) for k in fields})


class ProgressBar:
    """A plain-text progress bar: redrawn in place on a terminal, a line every 5% otherwise."""

    def __init__(self, total: int, label: str, stream=sys.stderr, width: int = 30):
        self.total, self.label, self.stream, self.width = total, label, stream, width
        self.interactive = stream.isatty()
        self.printed = -1

    def update(self, step: int, text: str) -> None:
        filled = self.width * step // self.total
        line = f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total} {text}"
        if self.interactive:
            self.stream.write("\r" + line + ("\n" if step == self.total else ""))
        elif step == self.total or step * 20 // self.total > self.printed:
            self.printed = step * 20 // self.total
            self.stream.write(line + "\n")
        self.stream.flush()


# ----------------------------------------------------------------------------- training

def train(rank: int, world_size: int, args: argparse.Namespace, device: torch.device) -> dict | None:
    """The training loop on one rank (process group initialised); rank 0 writes the logs."""
    out = args.out
    task = Task(args, device, rank, world_size)
    ddp_options = {} if args.bucket_mb is None else {"bucket_cap_mb": args.bucket_mb}
    if args.fsdp:
        model = task.model
        hook_state = shard_model(model, args)
    elif args.optimizer in EXCHANGE_OPTIMIZERS:  # the optimizer exchanges; DDP's all-reduce off
        from gradcomp.optim import local_gradients

        model = DistributedDataParallel(task.model, device_ids=[device.index] if device.type == "cuda" else None,
                                        **ddp_options)
        local_gradients(model)
        hook_state = None
    else:
        model = DistributedDataParallel(task.model, device_ids=[device.index] if device.type == "cuda" else None,
                                        **ddp_options)
        hook_state = None  # registered with the optimizer (auto may read its state)
    optimizer, scheduler = build_optimizer(task, args, model)
    if isinstance(model, DistributedDataParallel) and args.optimizer not in EXCHANGE_OPTIMIZERS:
        hook_state = register_hook(model, args, optimizer)
    exchange_stats = hook_state.stats if hook_state is not None else optimizer.stats
    start_step, train_s = 0, 0.0
    if args.resume:
        ckpt = torch.load(checkpoint_path(out, rank), map_location=device, weights_only=False)
        task.model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        if hook_state is not None:
            hook_state.load_state_dict(ckpt["hook"])
        set_rng_state(ckpt["rng"])
        start_step, train_s = ckpt["step"], ckpt["train_s"]
        if rank == 0:
            truncate_csv(out / "steps.csv", STEP_FIELDS, start_step)
            truncate_csv(out / "evals.csv", EVAL_FIELDS, start_step)
    end_step = min(task.total_steps, args.stop_after or task.total_steps)
    bar = ProgressBar(task.total_steps, f"{args.model}/{args.config} seed {args.seed}")
    last_eval = ""
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    for step in range(start_step, end_step):
        tick = time.perf_counter()
        x, y = task.batch(step)
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(model, x, y)
        loss.backward()
        if args.optimizer in ("adamw", "zeroone", "diloco"):  # zeroone, diloco: each rank clips its own gradient
            torch.nn.utils.clip_grad_norm_(task.model.parameters(), 1.0)
        optimizer.step()
        if isinstance(hook_state, UncompressedFSDP):
            hook_state.count_step()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        step_s = time.perf_counter() - tick
        train_s += step_s
        loss_sum.fill_(loss.item())
        dist.all_reduce(loss_sum)
        done = step + 1
        stats = exchange_stats()
        if rank == 0:
            append_row(out / "steps.csv", STEP_FIELDS, dict(
                step=done, epoch=task.epoch(done), lr=lr, loss=float(loss_sum) / world_size, step_s=step_s,
                train_s=train_s, wire_bytes=stats["wire_bytes"], raw_bytes=stats["raw_bytes"]))
        if done % task.eval_every == 0 or done == task.total_steps:
            heldout_loss, accuracy = task.evaluate()
            last_eval = f"held-out loss {heldout_loss:.3f} acc {accuracy:.1%}"
            if rank == 0:
                append_row(out / "evals.csv", EVAL_FIELDS, dict(step=done, epoch=task.epoch(done),
                                                                heldout_loss=heldout_loss, heldout_accuracy=accuracy))
        if args.checkpoint_every and done % args.checkpoint_every == 0 or done == end_step:
            save_checkpoint(out, rank, done, train_s, task, optimizer, scheduler, hook_state)
        if rank == 0 and not args.quiet:
            bar.update(done, f"loss {float(loss_sum) / world_size:.3f} {last_eval} {train_s:.0f}s")
    if rank != 0 or end_step < task.total_steps:
        return None
    summary = summarize(out, args, task, exchange_stats())
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def summarize(out: Path, args: argparse.Namespace, task: Task, stats: dict) -> dict:
    """The run's final numbers: held-out metrics, last training loss, bytes and times."""
    steps, evals = read_csv(out / "steps.csv"), read_csv(out / "evals.csv")
    tail = [r["loss"] for r in steps[-max(len(steps) // 20, 1):]]
    return {
        "model": args.model, "config": args.config, "seed": args.seed, "world_size": task.world_size,
        "parameters": count_parameters(task.model), "steps": len(steps), "epochs": task.epoch(len(steps)),
        "final_heldout_loss": evals[-1]["heldout_loss"], "final_heldout_accuracy": evals[-1]["heldout_accuracy"],
        "final_train_loss": sum(tail) / len(tail),
        "wire_bytes": stats["wire_bytes"], "raw_bytes": stats["raw_bytes"],
        "compression_ratio": stats["raw_bytes"] / stats["wire_bytes"] if stats["wire_bytes"] else float("nan"),
        "train_s": steps[-1]["train_s"], "hook_stats": stats,
    }


def _rank_entry(rank: int, world_size: int, port: int, args: argparse.Namespace, env: dict) -> None:
    os.environ.clear()  # a forkserver's child starts with the server's environment, not the caller's
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with_process_group(rank, world_size, args)


def with_process_group(rank: int, world_size: int, args: argparse.Namespace) -> dict | None:
    """Initialise the process group (env:// rendezvous), train, tear down."""
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()) \
        if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(minutes=10))
    try:
        return train(rank, world_size, args, device)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict | None:
    """One run: under torchrun join its group, else spawn ``world_size`` local ranks."""
    args = resolve_defaults(args)
    args.out.mkdir(parents=True, exist_ok=True)
    saved = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
             if k not in ("resume", "stop_after", "quiet", "command", "argv")}
    config_file = args.out / "config.json"
    if args.resume:
        if not checkpoint_path(args.out, 0).is_file():
            raise FileNotFoundError(f"--resume: no checkpoint in {args.out / 'checkpoint'}")
        before = json.loads(config_file.read_text())
        changed = {k for k in set(before) | set(saved) if before.get(k) != saved.get(k)}
        if changed:
            raise ValueError(f"--resume with different settings than the checkpointed run: {sorted(changed)}")
    else:
        for stale in ("steps.csv", "evals.csv", "summary.json"):
            (args.out / stale).unlink(missing_ok=True)
        config_file.write_text(json.dumps(saved, indent=1))
    if args.link_gbps is not None and IN_LINK not in os.environ:
        # the same command again inside a namespace whose loopback is shaped: its ranks talk over it
        # (its stdout is only its result line, which this process prints)
        import subprocess

        from gradcomp.emulate import ShapedLink
        if getattr(args, "argv", None) is None:
            raise ValueError("--link-gbps re-runs the command line inside the namespace: call main(argv)")
        with ShapedLink(args.link_gbps) as link:
            subprocess.run(link.prefix + ["env", f"{IN_LINK}=1", sys.executable, str(Path(__file__).resolve()),
                                          *args.argv], check=True, stdout=subprocess.DEVNULL)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != args.world_size:
            raise ValueError(f"torchrun started {world_size} ranks but --world-size is {args.world_size}")
        return with_process_group(int(os.environ["RANK"]), world_size, args)
    else:
        # forkserver: the ranks fork from a server that has imported torch once (per process: a
        # sweep's later runs reuse it), instead of each importing it afresh as spawn's do
        mp.start_processes(_rank_entry, args=(args.world_size, free_port(), args, dict(os.environ)),
                           nprocs=args.world_size, start_method="forkserver")
    summary_file = args.out / "summary.json"
    return json.loads(summary_file.read_text()) if summary_file.is_file() else None


# ----------------------------------------------------------------------------- sweep and report

def sweep(args: argparse.Namespace) -> list[dict]:
    """Every configuration x seed into --out/<model>/<config>/seed<S>; finished runs are skipped,
    interrupted ones resume from their last checkpoint (see --checkpoint-every).

    The wall time of each invocation is appended to --out/<model>/sweeps.json.
    """
    for name in args.configs:
        parse_config(name)
    base = {k: v for k, v in vars(args).items() if k not in ("configs", "seeds", "command")}
    start, summaries, ran = time.time(), [], []
    for name in args.configs:
        for seed in args.seeds:
            out = args.out / args.model / name / f"seed{seed}"
            if (out / "summary.json").is_file():
                summaries.append(json.loads((out / "summary.json").read_text()))
                continue
            run_args = sweep_run_args(args, base, name, seed, out)
            run_start = time.time()
            summaries.append(run(run_args))
            ran.append({"config": name, "seed": seed, "wall_s": time.time() - run_start})
    log = args.out / args.model / "sweeps.json"
    history = json.loads(log.read_text()) if log.is_file() else []
    history.append({"configs": args.configs, "seeds": args.seeds, "started": time.strftime(
        "%Y-%m-%d %H:%M:%S", time.gmtime(start)), "wall_s": time.time() - start, "runs": ran})
    log.write_text(json.dumps(history, indent=1))
    return summaries


def sweep_run_args(args: argparse.Namespace, base: dict, name: str, seed: int, out: Path) -> argparse.Namespace:
    """The ``run`` arguments of one sweep entry: the configuration's own flags, then every other
    setting from the sweep's command line (``base``)."""
    resume = ["--resume"] if checkpoint_path(out, 0).is_file() else []  # an interrupted run
    head = ["run", "--model", args.model, "--out", str(out), "--seed", str(seed)]
    parser = build_parser()
    run_args = parser.parse_args([*head, *parse_config(name), *resume])
    defaults = vars(parser.parse_args(head))
    from_config = {k for k, v in vars(run_args).items() if defaults.get(k) != v}
    for key, value in base.items():
        if key not in ("out", "model") and key not in from_config:
            setattr(run_args, key, value)
    return run_args


def report(sweep_dir: Path) -> str:
    """Table (tabulate) and plots (PNG) of every run under ``sweep_dir``, written there as
    report.md, report.csv, report.json and <model>_loss.png; returns the table text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tabulate import tabulate

    runs = [json.loads(p.read_text()) | {"dir": p.parent} for p in sorted(sweep_dir.rglob("summary.json"))]
    if not runs:
        raise FileNotFoundError(f"no finished runs (summary.json) under {sweep_dir}")
    text, rows_out = [], []
    for model in sorted({r["model"] for r in runs}):
        by_config: dict[str, list[dict]] = {}
        for r in runs:
            if r["model"] == model:
                by_config.setdefault(r["config"], []).append(r)
        order = sorted(by_config, key=config_order)
        metric_is_accuracy = model != "gpt"
        metric = "final_heldout_accuracy" if metric_is_accuracy else "final_heldout_loss"
        scale = 100.0 if metric_is_accuracy else 1.0

        def mean(values):
            return float(np.mean(values))

        baseline = mean([r[metric] * scale for r in by_config["none"]]) if "none" in by_config else None
        rows = []
        for config in order:
            group = by_config[config]
            values = [r[metric] * scale for r in group]
            row = {"model": model, "config": config, "seeds": len(group),
                   "metric": "test accuracy %" if metric_is_accuracy else "held-out loss (nats/byte)",
                   "final": mean(values), "std": round(float(np.std(values)), 9),  # no 1e-14 noise
                   "diff_vs_none": mean(values) - baseline if baseline is not None else float("nan"),
                   "wire_MB_per_rank": mean([r["wire_bytes"] for r in group]) / 1e6,
                   "compression_ratio": mean([r["compression_ratio"] for r in group]),
                   "train_s": mean([r["train_s"] for r in group]), "steps": group[0]["steps"]}
            rows.append(row)
        rows_out += rows
        headers = ["config", "seeds", rows[0]["metric"], "std", "diff vs none", "wire MB/rank",
                   "ratio", "time s", "steps"]
        table = tabulate([[r["config"], r["seeds"], r["final"], r["std"], r["diff_vs_none"], r["wire_MB_per_rank"],
                           r["compression_ratio"], r["train_s"], r["steps"]] for r in rows],
                         headers=headers, floatfmt=".4g")
        text.append(f"## {model}\n\n{table}\n")
        plot_curves(plt, sweep_dir / f"{model}_loss.png", model, order, by_config)
    (sweep_dir / "report.json").write_text(json.dumps(rows_out, indent=1))
    with open(sweep_dir / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows_out[0]))
        writer.writeheader()
        writer.writerows(rows_out)
    result = "\n".join(text)
    (sweep_dir / "report.md").write_text(result)
    return result


def moving_average(values) -> tuple[np.ndarray, int]:
    """The moving average of ``values`` over a window of 1/50 of their length (at least 1), and
    the window: element i averages values[i : i + window]."""
    window = max(len(values) // 50, 1)
    return np.convolve(values, np.ones(window) / window, mode="valid"), window


def label_log_ticks(axis) -> None:
    """Tick labels of a log-scaled x axis that never collide: the minor ticks unlabelled (their
    "3x10^5 4x10^5" labels overlap), the labelled ticks at every decade, or at 1, 2 and 5 per
    decade when the axis spans less than two (so a short axis still carries several labels)."""
    from matplotlib.ticker import LogFormatterSciNotation, LogLocator, NullFormatter

    low, high = sorted(axis.get_xlim())
    if high < 100 * low:
        axis.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.xaxis.set_major_formatter(LogFormatterSciNotation(labelOnlyBase=False,
                                                               minor_thresholds=(math.inf, math.inf)))
    axis.xaxis.set_minor_formatter(NullFormatter())


def save_figure(plt, fig, axes, legend_axis, path: Path) -> None:
    """Grid on every axis, non-colliding log tick labels, the legend on ``legend_axis``, then
    ``fig`` written to ``path``."""
    for axis in axes:
        axis.grid(alpha=0.3)
        if axis.get_xscale() == "log":
            label_log_ticks(axis)
    legend_axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_curves(plt, path: Path, model: str, order: list[str], by_config: dict[str, list[dict]]) -> None:
    """Training loss (seed mean, moving average) against steps and against wire bytes per rank."""
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(13, 5))
    for config in order:
        curves = [read_csv(r["dir"] / "steps.csv") for r in by_config[config]]
        length = min(len(c) for c in curves)
        loss = np.mean([[row["loss"] for row in c[:length]] for c in curves], axis=0)
        smooth, window = moving_average(loss)
        steps = np.arange(len(smooth)) + window
        wire = np.mean([[row["wire_bytes"] for row in c[:length]] for c in curves], axis=0)[window - 1:]
        by_step.plot(steps, smooth, label=config)
        by_bytes.plot(wire, smooth, label=config)
    by_step.set(xlabel="step", ylabel="training loss (moving average)", title=f"{model}: loss vs steps")
    by_bytes.set(xlabel="wire bytes sent per rank", ylabel="training loss (moving average)", xscale="log",
                 title=f"{model}: loss vs bytes")
    save_figure(plt, fig, (by_step, by_bytes), by_step, path)


def result_line(summary: dict) -> str:
    """One line of a finished run's result (printed even with --quiet)."""
    metric = (f"held-out accuracy {summary['final_heldout_accuracy']:.2%}" if summary["model"] != "gpt"
              else f"held-out loss {summary['final_heldout_loss']:.4f}")
    return (f"{summary['model']}/{summary['config']} seed {summary['seed']}: {metric}, training loss "
            f"{summary['final_train_loss']:.4f}, {summary['steps']} steps, {summary['wire_bytes'] / 1e6:.2f} MB "
            f"sent per rank (ratio {summary['compression_ratio']:.1f}), {summary['train_s']:.0f} s")


IN_LINK = "GRADCOMP_EXPERIMENT_IN_LINK"
"""Set in the environment of a run that --link-gbps started inside its shaped namespace."""


def main(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command == "report":
        print(report(args.sweep_dir))
        return None
    result = run(args) if args.command == "run" else sweep(args)
    for summary in result if isinstance(result, list) else [result]:
        if summary is not None:  # None: stopped early (--stop-after), or a torchrun rank other than 0
            print(result_line(summary), flush=True)
    return result


if __name__ == "__main__":
    main()
