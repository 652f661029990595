"""The traffic account: global-memory bytes one step of every front moves on the path CUDA takes
(GRADCOMP_BACKEND=triton; kernels run by the Triton interpreter), per gradient element, beside
the minimum for its method and scheme (docs/kernels.md, "Traffic account").

Counted with gradcomp.kernels.traffic.count_bytes: every kernel launch by its own loads and
stores, every torch operator on the data by its operands and results; the collectives' own
traffic (the wire) is not counted. A front is one call of: a DDP hook on a one-parameter bucket
(each gradcomp hook, hierarchical, and auto in each of its choices), gradcomp.fsdp's two
collectives per method, or the optimizers' Exchange.mean per scheme; the step counted is the
second (the first allocates residuals and checks the configuration).

Run inside ranks (tests/dist_utils.run_ranks) in a process where TRITON_INTERPRET=1 was set
before triton was imported.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from gradcomp import get_method
from gradcomp.fsdp import CompressedReduceScatter, CompressedReplicaAllReduce
from gradcomp.hooks import HookState, HookStats, compressed_hook
from gradcomp.hooks.auto import AutoState, auto_hook
from gradcomp.hooks.base import _Bucket
from gradcomp.hooks.compressed import allreduce_hook, state_class
from gradcomp.hooks.hierarchical import HierarchicalState, hierarchical_hook
from gradcomp.hooks.powersgd import PowerSGDState, powersgd_hook
from gradcomp.kernels.traffic import count_bytes
from gradcomp.optim.exchange import Exchange

BOUND = 1.25
"""Every bounded front moves at most this many times its minimum."""
FP32 = 4


@dataclass(frozen=True)
class Front:
    """One front: ``kind`` "ddp" | "hierarchical" | "auto" | "fsdp_scatter" | "fsdp_replica" |
    "exchange"; ``method`` a registered name or "none"; ``scheme``; state ``options``.
    ``data_dependent``: its bytes depend on the data (top-k's sampled threshold, both selectors':
    the candidates that pass it are written, 8 bytes each), so they are affine in n only up to
    that count."""

    label: str
    kind: str
    method: str
    scheme: str
    options: dict = field(default_factory=dict)
    data_dependent: bool = False


FRONTS = [
    Front("allreduce", "ddp", "none", "allreduce"),
    Front("fp16", "ddp", "fp16", "allreduce"),
    Front("fp16 ef", "ddp", "fp16", "allreduce", {"error_feedback": True}),
    Front("bf16", "ddp", "bf16", "allreduce"),
    Front("int8", "ddp", "int8", "allgather"),
    Front("int8 twophase", "ddp", "int8", "twophase"),
    Front("int4", "ddp", "int4", "allgather"),
    Front("sign", "ddp", "sign", "allgather"),
    Front("sign twophase", "ddp", "sign", "twophase"),
    Front("topk", "ddp", "topk", "allgather", data_dependent=True),
    Front("topk threshold", "ddp", "topk", "allgather", {"selector": "threshold", "sample": 256},
          data_dependent=True),
    Front("powersgd", "ddp", "powersgd", "lowrank", {"matrix_rank": 4}),
    Front("hierarchical int8", "hierarchical", "int8", "allgather", {"node_size": 1}),
    Front("hierarchical sign twophase", "hierarchical", "sign", "twophase", {"node_size": 1}),
    Front("auto int8:allgather", "auto", "int8", "allgather"),
    Front("auto sign:twophase", "auto", "sign", "twophase"),
    Front("fsdp int8", "fsdp_scatter", "int8", "reduce-scatter"),
    Front("fsdp sign", "fsdp_scatter", "sign", "reduce-scatter"),
    Front("fsdp topk", "fsdp_scatter", "topk", "reduce-scatter", data_dependent=True),
    Front("fsdp fp16", "fsdp_scatter", "fp16", "reduce-scatter"),
    Front("fsdp replica int8", "fsdp_replica", "int8", "allgather"),
    Front("exchange none", "exchange", "none", "allreduce"),
    Front("exchange fp16", "exchange", "fp16", "allreduce"),
    Front("exchange int8", "exchange", "int8", "allgather"),
    Front("exchange int8 twophase", "exchange", "int8", "twophase"),
    Front("exchange sign twophase", "exchange", "sign", "twophase"),
    Front("exchange topk", "exchange", "topk", "allgather", data_dependent=True),
]


def matrix_shape(front: Front, n: int) -> tuple[int, int] | None:
    """The one matrix a low-rank front compresses (64 x n / 64), None for the others."""
    return (64, n // 64) if front.scheme == "lowrank" else None


def minimum_bytes(front: Front, n: int, world: int, error_feedback: bool, shape=None) -> int:
    """The fewest global-memory bytes one step of ``front`` can move for n fp32 gradient
    elements on ``world`` ranks (the formula in docs/kernels.md): each compression reads its
    input (and residual) once and writes the residual and payload once; each decode reads the
    payloads it sums once and writes its result once; nothing else. ``shape``: the low-rank
    front's matrix (:func:`matrix_shape`)."""
    ef = 8 if error_feedback else 0
    if front.method == "none":
        return 0
    if front.scheme == "lowrank":
        rows, cols = shape
        low = FP32 * front.options["matrix_rank"] * (rows + cols)  # P or Q
        # read x (+ r), write M into r | read x or M | (read M, write r) and decode: write P Q^T;
        # P and Q written, read back and decoded
        return n * (FP32 + ef + FP32 + ef + FP32) + 3 * low
    method = get_method(front.method, **{k: v for k, v in front.options.items()
                                         if k in get_method(front.method).options()})
    if front.kind == "fsdp_scatter":  # n = p x S: compress p - 1 rows, sum p - 1 payloads + own row
        shard = n // world
        wire = method.wire_bytes(shard)
        return (world - 1) * (shard * (FP32 + ef) + wire) + (world - 1) * wire + shard * 2 * FP32
    # the payload's bytes as the scheme sends them: an all-reduce sums the part as it lies, a
    # gather or all-to-all carries rows in the wire layout (padding included)
    wire = method.parts_bytes(n) if front.scheme == "allreduce" else method.wire_bytes(n)
    compress = n * (FP32 + ef) + wire
    if front.scheme == "allreduce":
        return compress + wire + n * FP32
    if front.scheme == "allgather":
        return compress + world * wire + n * FP32
    chunk = n // world  # twophase: compress, sum p chunk payloads, recompress the chunk, decode
    chunk_wire = method.wire_bytes(chunk)
    server = world * chunk_wire + chunk * FP32 + chunk * (FP32 + ef) + chunk_wire
    return compress + server + world * chunk_wire + n * FP32


def _ddp_state(front: Front, rank: int):
    if front.kind == "hierarchical":
        state = HierarchicalState(None, method=front.method, scheme=front.scheme, **front.options)
        return state, hierarchical_hook
    if front.kind == "auto":
        cache = Path(tempfile.mkdtemp(prefix="gradcomp-costs-")) / f"rank{rank}.json"
        # never evaluates: the account switches it to the choice counted
        state = AutoState(None, methods=("none", front.method), warmup_steps=10**9, cache=cache)
        return state, auto_hook
    if front.method == "none":
        return HookState(None), allreduce_hook
    if front.method == "powersgd":
        return PowerSGDState(None, **front.options), powersgd_hook
    scheme = {} if front.scheme == get_method(front.method).schemes[0] else {"scheme": front.scheme}
    return state_class(front.method)(None, **scheme, **front.options), compressed_hook


def _ddp_step(front: Front, n: int, rank: int, shape):
    """The counted call of a DDP front: (Traffic, error feedback on)."""
    state, hook = _ddp_state(front, rank)
    param = torch.nn.Parameter(torch.zeros(shape))
    gen = torch.Generator().manual_seed(rank)

    def bucket():  # the last (only) bucket of a step: each call is one step
        return _Bucket(0, True, torch.randn(n, generator=gen), [param])

    hook(state, bucket()).wait()
    if front.kind == "auto":  # one step in the choice first: the switch's flush is not counted
        state.switch(f"{front.method}:{front.scheme}")
        hook(state, bucket()).wait()
    counted = bucket()
    with count_bytes() as traffic:
        hook(state, counted).wait()
    if front.kind == "auto":
        return traffic, get_method(front.method).error_feedback_default
    return traffic, bool(getattr(state, "error_feedback", False))


def _fsdp_step(front: Front, n: int, rank: int, world: int):
    """The counted call of an FSDP collective (error feedback on): the reduce-scatter of a
    p x n/p input, or the replica all-reduce of an n-element shard; (Traffic, True)."""
    method = get_method(front.method)
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(rank)
    if front.kind == "fsdp_scatter":
        comm = CompressedReduceScatter(method, True, HookStats(), "layer")
        rows = torch.randn(world, n // world, generator=gen)
        shard = torch.empty(n // world)
        args = (shard, rows, group, dist.ReduceOp.AVG)
    else:
        comm = CompressedReplicaAllReduce(method, True, HookStats(), "layer", group)
        args = (torch.randn(n, generator=gen),)
    comm(*args)
    with count_bytes() as traffic:
        comm(*args)
    return traffic, True


def _exchange_step(front: Front, n: int, rank: int):
    """The counted call of Exchange.mean on n elements (error feedback on when compressed);
    (Traffic, whether compressed)."""
    exchange = Exchange()
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    method = None if front.method == "none" else front.method
    scheme = "" if method is None else front.scheme
    exchange.mean(x, method, scheme, "v")
    with count_bytes() as traffic:
        exchange.mean(x, method, scheme, "v")
    return traffic, method is not None


def _by_name(ops: list[tuple[str, int]]) -> dict[str, int]:
    """Bytes per operator name, largest first: the passes a fold would remove."""
    totals: dict[str, int] = {}
    for name, moved in ops:
        totals[name] = totals.get(name, 0) + moved
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def account(rank: int, world: int, n: int, labels=None) -> list[dict]:
    """One row per front (all, or those ``labels`` names) for one step of n fp32 elements."""
    os.environ["GRADCOMP_BACKEND"] = "triton"
    os.environ["GRADCOMP_CPU_COMPILE"] = "0"
    rows = []
    for front in FRONTS:
        if labels is not None and front.label not in labels:
            continue
        if front.kind in ("ddp", "hierarchical", "auto"):
            traffic, feedback = _ddp_step(front, n, rank, matrix_shape(front, n) or (n,))
        elif front.kind.startswith("fsdp"):
            traffic, feedback = _fsdp_step(front, n, rank, world)
        else:
            traffic, feedback = _exchange_step(front, n, rank)
        minimum = minimum_bytes(front, n, world, feedback, matrix_shape(front, n))
        rows.append({"front": front.label, "kind": front.kind, "method": front.method,
                     "scheme": front.scheme, "error_feedback": feedback, "n": n, "world": world,
                     "bytes": traffic.total, "kernel_bytes": traffic.kernel_bytes,
                     "torch_bytes": traffic.torch_bytes, "minimum": minimum,
                     "launches": [list(launch) for launch in traffic.launches],
                     "torch_ops": _by_name(traffic.torch_ops)})
    return rows


def fit(rows_by_n: dict[int, list[dict]]) -> dict[str, tuple[float, float]]:
    """Per front label: (fixed bytes a, bytes per element b) of bytes = a + b n, the line through
    the account at the two smallest sizes of ``rows_by_n`` (n -> account rows). Every launch's
    declared bytes and every torch op's are affine in n at a fixed shape class, so the line
    predicts any n; the account at a third size checks it (:func:`worst_fit_error`)."""
    small, large = sorted(rows_by_n)[:2]
    out = {}
    for a, b in zip(rows_by_n[small], rows_by_n[large]):
        slope = (b["bytes"] - a["bytes"]) / (large - small)
        out[a["front"]] = (a["bytes"] - slope * small, slope)
    return out


def worst_fit_error(lines: dict[str, tuple[float, float]], rows: list[dict]) -> float:
    """The largest |predicted / counted - 1| over ``rows`` (an account at another size), fronts
    whose path depends on the data left out (0 when every front of ``rows`` does)."""
    affine = {f.label for f in FRONTS if not f.data_dependent}
    return max((abs((lines[r["front"]][0] + lines[r["front"]][1] * r["n"]) / r["bytes"] - 1)
                for r in rows if r["front"] in affine), default=0.0)


def table_at(lines: dict[str, tuple[float, float]], rows: list[dict], n: int) -> list[dict]:
    """The account's rows (at any size) carried to n elements along ``lines``: bytes and the
    minimum per element, and their ratio."""
    out = []
    for r in rows:
        front = next(f for f in FRONTS if f.label == r["front"])
        fixed, per = lines[r["front"]]
        moved = fixed + per * n
        minimum = minimum_bytes(front, n, r["world"], r["error_feedback"], matrix_shape(front, n))
        out.append({"front": r["front"], "method": r["method"], "scheme": r["scheme"], "n": n,
                    "bytes_per_element": moved / n,
                    "minimum_per_element": minimum / n if minimum else None,
                    "ratio": moved / minimum if minimum else None})
    return out
