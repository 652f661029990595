"""The end-to-end demo behind `gradcomp demo`: real gradients, every method, every DDP hook.

1. Compress the gradients of a small CNN on real handwritten digits (scikit-learn's bundled set)
   with each method: compression ratio, relative error, compress and decompress time.
2. Train that CNN with 2-rank Gloo DDP on 127.0.0.1 under each gradcomp hook: step time, wire
   bytes per step and loss.
3. Ask the break-even analyser whether compression pays for GPT-2 1.5B on 64 H100s over 100 GbE.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from tabulate import tabulate

import gradcomp
from gradcomp.analysis.calibrate import median_seconds
from gradcomp.emulate import launch_ranks

# Part 3 is `gradcomp breakeven` with these arguments; the cli runs it (demo never imports cli).
BREAKEVEN_ARGV = ["breakeven", "--model", "gpt2-1.5b", "--world-size", "64", "--device", "h100",
                  "--link", "100gbe"]


def digits():
    """Handwritten digits 8x8 (1,797 images shipped with scikit-learn): (x [N,1,8,8] in [0,1], y)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise SystemExit("the demo needs scikit-learn (pip install 'gradcomp[data]')") from exc
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.tensor(data.target)


class DigitsNet(nn.Module):
    """A small CNN for 8x8 digits: conv 32 -> conv 64 -> fc 256 -> 10 (~290K parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 4 * 4, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def compress_table() -> str:
    """Part 1: each method on the real gradients of DigitsNet after one batch of 256 digits."""
    torch.manual_seed(0)
    x, y = digits()
    model = DigitsNet()
    F.cross_entropy(model(x[:256]), y[:256]).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    raw = sum(g.numel() * g.element_size() for g in grads.values())
    for method in gradcomp.METHODS:  # warm-up of every method before any is timed (first calls,
        for g in grads.values():     # and compilation where a tensor is big enough for it)
            gradcomp.decompress(gradcomp.compress(g, method))
    rows = []
    for method in gradcomp.METHODS:
        payloads = {}

        def run_compress():
            payloads.update({n: gradcomp.compress(g, method) for n, g in grads.items()})

        t_c = median_seconds(run_compress, repeats=5, warmup=0)
        decoded = {}

        def run_decompress():
            decoded.update({n: gradcomp.decompress(p) for n, p in payloads.items()})

        t_d = median_seconds(run_decompress, repeats=5, warmup=0)
        wire = sum(p.nbytes for p in payloads.values())
        err = sum(float((decoded[n] - g).norm() ** 2) for n, g in grads.items()) ** 0.5
        norm = sum(float(g.norm() ** 2) for g in grads.values()) ** 0.5
        rows.append([method, wire, raw / wire, err / norm, t_c * 1e3, t_d * 1e3])
    return tabulate(rows, headers=["method", "wire bytes", "ratio", "rel. error", "compress ms",
                                   "decompress ms"], floatfmt=("", ".0f", ".1f", ".5f", ".3f", ".3f"))


def train_worker(rank: int, world_size: int, config: dict) -> list:
    """One Gloo rank of part 2 (run by ``launch_ranks``): DigitsNet under ``config["hook"]`` for
    ``config["steps"]`` steps; [median step s, wire and raw bytes per step, mean loss of the
    first and of the last 5 steps, training accuracy]."""
    from gradcomp import hooks

    torch.manual_seed(0)
    x, y = digits()
    model = nn.parallel.DistributedDataParallel(DigitsNet())
    state = hooks.register(model, config["hook"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    times, losses = [], []
    for _ in range(config["steps"]):
        idx = torch.randint(len(x), (64,), generator=gen)
        start = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    stats = state.stats()
    return [sorted(times)[len(times) // 2], stats["wire_bytes_per_step"], stats["raw_bytes_per_step"],
            sum(losses[:5]) / 5, sum(losses[-5:]) / 5, acc]


def hooks_table(steps: int = 60, world: int = 2) -> str:
    """Part 2: DDP on ``world`` Gloo ranks for ``steps`` steps under each hook."""
    from .hooks import HOOKS

    rows = []
    for hook in HOOKS:
        step_s, wire, raw, first, last, acc = launch_ranks(
            "gradcomp.demo:train_worker", world, {"hook": hook, "steps": steps}, timeout_s=300)[0]
        rows.append([hook, step_s * 1e3, wire, raw / wire if wire else float("nan"), first, last, acc])
    return tabulate(rows, headers=["hook", "step ms (median)", "wire bytes/step", "ratio",
                                   "loss (first 5)", "loss (last 5)", "train acc"],
                    floatfmt=("", ".2f", ".0f", ".1f", ".4f", ".4f", ".3f"))


def main(steps: int = 60) -> None:
    """Parts 1 and 2, then the heading of part 3 (the caller runs BREAKEVEN_ARGV)."""
    print("1. Compressing the real gradients of a CNN on handwritten digits "
          f"({sum(p.numel() for p in DigitsNet().parameters()):,} parameters)\n")
    print(compress_table())
    print(f"\n2. DDP training, 2 Gloo ranks on 127.0.0.1, {steps} steps of 64 digits per rank, "
          "each gradcomp hook\n")
    print(hooks_table(steps))
    print("   (int8, sign, topk and powersgd run with error feedback, the hooks' default; at this\n"
          "   SGD learning rate (0.1, momentum 0.9) its delayed updates hold sign and topk back:\n"
          "   see docs/convergence.md, 'Is error feedback broken for sign and top-k?')")
    print("\n3. The break-even analyser: GPT-2 1.5B on 64 H100s joined by 100 GbE\n"
          f"   $ gradcomp {' '.join(BREAKEVEN_ARGV)}\n")
