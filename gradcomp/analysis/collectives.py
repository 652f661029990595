"""Alpha-beta costs of the collectives gradcomp's hooks issue: the one place these formulas live.

A link costs ``alpha`` seconds per message and ``beta`` seconds per byte; p ranks; M bytes.
  ring all-reduce                     2(p-1) alpha + 2 (p-1)/p M beta
  tree all-reduce (two-tree, pipelined) 2 ceil(log2 p) alpha + 2 M beta
  reduce-scatter / all-gather of a total of M    (p-1) alpha + (p-1)/p M beta
  all-to-all, M sent by each rank in total       (p-1) alpha + (p-1)/p M beta
Sources: Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA 2005); Sanders, Speck & Traeff, "Two-tree algorithms for full bandwidth broadcast,
reduction and scan" (Parallel Computing 2009), the scheme behind NCCL's double binary trees.

Two levels (p = nodes * g ranks, every rank with its own network link, ``intra`` between the g
ranks of a node): all-reduce = reduce-scatter(intra, M) + all-reduce(inter, nodes, M / g)
+ all-gather(intra, M); an all-gather crosses the network between the ranks of the same slot on
every node and the node; an all-to-all exchanges inside the node and M (n-1)/n crosses each
rank's network link. NCCL pipelines the levels (a ring through every GPU moves chunks over the
node's links and its network link at once), so a two-level collective's bytes cost the slower
level's time, not the sum of both: seconds = every level's latency terms + the largest of the
levels' byte terms. (With NVLink inside the node the network's term is the largest anyway; in a
node whose GPUs talk over PCIe, as fast as the network, summing them would double the cost: the
1-bit Adam blog's InfiniBand runs, docs/breakeven.md.) All ranks in one node of several
(p <= g): every collective runs over ``intra``. A reduce-scatter costs what the all-gather of its
result costs, unless the network has a link fitted to the backend's own reduce-scatter
(``Network.reduce_scatter_link``, ``Network.intra_reduce_scatter``: Gloo's reduce-scatter costs
1.4-2.3x its all-reduce).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..checks import check_number

ALGORITHMS = ("auto", "ring", "tree", "two-level")


@dataclass(frozen=True)
class Link:
    """A link between ranks.

    bandwidth_gbps: nominal bandwidth per rank and direction, Gbit/s.
    latency_us: alpha, the fixed cost of one message step of a collective, microseconds.
    efficiency: the fraction of the nominal bandwidth a collective achieves (1 = the nominal).
    per_byte_s: extra seconds per byte that do not scale with the link (host copies, reduction).
    host_latency_us: the part of ``latency_us`` that is host work (waking threads, system calls).
    transport: the kind of link (gradcomp.analysis.presets.TRANSPORTS: tcp, roce, ib, nvlink, ...)
        whose measured fractions give each collective kind its efficiency; "" for a measured link.
    """

    name: str
    bandwidth_gbps: float
    latency_us: float
    efficiency: float = 1.0
    per_byte_s: float = 0.0
    host_latency_us: float = 0.0
    transport: str = ""

    def __post_init__(self):
        for field, value in (("bandwidth_gbps", self.bandwidth_gbps), ("efficiency", self.efficiency)):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"link {self.name!r}: {field} must be a finite number > 0, got {value!r}")
        for field, value in (("latency_us", self.latency_us), ("per_byte_s", self.per_byte_s)):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"link {self.name!r}: {field} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.host_latency_us, (int, float)) and 0 <= self.host_latency_us <= self.latency_us):
            raise ValueError(f"link {self.name!r}: host_latency_us must be a number in [0, latency_us = "
                             f"{self.latency_us!r}], got {self.host_latency_us!r}")

    @property
    def achieved_gbps(self) -> float:
        """Gbit/s a collective reaches on the wire: nominal x efficiency (host cost not included)."""
        return self.bandwidth_gbps * self.efficiency

    @property
    def alpha_s(self) -> float:
        """Seconds per message step."""
        return self.latency_us * 1e-6

    @property
    def beta_s(self) -> float:
        """Seconds per byte."""
        return 8.0 / (self.bandwidth_gbps * 1e9 * self.efficiency) + self.per_byte_s

    def with_bandwidth(self, gbps: float) -> Link:
        """The same link at another nominal bandwidth (efficiency and per-byte cost kept)."""
        return replace(self, bandwidth_gbps=gbps)

    def with_host_share(self, host: Link) -> Link:
        """The same costs in total, the part ``host`` costs (a link measured where the wire is
        free, e.g. an unshaped loopback) marked as host work: its seconds per byte (at most 99% of
        this link's) in ``per_byte_s``, its latency (at most this link's) in ``host_latency_us``."""
        per_byte = min(host.beta_s, 0.99 * self.beta_s)
        wire_gbps = 8.0 / ((self.beta_s - per_byte) * 1e9 * self.efficiency)
        return replace(self, bandwidth_gbps=wire_gbps, per_byte_s=per_byte,
                       host_latency_us=min(host.latency_us, self.latency_us))


def _pipelined(*terms: tuple[float, float]) -> float:
    """Levels run at once: the sum of their (latency, bytes) terms' latencies plus the largest of
    their byte times."""
    return sum(latency for latency, _ in terms) + max(seconds for _, seconds in terms)


def _terms(seconds_of, link: Link, p: int, nbytes: float) -> tuple[float, float]:
    """(latency, bytes) parts of ``seconds_of(link, p, nbytes)``: its cost at 0 bytes, the rest."""
    latency = seconds_of(link, p, 0.0)
    return latency, seconds_of(link, p, nbytes) - latency


def ring_allreduce_s(link: Link, p: int, nbytes: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``p`` ranks."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes * link.beta_s


def tree_allreduce_s(link: Link, p: int, nbytes: float) -> float:
    """Seconds for a pipelined two-tree all-reduce (reduce then broadcast) of ``nbytes``."""
    if p <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(p)) * link.alpha_s + 2 * nbytes * link.beta_s


def allgather_total_s(link: Link, p: int, total_bytes: float) -> float:
    """Seconds for a ring all-gather (or reduce-scatter) whose result is ``total_bytes`` in all."""
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha_s + (p - 1) / p * total_bytes * link.beta_s


def alltoall_s(link: Link, p: int, nbytes_per_rank: float) -> float:
    """Seconds for a pairwise all-to-all where each rank sends ``nbytes_per_rank`` in total."""
    return allgather_total_s(link, p, nbytes_per_rank)


@dataclass(frozen=True)
class Network:
    """Where ``world_size`` ranks sit and which links join them.

    link: the link the ranks share (one node) or each rank's network link (several nodes).
    gpus_per_node, intra: with gpus_per_node > 1 and more ranks than that, collectives go in two
        levels; ``intra`` joins the ranks of a node.
    allgather_link: the link as seen by all-gathers and all-to-alls when measured apart
        (a calibration fits all-reduce and all-gather separately); defaults to ``link``.
    algorithm: all-reduce algorithm, one of ALGORITHMS ("auto": two-level across nodes, else
        the faster of ring and tree for each message).
    reduce_scatter_link, intra_reduce_scatter: the link as seen by reduce-scatters over all the
        ranks of a one-level network, and inside a node, when measured apart (fitted to the
        backend's own reduce-scatter: torch 2.13's Gloo reduce-scatter of 16.8 MB took 22 ms on 2
        ranks where its all-reduce took 10 and its all-gather 14-17); default: priced as the
        all-gather of the result (``allgather_link``, ``intra``).
    alltoall_link: the link as seen by all-to-alls (a preset transport's all-to-all fraction, or
        a calibration's fit); defaults to ``allgather_link``.
    """

    world_size: int
    link: Link
    gpus_per_node: int = 1
    intra: Link | None = None
    allgather_link: Link | None = None
    algorithm: str = "auto"
    reduce_scatter_link: Link | None = None
    intra_reduce_scatter: Link | None = None
    alltoall_link: Link | None = None

    def __post_init__(self):
        check_number("", "world size", self.world_size, 1, integer=True)
        check_number("", "gpus per node", self.gpus_per_node, 1, integer=True)
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {self.algorithm!r}; choose one of {ALGORITHMS}")
        if self.two_level and self.intra is None:
            raise ValueError(f"{self.gpus_per_node} ranks per node need an intra-node link")
        if self.algorithm == "two-level" and not self.two_level:
            raise ValueError("the two-level algorithm needs gpus_per_node > 1 and more ranks than "
                             f"one node holds (world size {self.world_size}, {self.gpus_per_node} per node)")

    @property
    def two_level(self) -> bool:
        return self.gpus_per_node > 1 and self.world_size > self.gpus_per_node

    @property
    def single_node(self) -> bool:
        """Several ranks, all inside one node of several: every collective runs over ``intra``."""
        return self.intra is not None and 1 < self.world_size <= self.gpus_per_node

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.gpus_per_node) if self.two_level else 1

    @property
    def node_size(self) -> int:
        """Ranks per node that share the intra-node link (1 without one)."""
        return min(self.gpus_per_node, self.world_size) if self.intra is not None else 1

    def within_node_s(self, total_bytes: float, reduce_scatter: bool = False) -> float:
        """Seconds for an all-gather (``reduce_scatter``: a reduce-scatter) of a tensor of
        ``total_bytes`` among the ranks of one node, over ``intra`` (a reduce-scatter over
        ``intra_reduce_scatter`` when set; 0 without an intra-node link)."""
        if self.intra is None:
            return 0.0
        link = self.intra_reduce_scatter if reduce_scatter and self.intra_reduce_scatter else self.intra
        return allgather_total_s(link, self.node_size, total_bytes)

    def between_nodes(self) -> Network:
        """One rank per node over each rank's network link: where the hierarchical scheme's
        compressed exchange runs (a one-rank network on one node)."""
        algorithm = "auto" if self.algorithm == "two-level" else self.algorithm
        return Network(self.nodes, self.link, allgather_link=self.allgather_link, algorithm=algorithm,
                       reduce_scatter_link=self.reduce_scatter_link, alltoall_link=self.alltoall_link)

    def with_bandwidth(self, gbps: float) -> Network:
        """This network with the (inter-node) link at ``gbps``, its all-gather and reduce-scatter
        links scaled alike."""
        scale = gbps / self.link.bandwidth_gbps

        def scaled(link):
            return link.with_bandwidth(link.bandwidth_gbps * scale) if link else None
        return replace(self, link=self.link.with_bandwidth(gbps), allgather_link=scaled(self.allgather_link),
                       reduce_scatter_link=scaled(self.reduce_scatter_link), alltoall_link=scaled(self.alltoall_link))

    def with_world_size(self, world_size: int) -> Network:
        return replace(self, world_size=world_size)

    def without_host_cost(self) -> Network:
        """This network without every link's host work (``per_byte_s`` and ``host_latency_us`` at
        0): a collective's host seconds are its cost here minus its cost without them."""
        def free(link):
            return None if link is None else replace(link, per_byte_s=0.0,
                                                     latency_us=link.latency_us - link.host_latency_us,
                                                     host_latency_us=0.0)
        return replace(self, link=free(self.link), intra=free(self.intra),
                       allgather_link=free(self.allgather_link), reduce_scatter_link=free(self.reduce_scatter_link),
                       intra_reduce_scatter=free(self.intra_reduce_scatter), alltoall_link=free(self.alltoall_link))

    @property
    def _flat(self) -> Link:
        """The link of a one-level collective: ``intra`` inside one node, else ``link``."""
        return self.intra if self.single_node else self.link

    @property
    def _gather(self) -> Link:
        return self.intra if self.single_node else self.allgather_link or self.link

    @property
    def _alltoall(self) -> Link:
        return self.intra if self.single_node else self.alltoall_link or self.allgather_link or self.link

    def allreduce_s(self, nbytes: float) -> float:
        """Seconds to all-reduce ``nbytes`` (every rank contributes and receives ``nbytes``)."""
        p, link = self.world_size, self._flat
        if self.two_level and self.algorithm in ("auto", "two-level"):
            g = self.gpus_per_node
            latency, inside = _terms(allgather_total_s, self.intra, g, nbytes)
            return _pipelined((2 * latency, 2 * inside), _terms(ring_allreduce_s, self.link, self.nodes, nbytes / g))
        if self.algorithm == "ring":
            return ring_allreduce_s(link, p, nbytes)
        if self.algorithm == "tree":
            return tree_allreduce_s(link, p, nbytes)
        return min(ring_allreduce_s(link, p, nbytes), tree_allreduce_s(link, p, nbytes))

    def allgather_s(self, nbytes_each: float) -> float:
        """Seconds to all-gather ``nbytes_each`` from every rank to every rank."""
        if self.two_level:
            n, g = self.nodes, self.gpus_per_node
            return _pipelined(_terms(allgather_total_s, self._gather, n, n * nbytes_each),
                              _terms(allgather_total_s, self.intra, g, self.world_size * nbytes_each))
        return allgather_total_s(self._gather, self.world_size, self.world_size * nbytes_each)

    def reduce_scatter_s(self, total_bytes: float) -> float:
        """Seconds to reduce-scatter ``total_bytes`` (every rank keeps 1 / p of the sum)."""
        measured = self.intra_reduce_scatter if self.single_node else self.reduce_scatter_link
        if measured is not None and not self.two_level:
            return allgather_total_s(measured, self.world_size, total_bytes)
        return self.allgather_s(total_bytes / self.world_size)

    def alltoall_s(self, nbytes_per_rank: float) -> float:
        """Seconds for an all-to-all where each rank sends ``nbytes_per_rank`` split evenly."""
        if self.two_level:
            return _pipelined(_terms(alltoall_s, self.intra, self.gpus_per_node, nbytes_per_rank),
                              _terms(alltoall_s, self._alltoall, self.nodes, nbytes_per_rank))
        return alltoall_s(self._alltoall, self.world_size, nbytes_per_rank)
