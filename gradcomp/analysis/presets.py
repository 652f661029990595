"""Preset interconnects and devices (sources in docs/breakeven.md).

Link bandwidths are per rank and direction in Gbit/s. Latencies are the alpha of one collective
step as a collective library sees it (software included), not the wire's: a few microseconds on
NVLink/InfiniBand with NCCL, tens of microseconds over TCP on Ethernet.
"""
from __future__ import annotations

from dataclasses import dataclass

from .collectives import Link

LINKS: dict[str, Link] = {link.name: link for link in (
    # PCIe x16 after 128b/130b encoding: 4.0 = 16 GT/s -> 31.5 GB/s, 5.0 = 32 GT/s -> 63 GB/s
    Link("pcie4", 252.0, 5.0),
    Link("pcie5", 504.0, 5.0),
    # NVLink per GPU and direction: A100 (NVLink 3) 300 GB/s, H100 (NVLink 4) 450 GB/s
    Link("nvlink3", 2400.0, 3.0),
    Link("nvlink4", 3600.0, 3.0),
    # Ethernet with TCP sockets
    Link("10gbe", 10.0, 25.0),
    Link("25gbe", 25.0, 25.0),
    Link("100gbe", 100.0, 15.0),
    Link("200gbe", 200.0, 15.0),
    Link("400gbe", 400.0, 15.0),
    # InfiniBand, 4x links: HDR 200 Gbit/s (ConnectX-6), NDR 400 Gbit/s (ConnectX-7)
    Link("ib-hdr", 200.0, 5.0),
    Link("ib-ndr", 400.0, 5.0),
)}


@dataclass(frozen=True)
class Device:
    """An accelerator (or a CPU) as the cost model sees it.

    memory_gbps: achievable memory bandwidth, GB/s (compress/decompress are memory-bound).
    peak_tflops: dense 16-bit (GPU) or fp32 (CPU) peak, TFLOP/s; training reaches ``mfu`` of it.
    launch_us: fixed cost of one compress or decompress call (kernel launches), microseconds.
    node_link: the preset that joins the devices of one node.
    """

    name: str
    memory_gbps: float
    peak_tflops: float
    launch_us: float
    node_link: str
    mfu: float = 0.4


# Memory bandwidth is the datasheet figure times 0.85, what a streaming kernel reaches (STREAM-like).
DEVICES: dict[str, Device] = {device.name: device for device in (
    Device("cpu", 0.85 * 100.0, 1.0, 20.0, "pcie4"),        # one server socket, 8 DDR4-3200 channels
    Device("a100", 0.85 * 2039.0, 312.0, 10.0, "nvlink3"),  # A100 80GB SXM: HBM2e 2039 GB/s, bf16 312 TF
    Device("h100", 0.85 * 3350.0, 989.0, 10.0, "nvlink4"),  # H100 SXM: HBM3 3.35 TB/s, bf16 989 TF
    Device("h200", 0.85 * 4800.0, 989.0, 10.0, "nvlink4"),  # H200 SXM: HBM3e 4.8 TB/s, bf16 989 TF
)}


@dataclass(frozen=True)
class Node:
    """A server class: ``gpus`` devices joined by ``intra`` (a LINKS name), each with its own
    ``inter`` network link (one NIC per GPU, as in the NVIDIA DGX reference designs)."""

    name: str
    device: str
    gpus: int
    intra: str
    inter: str


NODES: dict[str, Node] = {node.name: node for node in (
    Node("dgx-a100", "a100", 8, "nvlink3", "ib-hdr"),  # DGX A100: 8x ConnectX-6 HDR 200 Gbit/s
    Node("dgx-h100", "h100", 8, "nvlink4", "ib-ndr"),  # DGX H100: 8x ConnectX-7 NDR 400 Gbit/s
    Node("hgx-h100-400gbe", "h100", 8, "nvlink4", "400gbe"),  # HGX H100, one 400 GbE NIC per GPU
    Node("hgx-h100-100gbe", "h100", 8, "nvlink4", "100gbe"),  # HGX H100, one 100 GbE NIC per GPU
)}


def _lookup(table: dict, kind: str, name: str):
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {', '.join(table)}")
    return table[key]


def link(name: str) -> Link:
    """The preset link called ``name`` (ValueError listing the presets otherwise)."""
    return _lookup(LINKS, "link", name)


def device(name: str) -> Device:
    """The preset device called ``name`` (ValueError listing the presets otherwise)."""
    return _lookup(DEVICES, "device", name)


def node(name: str) -> Node:
    """The preset node called ``name`` (ValueError listing the presets otherwise)."""
    return _lookup(NODES, "node", name)
