"""Shaped links: network namespaces whose loopback (ShapedLink) or veth pair between two nodes
(ShapedNodes) is shaped by tbf; the launcher (gradcomp.emulate.launch) runs ranks inside them.

A ShapedLink creates its own namespace (``ip netns add gradcomp-<pid>-<n>``), brings its loopback
up and installs ``tc qdisc ... tbf rate R burst B latency L`` on it; ranks talk over 127.0.0.1
inside it only. Both directions of every rank pair share the one loopback queue, so an all-reduce
between two ranks sees R in total, not R per direction: the calibration measures exactly that.
The namespace is deleted on exit, on error, and at interpreter exit (atexit) if still open.

Loopback's default MTU is 64 KiB. tbf drops packets larger than its burst, so the burst is at
least 4 x 64 KiB and at least 2 ms at the rate (a smaller burst starves the link under the
kernel's timer granularity: measured 0.59 of the rate with 64 KiB at 1 Gbit/s, 0.87 with MTU
1500 and 256 KiB, 1.0 with 64 KiB MTU and 256 KiB). ``mtu`` sets another MTU for realism.
"""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess

LOOPBACK = "127.0.0.1"
NAMESPACE_PREFIX = "gradcomp-"
MIN_BURST_BYTES = 4 * 65536
BURST_SECONDS = 0.002
QUEUE_MS = 200
_open_namespaces: set[str] = set()


class EmulationUnavailable(RuntimeError):
    """Shaping is not permitted here (not root, or no ip/tc); the message says why."""


def unavailable_reason() -> str | None:
    """Why a shaped link cannot be made here, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulated links need root (ip netns and tc); run as root or skip the emulation"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated links need {' and '.join(missing)} (iproute2) on PATH"
    return None


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.stdout.strip()}")


def _delete_namespace(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    _open_namespaces.discard(name)


@atexit.register
def _delete_open_namespaces() -> None:
    for name in list(_open_namespaces):
        _delete_namespace(name)


class ShapedLink:
    """A network namespace whose loopback is shaped to ``rate_gbps`` (None: unshaped).

    mtu: loopback MTU (None keeps 64 KiB); burst_bytes: tbf burst (None: see module doc);
    queue_ms: tbf latency, the longest a packet may wait before it is dropped.
    """

    _count = 0

    def __init__(self, rate_gbps: float | None = None, mtu: int | None = None,
                 burst_bytes: int | None = None, queue_ms: float = QUEUE_MS):
        if rate_gbps is not None and not rate_gbps > 0:
            raise ValueError(f"rate_gbps must be > 0 (or None for unshaped), got {rate_gbps!r}")
        if mtu is not None and not 576 <= mtu <= 65536:
            raise ValueError(f"mtu must be in [576, 65536], got {mtu!r}")
        self.rate_gbps, self.mtu, self.burst_bytes, self.queue_ms = rate_gbps, mtu, burst_bytes, queue_ms
        ShapedLink._count += 1
        self.name = f"{NAMESPACE_PREFIX}{os.getpid()}-{ShapedLink._count}"
        self.opened = False

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def open(self) -> ShapedLink:
        reason = unavailable_reason()
        if reason:
            raise EmulationUnavailable(reason)
        _run(["ip", "netns", "add", self.name])
        _open_namespaces.add(self.name)
        self.opened = True
        try:
            _run(self.prefix + ["ip", "link", "set", "lo", "up"])
            if self.mtu:
                _run(self.prefix + ["ip", "link", "set", "lo", "mtu", str(self.mtu)])
            self.set_rate(self.rate_gbps)
        except BaseException:
            self.close()
            raise
        return self

    def burst(self, rate_gbps: float) -> int:
        if self.burst_bytes:
            return self.burst_bytes
        return max(MIN_BURST_BYTES, int(rate_gbps * 1e9 / 8 * BURST_SECONDS))

    def set_rate(self, rate_gbps: float | None) -> None:
        """Shape to ``rate_gbps`` (replacing any shaping), or remove the shaping with None."""
        if rate_gbps is None:
            subprocess.run(self.prefix + ["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True,
                           timeout=30)
        else:
            _run(self.prefix + ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf",
                                "rate", f"{int(rate_gbps * 1e9)}bit", "burst", str(self.burst(rate_gbps)),
                                "latency", f"{self.queue_ms:g}ms"])
        self.rate_gbps = rate_gbps

    def close(self) -> None:
        if self.opened:
            _delete_namespace(self.name)
            self.opened = False

    # the launcher's view: where each rank runs and how it reaches the others
    store_address = LOOPBACK

    def rank_prefix(self, rank: int, world_size: int) -> list[str]:
        """The command prefix of ``rank``: every rank in the one namespace."""
        return self.prefix

    def rank_env(self, rank: int, world_size: int) -> dict:
        return {}

    def __enter__(self) -> ShapedLink:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


class ShapedNodes(ShapedLink):
    """Two nodes: a network namespace each, joined by a veth pair shaped by tbf at ``rate_gbps``
    in each direction (None: unshaped). Node i's ranks (consecutive: ``world_size / 2`` each)
    run in its namespace and bind Gloo to its end of the pair, address 127.0.i+1.1 (a loopback
    address, routed over the pair with ``route_localnet``): inside a node they talk over that
    namespace's loopback, unshaped; between the nodes over the pair, every rank of a node
    sharing its end. The rank store listens on node 0's address.
    """

    NODES = 2

    def __init__(self, rate_gbps: float | None = None, burst_bytes: int | None = None,
                 queue_ms: float = QUEUE_MS):
        super().__init__(rate_gbps, None, burst_bytes, queue_ms)
        self.nodes = [f"{self.name}-node{i}" for i in range(self.NODES)]

    @staticmethod
    def interface(node: int) -> str:
        return f"gcnode{node}"

    @staticmethod
    def address(node: int) -> str:
        return f"127.0.{node + 1}.1"

    @property
    def store_address(self) -> str:
        return self.address(0)

    def node_of(self, rank: int, world_size: int) -> int:
        if world_size % self.NODES:
            raise ValueError(f"{world_size} ranks do not split into {self.NODES} equal nodes")
        return rank // (world_size // self.NODES)

    def rank_prefix(self, rank: int, world_size: int) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[self.node_of(rank, world_size)]]

    def rank_env(self, rank: int, world_size: int) -> dict:
        return {"GLOO_SOCKET_IFNAME": self.interface(self.node_of(rank, world_size))}

    def open(self) -> ShapedNodes:
        reason = unavailable_reason()
        if reason:
            raise EmulationUnavailable(reason)
        self.opened = True
        try:
            for node in self.nodes:
                _run(["ip", "netns", "add", node])
                _open_namespaces.add(node)
            first, second = (["ip", "netns", "exec", node] for node in self.nodes)
            _run(first + ["ip", "link", "add", self.interface(0), "type", "veth", "peer", "name",
                          self.interface(1)])
            _run(first + ["ip", "link", "set", self.interface(1), "netns", self.nodes[1]])
            for node, prefix in enumerate((first, second)):
                device, here, there = self.interface(node), self.address(node), self.address(1 - node)
                _run(prefix + ["ip", "link", "set", "lo", "up"])
                _run(prefix + ["sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1",
                               f"net.ipv4.conf.{device}.route_localnet=1"])
                _run(prefix + ["ip", "addr", "add", f"{here}/32", "dev", device])
                _run(prefix + ["ip", "link", "set", device, "up"])
                _run(prefix + ["ip", "route", "add", f"{there}/32", "dev", device, "src", here])
            self.set_rate(self.rate_gbps)
        except BaseException:
            self.close()
            raise
        return self

    def set_rate(self, rate_gbps: float | None) -> None:
        """Shape both directions of the pair to ``rate_gbps`` (None: unshaped)."""
        for node, name in enumerate(self.nodes):
            prefix = ["ip", "netns", "exec", name]
            if rate_gbps is None:
                subprocess.run(prefix + ["tc", "qdisc", "del", "dev", self.interface(node), "root"],
                               capture_output=True, timeout=30)
            else:
                _run(prefix + ["tc", "qdisc", "replace", "dev", self.interface(node), "root", "tbf",
                               "rate", f"{int(rate_gbps * 1e9)}bit", "burst", str(self.burst(rate_gbps)),
                               "latency", f"{self.queue_ms:g}ms"])
        self.rate_gbps = rate_gbps

    def close(self) -> None:
        if self.opened:
            for node in self.nodes:
                _delete_namespace(node)
            self.opened = False
