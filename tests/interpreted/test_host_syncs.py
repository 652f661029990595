"""GPU rule (e): no host synchronisation in a warm step of any front, on the path CUDA takes
(GRADCOMP_BACKEND=triton: the kernels, here under the interpreter), on 2 Gloo ranks.

On a CUDA tensor ``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``, ``int(t)`` and
``operator.index(t)`` wait for the device and stall the stream each step. Here they are counted
by patching torch.Tensor during one warm step (after DDP's bucket rebuild, auto's evaluation,
the configuration checks) of every front; each must read nothing, except what DOCUMENTED_READS
names with its reason and bound (docs/kernels.md, "GPU rules held on CPU").
"""
from __future__ import annotations

import collections
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_models import batch, build_model, make_ddp
from dist_utils import run_ranks
from test_gpu_rules import DDP_FRONTS, EXCHANGES, ddp_front_state

from gradcomp import get_method
from gradcomp.fsdp import CompressedReduceScatter, CompressedReplicaAllReduce
from gradcomp.hooks import HookStats
from gradcomp.optim import DGC, ZeroOneAdam
from gradcomp.optim.exchange import Exchange

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
WARM_STEPS = 4
"""Steps before the counted one: DDP rebuilds its buckets after step 0, auto evaluates at 2."""
BUCKETS = 2
"""MixedNet's buckets at make_ddp's default cap once DDP has rebuilt them (counted per step)."""
DOCUMENTED_READS = {
    # the optimizers skip a step whose exchanged mean is not finite: the skip moves host
    # counters (and DGC's density schedule, which sets k), so one read per exchange step
    "ZeroOneAdam shared exchange": 1,
    "ZeroOneAdam own exchange": 1,
    "DGC": 1,
}


@contextmanager
def counting_host_reads():
    """A Counter of torch.Tensor host reads (by method name) made inside the block, any thread."""
    counts = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name, original):
        def read(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _backward(ddp, step, rank):
    x, y = batch(step, rank)
    F.cross_entropy(ddp(x), y).backward()


def _warm_step_reads(rank, world):
    """Per front: the host reads of its warm step (DDP hooks: one backward; FSDP collectives and
    exchanges: one call; optimizers: one step of the named kind)."""
    os.environ["GRADCOMP_BACKEND"] = "triton"
    os.environ["GRADCOMP_CPU_COMPILE"] = "0"
    out = {}
    for label, method, options in DDP_FRONTS:
        ddp = make_ddp(build_model())
        if method == "auto":  # it evaluates at step 2 only: the counted step is a plain one
            options = {**options, "evaluate_every": 100}
        state, hook = ddp_front_state(method, options, rank)
        ddp.register_comm_hook(state.bind(ddp), hook)
        for step in range(WARM_STEPS):
            if method == "auto" and step == WARM_STEPS - 1:
                state.switch("int8:allgather")  # compressed from the counted step on
            _backward(ddp, step, rank)
        with counting_host_reads() as counts:
            _backward(ddp, WARM_STEPS, rank)
        out[label] = dict(counts)
        out[f"{label} buckets"] = state.stats()["buckets"]

    group = dist.group.WORLD
    for name in ("int8", "sign", "topk", "fp16"):
        method = get_method(name)
        scatter = CompressedReduceScatter(method, True, HookStats(), "layer")
        replica = CompressedReplicaAllReduce(method, True, HookStats(), "layer", group)
        rows = torch.randn(world, 3000, generator=torch.Generator().manual_seed(rank))
        shard = torch.empty(3000)
        scatter(shard, rows, group, dist.ReduceOp.AVG)  # the first call checks the configuration
        replica(shard)
        with counting_host_reads() as counts:
            scatter(shard, rows, group, dist.ReduceOp.AVG)
            replica(shard)
        out[f"fsdp {name}"] = dict(counts)

    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    for method, scheme in EXCHANGES:
        exchange = Exchange()
        exchange.mean(x, method, scheme, "v")
        with counting_host_reads() as counts:
            exchange.mean(x, method, scheme, "v")
        out[f"exchange {method}:{scheme}"] = dict(counts)

    makers = {  # warmup_steps=1, sync_every=2: step 1 is a local step, step 2 an exchange
        "ZeroOneAdam shared": lambda ps, m: ZeroOneAdam(ps, m, warmup_steps=1, sync_every=2),
        "ZeroOneAdam own": lambda ps, m: ZeroOneAdam(ps, m, warmup_steps=1, sync_every=2,
                                                     local_updates="own"),
        "DGC": lambda ps, m: DGC(ps, m, density=0.05, clip_norm=0.1),
    }
    for label, make in makers.items():
        model = build_model()
        optimizer = make(list(model.parameters()), model)
        reads = []
        for step in range(3):
            x_in, y = batch(step, rank)
            model.zero_grad()
            F.cross_entropy(model(x_in), y).backward()
            with counting_host_reads() as counts:
                optimizer.step()
            reads.append(dict(counts))
        if label == "DGC":
            out[label] = reads[2]
        else:
            out[f"{label} local"], out[f"{label} exchange"] = reads[1], reads[2]
    return out


def test_a_warm_step_of_every_front_reads_nothing_back():
    results = run_ranks(_warm_step_reads, 2, timeout_s=300)
    for rank, result in enumerate(results):
        labels = [k for k in result if not k.endswith(" buckets")]
        assert len(labels) == len(DDP_FRONTS) + 4 + len(EXCHANGES) + 5
        for label, _, _ in DDP_FRONTS:  # the counted step had the buckets the bound assumes
            assert result[f"{label} buckets"] == 1 + BUCKETS * WARM_STEPS, label  # 1: before the rebuild
        over = {label: result[label] for label in labels
                if sum(result[label].values()) > DOCUMENTED_READS.get(label, 0)}
        assert over == {}, f"rank {rank}: host reads per warm step beyond DOCUMENTED_READS"
        assert sum(result["ZeroOneAdam shared exchange"].values()) == 1  # the counting works
