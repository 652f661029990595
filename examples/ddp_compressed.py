"""Your DDP script, plus gradient compression: a complete example to copy.

    torchrun --nproc-per-node 2 examples/ddp_compressed.py --method int8
    torchrun --nproc-per-node 8 examples/ddp_compressed.py --method auto --steps 200

NCCL on GPUs (one per process), Gloo on CPUs. Trains a small MLP on random regression data and
prints, on rank 0, the median step time, the bytes each rank handed to collectives per step and
the hook's compression ratio. ``--method``: none, auto, or any name in gradcomp.METHODS.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="int8", help="none, auto, or one of gradcomp.METHODS")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial model on every rank
    net = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 1)).to(device)
    model = DDP(net, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # the one line compression takes (auto also reads the optimizer: it then weighs every method, judging
    # their errors in its step)
    state = gradcomp.hooks.register(model, args.method, **({"optimizer": optimizer} if args.method == "auto" else {}))

    data = torch.Generator(device=device).manual_seed(1 + rank)  # each rank its own batches
    seconds = []
    for _ in range(args.steps):
        x = torch.randn(64, args.width, device=device, generator=data)
        started = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), x[:, :1] * 0.5)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)

    stats = state.stats()
    if rank == 0:
        print(f"method {args.method}: loss {loss.item():.4f}, step {statistics.median(seconds) * 1e3:.2f} ms "
              f"(median), {stats['wire_bytes_per_step'] / 1e6:.3f} MB sent per step, ratio {stats['ratio']:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
