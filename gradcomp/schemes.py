"""One object per communication scheme: how it exchanges a compressed tensor, what it puts on
the wire, and what the cost model charges for it.

A method names the schemes its payloads allow (``Method.schemes``); :data:`SCHEMES` maps each
name to its object here, the one list of schemes. The
fronts (the DDP hooks, the hierarchical hook, the optimizers' exchange) run a scheme as

    sent = scheme.send(x, method, compress, world)            # this rank's payload(s) of x
    arrived = scheme.launch(sent, method, recompress, group, deferred)   # Future, collectives issued
    bytes_counted = scheme.sent_bytes(sent)
    ... scheme.decode(method, arrived.value(), out)          # the sum over ranks, into out

with their own ``compress`` / ``recompress`` (error feedback, timing), so that a front owns its
state and a scheme owns the collectives. The analyser prices the same scheme with
:meth:`Scheme.stages` (the cost model and the optimizers' estimate), :meth:`Scheme.wire_bytes`
and :meth:`Scheme.collective_s` (auto). Adding a scheme is one subclass below, listed in
:data:`SCHEMES`; this module hands the names to the method registry when it loads
(``gradcomp.methods.registry.declare_schemes``: methods sit below this module and cannot import
it), which then checks every method's ``schemes`` against them.
"""
from __future__ import annotations

import math
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch.futures import Future

from . import comm
from .methods.registry import declare_schemes
from .payload import Payload

Compress = Callable[[torch.Tensor], Payload]
"""A front's compress: (flat tensor) -> its payload, with the front's error feedback and timing."""


class Scheme:
    """How a compressed tensor crosses the wire; stateless (one shared instance per scheme).

    per_tensor: exchanges tensor by tensor with their shapes (low-rank: PowerSGD's own hook),
        not a flat tensor; the fronts that exchange flat tensors (:data:`FLAT_SCHEMES`) do not
        run it.
    deferred: a second collective waits in the front's ``Deferred`` queue (launched at the next
        flush), so the tensor arrives after the next bucket's launch.
    summing: the collective sums the payloads themselves (an all-reduce of summable payloads):
        the front keeps nothing between buckets, so a method whose first scheme sums also has a
        hook that runs without a state (as torch's fp16_compress_hook).
    chunked: a method declaring it promises that a payload of p chunks of whole granules cuts
        into the chunks' payloads (``Payload.as_rows``); FSDP then compresses its p rows in one
        pass.
    """

    name: ClassVar[str]
    per_tensor: ClassVar[bool] = False
    deferred: ClassVar[bool] = False
    summing: ClassVar[bool] = False
    chunked: ClassVar[bool] = False

    # ---- the exchange (fronts) -----------------------------------------------------------------

    def padded_numel(self, numel: int, world: int, granule: int) -> int:
        """Elements the scheme sends for a tensor of ``numel`` on ``world`` ranks (padding
        included) by a method coding ``granule`` elements together: ``numel``."""
        return numel

    def send(self, x: torch.Tensor, method, compress: Compress, world: int) -> Payload:
        """This rank's payload of the flat tensor ``x``: ``compress(x)``."""
        return compress(x)

    def launch(self, sent: Payload, method, recompress: Compress | None, group,
               deferred: comm.Deferred | None) -> Future:
        """Issue the collectives of ``sent`` now; a Future of what arrives (for :meth:`decode`)."""
        raise NotImplementedError

    def sent_bytes(self, sent: Payload) -> int:
        """Bytes this rank hands to the collectives for ``sent`` (what the fronts count): its
        rows in the wire layout, padding included (``Payload.nbytes``)."""
        return sent.nbytes

    def decode(self, method, arrived: Payload, out: torch.Tensor, stats=None) -> torch.Tensor:
        """Write the sum over ranks that ``arrived`` carries into ``out`` (flat, contiguous, the
        tensor's numel, any float dtype); returns ``out``. ``stats``: the front's HookStats, whose
        :meth:`~gradcomp.hooks.HookStats.dropped_counter` counts peers' entries a decode drops
        (None: they raise, see ``Method.decode_sum``)."""
        raise NotImplementedError

    # ---- the model (analysis) ------------------------------------------------------------------

    def wire_bytes(self, method, numel: int, world: int, shapes=None) -> int:
        """Bytes per rank :meth:`sent_bytes` counts for a tensor of ``numel`` elements
        (``shapes``: its tensors' shapes, for a per-tensor method) on ``world`` ranks."""
        return method.wire_bytes(numel)

    def collective_s(self, net, wire_bytes: float) -> float:
        """Seconds of the collectives carrying ``wire_bytes`` (as :meth:`wire_bytes` counts
        them) over ``net`` (a gradcomp.analysis.Network)."""
        raise NotImplementedError

    def decode_s(self, method_cost, numel: int, world: int) -> float:
        """Seconds of decoding the collective's result into the tensor (``method_cost``: a
        gradcomp.analysis.MethodCost)."""
        return method_cost.decompress_s(numel)

    def stages(self, method, method_cost, numel: int, net, shapes=None,
               average_s: float = 0.0) -> tuple[list[tuple[str, float]], int]:
        """The chain of (resource, seconds) one tensor of ``numel`` elements goes through
        (resource ``compute`` or ``network``; the compress stage includes ``average_s``) over
        ``net``, and its wire bytes per rank."""
        wire = self.wire_bytes(method, numel, net.world_size, shapes)
        return [("compute", average_s + method_cost.compress(numel)),
                ("network", self.collective_s(net, wire)),
                ("compute", self.decode_s(method_cost, numel, net.world_size))], wire


class AllReduce(Scheme):
    """Summable payloads (fp16, bf16): the payload's one part summed by a ring all-reduce,
    2 (p-1)/p x its bytes sent per rank; one payload decoded."""

    name = "allreduce"
    summing = True

    def launch(self, sent, method, recompress, group, deferred):
        return comm.allreduce_payload(sent, group)

    def sent_bytes(self, sent):
        return sent.parts_nbytes  # the part all-reduced as it lies: no wire-layout padding

    def wire_bytes(self, method, numel, world, shapes=None):
        return method.parts_bytes(numel)

    def decode(self, method, arrived, out, stats=None):
        return method.decompress(arrived, out)

    def collective_s(self, net, wire_bytes):
        return net.allreduce_s(wire_bytes)


class AllGather(Scheme):
    """Every rank's payload gathered (each receives (p-1) x its bytes: grows with p), then the p
    payloads decoded and summed in one pass."""

    name = "allgather"

    def launch(self, sent, method, recompress, group, deferred):
        return comm.allgather_payloads(sent, group)

    def decode(self, method, arrived, out, stats=None):
        dropped = (stats.dropped_counter(arrived.rows, out.device)
                   if stats is not None and method.indexed else None)
        return method.decode_sum(arrived, out, dropped=dropped)

    def collective_s(self, net, wire_bytes):
        return net.allgather_s(wire_bytes)

    def decode_s(self, method_cost, numel, world):
        return method_cost.decompress_s(numel, world)


class TwoPhase(Scheme):
    """Compressed all-reduce in two phases (:func:`gradcomp.comm.two_phase_allreduce`): the
    tensor padded to p chunks of whole granules, all-to-all of the p chunk payloads, each rank
    decodes-and-sums its chunk and re-compresses it (``recompress``: the front's second error
    feedback), all-gather of the re-compressed chunks: 2 (p-1)/p x the payload, flat in p.
    Bytes counted: every chunk payload (phase 1) plus one re-compressed chunk (phase 2), each a
    row of the wire layout: (p + 1) x one chunk payload's bytes."""

    name = "twophase"
    deferred = True
    chunked = True

    def padded_numel(self, numel, world, granule):
        """``numel`` rounded up to p chunks of whole granules (``Method.granule``)."""
        return comm.chunk_bounds(numel, world, granule)[-1][1]

    def send(self, x, method, compress, world):
        padded_numel = self.padded_numel(x.numel(), world, method.granule)
        padded = F.pad(x, (0, padded_numel - x.numel())) if padded_numel > x.numel() else x
        # chunks of whole granules: the padded tensor's payload, cut in p rows, is the p chunks'
        return compress(padded).as_rows(world)

    def launch(self, sent, method, recompress, group, deferred):
        return comm.two_phase_allreduce(sent, recompress, deferred, group)

    def sent_bytes(self, sent):
        # phase 1 sends every chunk payload; phase 2 one re-compressed chunk (the same layout)
        return sent.nbytes + sent.row(0).nbytes

    def decode(self, method, arrived, out, stats=None):
        whole = arrived.joined()  # chunks of whole granules end to end: the padded payload
        if whole.numel == out.numel():
            return method.decompress(whole, out)
        padded = method.decompress(whole, torch.empty(whole.numel, dtype=out.dtype, device=out.device))
        return out.copy_(padded[:out.numel()])

    def wire_bytes(self, method, numel, world, shapes=None):
        return (world + 1) * method.wire_bytes(self.padded_numel(numel, world, method.granule) // world)

    def collective_s(self, net, wire_bytes):
        p = net.world_size
        chunk = wire_bytes / (p + 1)  # p chunk payloads in the all-to-all, then one gathered
        return net.alltoall_s(p * chunk) + net.allgather_s(chunk)

    def stages(self, method, method_cost, numel, net, shapes=None, average_s=0.0):
        p = net.world_size
        padded = self.padded_numel(numel, p, method.granule)
        chunk = padded // p
        reduce_chunk = method_cost.decompress_s(chunk, p) + method_cost.compress(chunk)
        return [("compute", average_s + method_cost.compress(numel)),
                ("network", net.alltoall_s(p * method.wire_bytes(chunk))), ("compute", reduce_chunk),
                ("network", net.allgather_s(method.wire_bytes(chunk))),
                ("compute", self.decode_s(method_cost, numel, p))], self.wire_bytes(method, numel, p)


class LowRank(Scheme):
    """PowerSGD's two all-reduces, of P (with the uncompressed tensors) then of Q, tensor by
    tensor: run by its own hook (gradcomp.hooks.powersgd), priced here."""

    name = "lowrank"
    per_tensor = True

    def wire_bytes(self, method, numel, world, shapes=None):
        # P and Q all-reduced as they lie: the parts' bytes, no wire-layout padding
        if method.per_tensor and shapes is not None:
            return sum(method.parts_bytes(math.prod(s), tuple(s)) for s in shapes)
        return method.parts_bytes(numel)

    def collective_s(self, net, wire_bytes):
        return net.allreduce_s(wire_bytes)

    def stages(self, method, method_cost, numel, net, shapes=None, average_s=0.0):
        # the compress split evenly around the first all-reduce (ring cost is linear in bytes,
        # so an even split of the wire bytes gives the same total as the true P/Q split); it
        # averages the small reduced results only (no average stage)
        wire = self.wire_bytes(method, numel, net.world_size, shapes)
        half = ("compute", method_cost.compress(numel) / 2)
        all_reduce_half = ("network", net.allreduce_s(wire / 2))
        return [half, all_reduce_half, half, all_reduce_half,
                ("compute", self.decode_s(method_cost, numel, net.world_size))], wire


SCHEMES: dict[str, Scheme] = {s.name: s for s in (AllReduce(), AllGather(), TwoPhase(), LowRank())}
"""Every scheme by name."""
declare_schemes(tuple(SCHEMES))

FLAT_SCHEMES: tuple[str, ...] = tuple(name for name, s in SCHEMES.items() if not s.per_tensor)
"""The schemes that exchange a flat tensor: what CompressedState hooks, the hierarchical hook
and the optimizers' exchange serve."""


def shard_size(numel: int, node_size: int, nodes: int, scheme: str, granule: int) -> int:
    """Elements of each of the ``node_size`` shards of a bucket of ``numel`` (the bucket padded
    to node_size x shard) that the hierarchical hook exchanges between ``nodes`` nodes with
    ``scheme``: ceil(numel / node_size), padded as the scheme pads it across the nodes
    (``twophase``: ``nodes`` chunks of whole granules, so that the shard's payload cuts into the
    nodes' chunks; one node: nothing to cut)."""
    shard = -(-numel // node_size)
    return SCHEMES[scheme].padded_numel(shard, nodes, granule) if nodes > 1 else shard


def scheme(name: str) -> Scheme:
    """The Scheme named ``name`` (a ValueError naming the known ones otherwise)."""
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; choose one of {', '.join(SCHEMES)}")
    return SCHEMES[name]
