"""Hierarchical DDP hook: exact inside a node, compressed only between nodes.

    import gradcomp.hooks.hierarchical as hierarchical
    state = gradcomp.hooks.register(model, "int8", hierarchical=True, node_size=8)  # default: LOCAL_WORLD_SIZE
    state.stats(); state.link_stats()                            # bytes per link class

p ranks in nodes of g consecutive ranks (rank r is local rank r % g of node r // g). Per bucket
of n elements, scaled by 1/p (as every gradcomp hook: in place before the node's exact sum; with
g = 1, by the compression of step 2 as ``Method.compress``'s ``scale``, the product in fp32),
padded to g shards of s = ceil(n / g) elements:

1. intra-node, exact: reduce-scatter of the padded bucket over the node's g ranks; local rank j
   holds shard j summed over its node (fp32 or the bucket's dtype, never compressed);
2. inter-node, compressed: shard j (+ its error-feedback residual) is exchanged with local rank j
   of every other node by the state's scheme (``allreduce`` for summable payloads, ``allgather``
   + one ``Method.decode_sum``, or ``twophase``: ``gradcomp.comm``), and every one of them
   decodes the same payloads in the same order: the shard's average over all p ranks, identical
   on the p / g ranks that hold it;
3. intra-node, exact: all-gather of the g shards into the bucket.

So every rank ends with bit-identical values, and only n / g elements per rank cross the
inter-node link, compressed. The intra-node reduce-scatter runs to completion in the hook's
thread (NCCL: a stream wait; Gloo: a blocking call); the inter-node exchange is asynchronous and
the all-gather that depends on it is launched from the hook's thread at the next bucket or
after DDP's last one (``HookState.deferred``), never from a callback.

Error feedback: one fp32 residual per bucket, bucket-sized and laid out as the bucket's
parameters (so that it follows them across DDP's bucket rebuild and a resume); only this rank's
shard of it is non-zero after a step. When the residual was re-assembled for a new layout (DDP's
bucket rebuild moves elements between shards), what it holds outside this rank's shard is added
to this rank's contribution before the exact reduce-scatter, so it reaches the shard's owner and
is sent there: never lost. ``twophase`` keeps a second ("server") residual per bucket.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.futures import Future

from .. import comm
from ..checks import check_number
from ..schemes import SCHEMES, shard_size
from .base import resumable
from .compressed import CompressedState


def _completed(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


class HierarchicalState(CompressedState):
    """State of :func:`hierarchical_hook`: a CompressedState (method, scheme, error feedback,
    method options; its scheme is the inter-node exchange's) with ``node_size``.

    node_size: ranks per node, g; default ``LOCAL_WORLD_SIZE`` (set by torchrun). The hook's
        group must hold a multiple of g ranks (checked at the first bucket, on every rank).
    The intra-node and inter-node groups are made once, at the first bucket, by the ranks of
    each (``dist.new_group(..., use_local_synchronization=True)``, every rank in the same order).

    ``link_stats()``: bytes per link class (``intra``: exact, ``inter``: compressed) handed to
    collectives, in total and per step. ``stats()``' ``wire_bytes`` counts both.
    """

    def __init__(self, process_group=None, *, node_size: int | None = None, **options):
        if node_size is None:
            local = os.environ.get("LOCAL_WORLD_SIZE")
            if local is None:
                raise ValueError("HierarchicalState: give node_size (ranks per node) or set "
                                 "LOCAL_WORLD_SIZE (torchrun does)")
            node_size = int(local)
        check_number("HierarchicalState", "node_size", node_size, 1, integer=True)
        super().__init__(process_group, **options)
        self.node_size = node_size
        self.link_bytes = {"intra": 0, "inter": 0, "inter_raw": 0}
        self._groups = None
        self._assembled: dict = {}  # bucket name -> the residual tensor last flushed outside the shard

    def config(self, hook_name: str) -> dict:
        return {**super().config(hook_name), "node_size": self.node_size}

    def groups(self) -> tuple:
        """(intra-node group, inter-node group) of this rank, made on the first call."""
        if self._groups is None:
            ranks = dist.get_process_group_ranks(self.group)  # global ranks, in group order
            g = self.node_size
            if len(ranks) % g:
                raise ValueError(f"HierarchicalState: world size {len(ranks)} is not a multiple of "
                                 f"node_size {g}")
            me = self.rank
            node, local = divmod(me, g)
            intra = [ranks[node * g + j] for j in range(g)]
            inter = [ranks[k * g + local] for k in range(len(ranks) // g)]
            self._groups = tuple(
                dist.new_group(members, use_local_synchronization=True) if len(members) > 1 else None
                for members in (intra, inter))
        return self._groups

    def count_link(self, link: str, nbytes: int) -> None:
        self.link_bytes[link] += nbytes
        if link != "inter_raw":
            self.stats.add(wire_bytes=nbytes)

    def link_stats(self) -> dict:
        """{"intra": {...}, "inter": {...}}: bytes this rank handed to collectives on each link
        class (inter also ``raw_bytes``: the same shards uncompressed), totals and per step."""
        steps = max(self.stats.steps, 1)
        out = {}
        for link in ("intra", "inter"):
            out[link] = {"bytes": self.link_bytes[link], "bytes_per_step": self.link_bytes[link] / steps}
        raw = self.link_bytes["inter_raw"]
        out["inter"].update(raw_bytes=raw, raw_bytes_per_step=raw / steps,
                            ratio=raw / self.link_bytes["inter"] if self.link_bytes["inter"] else float("nan"))
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "node_size": self.node_size, "link_bytes": dict(self.link_bytes)}

    def _loaded(self, state: dict) -> dict:
        if state.get("node_size") != self.node_size:
            raise ValueError(f"HierarchicalState.load_state_dict: checkpoint node_size "
                             f"{state.get('node_size')!r} differs from this state's {self.node_size}")
        link_bytes = {k: int(v) for k, v in state.get("link_bytes", self.link_bytes).items()}
        return {**super()._loaded(state), "link_bytes": link_bytes, "_groups": None}

    def __getstate__(self):
        out = super().__getstate__()
        out["_groups"], out["_assembled"] = None, {}
        return out


def _exchange_between_nodes(state: HierarchicalState, name: str, shard: torch.Tensor,
                            residual: torch.Tensor | None, method_state: dict, group,
                            scale: float, out: torch.Tensor | None = None) -> tuple:
    """Sum ``scale`` times ``shard`` (+ residual) over the inter-node group with the state's
    scheme, compressed; (Future of the sum, decoded into ``out``, a contiguous tensor of the
    shard's numel, or a new fp32 tensor; payload bytes handed to the collectives). A two-phase
    shard is already ``nodes`` chunks of whole granules (:func:`shard_size`); its chunk's sum is
    re-compressed unscaled."""
    method, exchange = state.method(), SCHEMES[state.scheme]

    def compress(x):
        with state.stats.timed("compress_s", shard.device):
            return method.compress(x, residual, method_state, scale)

    def recompress(chunk_sum):
        with state.stats.timed("compress_s", shard.device):
            return state.compress(name + "/server", chunk_sum, method, state.error_feedback)

    sent = exchange.send(shard, method, compress, dist.get_world_size(group))
    future = exchange.launch(sent, method, recompress, group, state.deferred)

    def decode(fut):
        with state.stats.timed("decompress_s", shard.device):
            target = torch.empty(shard.numel(), dtype=torch.float32, device=shard.device) if out is None else out
            return exchange.decode(method, fut.value(), target, state.stats)
    return future.then(decode), exchange.sent_bytes(sent)


@resumable
def hierarchical_hook(state: HierarchicalState, bucket):
    """DDP comm hook: the bucket averaged over ranks, exact inside each node, compressed with
    the state's method and scheme between nodes (see the module doc)."""
    if not isinstance(state, HierarchicalState):
        raise TypeError(f"hierarchical_hook: state must be a HierarchicalState, got {type(state).__name__}")
    hook_name = f"hierarchical_{state.method_name}_hook"
    state.begin_bucket(bucket, hook_name)  # the configuration check (node_size included) first
    intra, inter = state.groups()
    buffer = bucket.buffer()
    # one rank per node (g = 1): nothing is summed before the compression, which scales (fp32);
    # otherwise the node's exact sum (fp16 must not overflow) and the residual flushed into it
    # below are in the scaled units: the bucket is scaled first, in place
    scale = 1.0 / state.world_size
    if intra is not None:
        buffer.mul_(scale)
        scale = 1.0
    node_size, numel = state.node_size, buffer.numel()
    shard_numel = shard_size(numel, node_size, state.world_size // node_size, state.scheme,
                             state.method().granule)
    local = state.rank % node_size
    padded = F.pad(buffer, (0, node_size * shard_numel - numel)) if node_size * shard_numel > numel else buffer
    launched = comm.mark(buffer.device)
    name = f"bucket{bucket.index()}"
    residual, method_state = None, {}
    if state.error_feedback and inter is not None:
        whole, method_state = state.residuals.get(name, node_size * shard_numel,
                                                  state.bucket_layout(bucket), buffer.device)
        mine = slice(local * shard_numel, (local + 1) * shard_numel)
        if state._assembled.get(name) is not whole:  # new or re-assembled: flush the rest
            for other in (slice(0, mine.start), slice(mine.stop, None)):
                padded[other] += whole[other].to(padded.dtype)
                whole[other].zero_()
            state._assembled[name] = whole
        residual = whole[mine]

    # 1. exact reduce-scatter inside the node
    if intra is None:
        shard = padded.float()
    else:
        shard = torch.empty(shard_numel, dtype=buffer.dtype, device=buffer.device)
        comm.reduce_scatter_into(shard, padded, group=intra)
        state.count_link("intra", padded.numel() * padded.element_size())
        shard = shard.float()

    # 2. compressed exchange between nodes, this rank's shard of the bucket's residual
    # an unpadded bucket takes the sum itself: decoded into it when it is the shard (one rank per
    # node; the compression has read it by then), else all-gathered into it (step 3)
    in_place = padded is buffer and buffer.is_contiguous()
    if inter is None:
        summed = _completed(shard)
    else:
        out = buffer if in_place and intra is None else None
        summed, payload_bytes = _exchange_between_nodes(state, name, shard, residual, method_state,
                                                        inter, scale, out)
        state.count_link("inter", payload_bytes)
        state.count_link("inter_raw", shard_numel * buffer.element_size())

    # 3. exact all-gather inside the node (launched from this thread: deferred)
    def finish(gathered: torch.Tensor) -> torch.Tensor:
        state.stats.add_interval("comm_s", launched, comm.mark(buffer.device))
        return buffer if gathered is buffer else buffer.copy_(gathered[:numel])

    if intra is None:
        future = summed.then(lambda fut: finish(fut.value()))
    else:
        gathered = (buffer if in_place else
                    torch.empty(node_size * shard_numel, dtype=buffer.dtype, device=buffer.device))

        def all_gather(shard_sum: torch.Tensor) -> Future:
            work = comm.all_gather_into(gathered, shard_sum.to(buffer.dtype), group=intra, async_op=True)

            def arrived(fut: Future) -> torch.Tensor:
                fut.wait()  # re-raises a failed collective's error before the buffer is read
                return finish(gathered)
            return work.get_future().then(arrived)

        state.count_link("intra", shard_numel * buffer.element_size())
        future = state.deferred.then(summed, all_gather)
    state.end_bucket(bucket)
    return future


__all__ = ["HierarchicalState", "hierarchical_hook", "shard_size"]
