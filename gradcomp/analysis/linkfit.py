"""The achieved link from what users already measure, and how far a preset's guess can be off.

Users hold one of two numbers for their cluster:

- nccl-tests' ``all_reduce_perf`` **bus bandwidth** (GB/s, its ``busbw`` column) at a message
  size; nccl-tests defines busbw = algbw x 2(p-1)/p for the ring all-reduce, algbw = bytes /
  seconds, so a busbw B at S bytes on p ranks is an all-reduce of S bytes in
  2(p-1)/p x S / B seconds;
- a profiler's (or their own timer's) **all-reduce of the model's gradients**, in ms.

Either is a measured all-reduce: (bytes, seconds) on a known number of ranks. The link is fitted
by inverting the analyser's own all-reduce cost (``Network.allreduce_s``: alpha-beta, ring or
tree, two levels across nodes) on that many ranks: the achieved bandwidth (Gbit/s per rank and
direction) at which it takes the measured seconds, with the link's latency kept. The fitted
bandwidth serves every collective kind on that level (all-reduce, all-gather, all-to-all).

Two levels: ``intra`` is a measurement inside one node (all_reduce_perf on the node's GPUs), fitted
to the intra-node link; ``inter`` (or a level-less number) is one over every rank of the run,
fitted to the network link with the intra-node link as it stands (measured or preset).

Where a level is not measured, its achieved fraction of nominal is the transport's preset
(presets.TRANSPORTS): a guess. :data:`PLAUSIBLE_FRACTIONS` holds the fractions published
clusters achieved, per transport, with their sources: the verdict is checked at both ends.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .collectives import Link, Network

BUSBW_UNIT = "GB/s"  # nccl-tests prints busbw in GB/s (1e9 bytes per second)


@dataclass(frozen=True)
class FractionRange:
    """Achieved fractions of a link's nominal bandwidth seen on published clusters."""

    low: float
    high: float
    source: str


PLAUSIBLE_FRACTIONS: dict[str, FractionRange] = {
    "tcp": FractionRange(
        0.05, 1.16,
        "published clusters over TCP: 1-bit Adam's 40 GbE V100 cluster achieved 5-7% of nominal (2.0-2.9 Gbit/s "
        "per node at 8-32 GPUs, DeepSpeed's blog, Figures 5 and 7) and 11% (4.5 Gbit/s, the 1-bit Adam paper's "
        "Table 1 all-reduce at 64 GPUs); Bagua's V100 servers 23-116% (0.9 of 1, 3.7 of 4, 18.6 of 16, 23 of 100 "
        "Gbit/s for BERT-Large; 29.5 of 100 and 9.7 of 10 for VGG-16); each cluster's all-reduce as its "
        "uncompressed step implies (gradcomp/published.py)"),
    "ib": FractionRange(
        0.60, 0.96,
        "the 1-bit Adam blog's InfiniBand V100 cluster achieved 60-82% (19-26 of 32 Gbit/s per node, Figure 6 "
        "as its uncompressed step implies, gradcomp/published.py); nccl-tests on A100 nodes with 4 x HDR: 89-96% "
        "(NVIDIA/nccl-tests issues 152 and 119)"),
}
"""Per transport: the achieved fractions of nominal published clusters reached (the ends checked
when a level is a preset guess). Transports without an entry have no published spread here."""


def busbw_seconds(busbw_gbytes: float, nbytes: float, ranks: int) -> float:
    """The all-reduce seconds a nccl-tests bus bandwidth (GB/s) at ``nbytes`` on ``ranks`` means:
    algbw = busbw x p / (2(p-1)), seconds = bytes / algbw."""
    if ranks < 2:
        raise ValueError("a bus bandwidth needs at least 2 ranks")
    return 2 * (ranks - 1) / ranks * nbytes / (busbw_gbytes * 1e9)


def _at(link: Link, gbps: float) -> Link:
    """``link`` achieving ``gbps`` (nominal = achieved, efficiency 1), its latency kept."""
    return replace(link, bandwidth_gbps=gbps, efficiency=1.0, per_byte_s=0.0)


def with_level(network: Network, level: str, gbps: float) -> Network:
    """``network`` with one level at an achieved ``gbps`` for every collective kind: ``inter`` (the
    network link of each rank; on one node with an intra link: nothing) or ``intra``."""
    if level == "intra":
        return replace(network, intra=_at(network.intra, gbps), intra_reduce_scatter=None)
    return replace(network, link=_at(network.link, gbps), allgather_link=None, reduce_scatter_link=None,
                   alltoall_link=None)


def fit_level(network: Network, level: str, nbytes: float, seconds: float) -> float:
    """The achieved Gbit/s of ``level`` at which the analyser's all-reduce of ``nbytes`` over the
    ranks the measurement spans (``intra``: one node; ``inter``: all) takes ``seconds``. ValueError
    when the link's latency alone exceeds ``seconds`` (the measurement is faster than possible)."""
    if level == "intra":
        if network.intra is None:
            raise ValueError("an intra-node measurement needs --gpus-per-node > 1")
        probe = replace(network, world_size=network.node_size if network.two_level else network.world_size)
    else:
        probe = network
    if probe.world_size < 2:
        raise ValueError(f"a measured all-reduce needs at least 2 ranks on the {level} level")

    def cost(gbps):
        return with_level(probe, level, gbps).allreduce_s(nbytes)

    lo, hi = 1e-6, 1e7
    if cost(hi) > seconds:
        floor = cost(hi)
        raise ValueError(f"a measured all-reduce of {nbytes / 2 ** 20:.4g} MiB in {seconds * 1e3:.4g} ms is faster "
                         f"than the link's latency alone allows ({floor * 1e3:.4g} ms at {probe.world_size} ranks; "
                         "lower --latency-us, or check the measurement)")
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if cost(mid) > seconds else (lo, mid)
        if hi / lo < 1 + 1e-9:
            break
    return math.sqrt(lo * hi)


@dataclass(frozen=True)
class Measured:
    """One level's measured all-reduce: what was given (``what``), bytes, seconds, ranks, and the
    achieved Gbit/s fitted to it."""

    level: str
    what: str
    nbytes: float
    seconds: float
    ranks: int
    gbps: float

    def to_dict(self) -> dict:
        return {"level": self.level, "source": "measured", "given": self.what, "bytes": self.nbytes,
                "seconds": self.seconds, "ranks": self.ranks, "achieved_gbps": self.gbps}


def with_fraction(network: Network, levels, fraction: float) -> Network:
    """``network`` with each of ``levels`` (``inter``, ``intra``) at ``fraction`` of its nominal
    bandwidth for every collective kind."""
    for level in levels:
        link = network.intra if level == "intra" else network.link
        network = with_level(network, level, link.bandwidth_gbps * fraction)
    return network


def guessed_levels(network: Network, measured: dict, stated: set) -> dict[str, Link]:
    """The levels of ``network`` whose achieved bandwidth is a preset's guess (a transport's
    fraction of nominal): not measured, not stated by the user, and used by the run (the network
    link across nodes or without an intra link; the intra link inside a node)."""
    out = {}
    used = []
    if network.intra is not None and (network.two_level or network.single_node):
        used.append(("intra", network.intra))
    if not network.single_node:
        used.append(("inter", network.link))
    for level, link in used:
        if level not in measured and level not in stated and link.transport:
            out[level] = link
    return out
