"""Preset interconnects and devices, with their sources (docs/breakeven.md lists them too).

Link bandwidths are nominal, per rank and direction, in Gbit/s; each link belongs to a transport
(:data:`TRANSPORTS`) whose measured fractions say what a collective achieves of that nominal
bandwidth, per collective kind (ring all-reduce, all-gather, all-to-all). Latencies are the alpha
of one collective step as a collective library sees it (software included), not the wire's: a few
microseconds on NVLink/InfiniBand with NCCL, tens of microseconds over TCP on Ethernet.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .collectives import Link


@dataclass(frozen=True)
class Transport:
    """What collectives achieve on a kind of link, as a fraction of its nominal bandwidth:
    ``allreduce`` (NCCL's ring all-reduce bus bandwidth / nominal), ``allgather``, ``alltoall``
    (the same for those collectives; equal to the all-reduce's where no separate measurement was
    found, as ``source`` says)."""

    name: str
    allreduce: float
    allgather: float
    alltoall: float
    source: str

    def fraction(self, kind: str) -> float:
        return getattr(self, kind)


COLLECTIVE_KINDS = ("allreduce", "allgather", "alltoall")

TRANSPORTS: dict[str, Transport] = {t.name: t for t in (
    Transport("tcp", 0.5, 0.5, 0.5,
              "NCCL over TCP sockets: at most 60% of a 32 Gbit/s link (github.com/NVIDIA/nccl/issues/209); "
              "4.5-5.2 of 12.5 GB/s all-reduce bus bandwidth at 8-16 MB on 100 Gbit/s (NVIDIA/nccl/issues/450); "
              "all-gather and all-to-all not measured apart (the all-reduce's fraction)"),
    Transport("roce", 0.75, 0.75, 0.75,
              "2 A100 nodes, 8 x 100 Gbit/s RoCE each: 600 of 800 Gbit/s all-reduce bus bandwidth, \"roughly "
              "matching our expectation\" (NVIDIA/nccl/issues/495); all-gather, all-to-all: the all-reduce's"),
    Transport("ib", 0.93, 0.93, 0.96,
              "all-reduce bus bandwidth: DGX A100, 8 x HDR: 192 of 200 GB/s (NVIDIA, NVIDIA/nccl/issues/1576); "
              "A100 nodes, 4 x HDR: 89-93 of 100 GB/s (NVIDIA/nccl-tests/issues/152), 96 peak (issues/119); "
              "all-gather: within 2% of the all-reduce across 4 H100 nodes (one published nccl-tests run), "
              "the all-reduce's taken; all-to-all: one NIC's rate per GPU, 48-49 of 50 GB/s at NDR "
              "(NVIDIA/nccl-tests/issues/267)"),
    Transport("nvlink", 0.78, 0.78, 0.78,
              "8 x A100 NVLink 3: 232.5 GB/s all-reduce bus bandwidth of 300 per direction "
              "(NVIDIA/nccl/issues/1048), ~200 (NVIDIA/nccl-tests/issues/149); H100 with NVLink SHARP reaches "
              "more (480 GB/s in one published run) - not assumed; all-gather, all-to-all: the all-reduce's"),
    Transport("pcie", 0.7, 0.7, 0.7, "assumed (no measurement found): calibrate"),
    Transport("infinity-fabric", 0.78, 0.78, 0.78,
              "assumed: NVLink's fractions (no RCCL measurement found): calibrate"),
)}


def _link(name: str, gbps: float, latency_us: float, transport: str) -> Link:
    return Link(name, gbps, latency_us, TRANSPORTS[transport].allreduce, transport=transport)


LINKS: dict[str, Link] = {link.name: link for link in (
    # PCIe x16 after 128b/130b encoding: 3.0 = 8 GT/s -> 15.75 GB/s, 4.0 = 16 GT/s -> 31.5 GB/s, 5.0 -> 63 GB/s
    _link("pcie3", 126.0, 5.0, "pcie"),
    _link("pcie4", 252.0, 5.0, "pcie"),
    _link("pcie5", 504.0, 5.0, "pcie"),
    # NVLink per GPU and direction: V100 (NVLink 2, 6 links) 150 GB/s, A100 (NVLink 3) 300 GB/s,
    # H100 (NVLink 4) 450 GB/s; MI300X Infinity Fabric: 7 links x 64 GB/s per direction
    _link("nvlink2", 1200.0, 3.0, "nvlink"),
    _link("nvlink3", 2400.0, 3.0, "nvlink"),
    _link("nvlink4", 3600.0, 3.0, "nvlink"),
    _link("infinity-fabric", 3584.0, 3.0, "infinity-fabric"),
    # Ethernet with TCP sockets
    _link("10gbe", 10.0, 25.0, "tcp"),
    _link("25gbe", 25.0, 25.0, "tcp"),
    _link("40gbe", 40.0, 25.0, "tcp"),
    _link("100gbe", 100.0, 15.0, "tcp"),
    _link("200gbe", 200.0, 15.0, "tcp"),
    _link("400gbe", 400.0, 15.0, "tcp"),
    # Ethernet with RDMA (RoCE v2)
    _link("roce-100", 100.0, 8.0, "roce"),
    _link("roce-200", 200.0, 8.0, "roce"),
    _link("roce-400", 400.0, 8.0, "roce"),
    # InfiniBand 4x: QDR 32 Gbit/s of data (40 signalled, 8b/10b), EDR 100, HDR 200 (ConnectX-6),
    # NDR 400 (ConnectX-7)
    _link("ib-qdr", 32.0, 5.0, "ib"),
    _link("ib-edr", 100.0, 5.0, "ib"),
    _link("ib-hdr", 200.0, 5.0, "ib"),
    _link("ib-ndr", 400.0, 5.0, "ib"),
)}


def transport(name: str) -> Transport:
    """The transport called ``name`` (ValueError listing them otherwise)."""
    return _lookup(TRANSPORTS, "transport", name)


def collective_links(link: Link, efficiency: float | None = None) -> dict[str, Link]:
    """``link`` as each collective kind sees it: its transport's achieved fraction per kind (a
    link without a transport, or with ``efficiency`` given: that one fraction for every kind)."""
    if efficiency is not None:
        return {kind: replace(link, efficiency=efficiency) for kind in COLLECTIVE_KINDS}
    if not link.transport:
        return {kind: link for kind in COLLECTIVE_KINDS}
    t = transport(link.transport)
    return {kind: replace(link, efficiency=t.fraction(kind)) for kind in COLLECTIVE_KINDS}


@dataclass(frozen=True)
class KernelRates:
    """How fast one method's kernels move their declared bytes, as a fraction of a device-to-device
    copy's bytes per second: ``compress`` (with error feedback) and ``decode``, (payloads, fraction)
    points of the decode-and-sum of that many payloads (between points log-linear in the payloads,
    beyond them the nearest: ``MethodCost.decode_factor``)."""

    compress: float
    decode: tuple[tuple[int, float], ...]


# Measured on one H100 (benchmarks/results/bench_gpu_h100_532ad50.json and
# bench_gpu_h100_532ad50_2.json, the two runs' median "copy_fraction" at 100M elements, where the
# fixed costs are small beside the bytes; GPU_LAUNCH_US prices those): a method's kernels against
# the copy of the same run. Every GPU preset takes these fractions of its own bandwidth (only the
# H100 was measured: the A100, H200 and the others are scaled from it by bandwidth). PowerSGD has
# none: its 0.22-0.25 of the copy is its per-call and per-matrix fixed costs (GPU_CALL_US,
# GPU_TENSOR_US), its bytes run at the copy's speed. At 16M elements some ran slower (top-k's
# compress 0.07-0.15, int8's 0.38 in one run): docs/kernels.md. The int8/int4/sign and top-k
# decode-sums and PowerSGD's hook were redesigned after 532ad50: their fractions (and PowerSGD's
# fixed costs below) are the old kernels' until bench_gpu runs again.
H100_KERNEL_RATES: dict[str, KernelRates] = {
    "fp16": KernelRates(1.01, ((2, 0.99), (8, 0.97), (64, 0.93))),
    "bf16": KernelRates(1.02, ((2, 0.99), (8, 0.97), (64, 0.92))),
    "int8": KernelRates(0.95, ((2, 0.98), (8, 0.99), (64, 0.98))),
    "int4": KernelRates(0.83, ((2, 0.81), (8, 0.66), (64, 0.54))),
    "sign": KernelRates(0.92, ((2, 0.91), (8, 0.72), (64, 0.32))),
    "topk": KernelRates(0.40, ((2, 0.56), (8, 0.28), (64, 0.11))),
}
KERNEL_RATES_SOURCE = ("H100, benchmarks/results/bench_gpu_h100_532ad50.json and _2.json: median fraction of "
                       "the copy at 100M elements")


@dataclass(frozen=True)
class Device:
    """An accelerator (or a CPU) as the cost model sees it.

    memory_gbps: achievable memory bandwidth, GB/s (compress/decompress are memory-bound).
    peak_tflops: dense 16-bit (GPU) or fp32 (CPU) peak, TFLOP/s; training reaches ``mfu`` of it.
    launch_us: fixed cost of one compress or decompress call (kernel launches), microseconds.
    node_link: the preset that joins the devices of one node.
    call_us, tensor_us: fixed costs of a method that compresses tensor by tensor (PowerSGD): per
        hook call (its collectives' buffers, the hook's own work) and per compressed tensor (its
        matmuls, orthogonalization, error feedback: launch-bound), microseconds.
    kernel_rates: method name -> :class:`KernelRates`, its kernels' speed as a fraction of
        ``memory_gbps`` (a method not in it: 1, its declared bytes at the copy's speed).
    """

    name: str
    memory_gbps: float
    peak_tflops: float
    launch_us: float
    node_link: str
    mfu: float = 0.4
    call_us: float = 0.0
    tensor_us: float = 0.0
    kernel_rates: dict[str, KernelRates] = field(default_factory=dict)


# Memory bandwidth is the datasheet figure times 0.85, what a device copy reaches (STREAM-like; the
# H100's copy measured 2952 of 3350 GB/s: 0.88, docs/kernels.md "Measured on an H100"); each
# method's kernels run at their measured fraction of it (H100_KERNEL_RATES).
# GPU fixed costs, measured on one H100 (benchmarks/results/bench_gpu_h100_532ad50*.json): a
# compress or decode kernel at 1M elements takes 4-6 us beyond its bytes at the copy's speed
# (GPU_LAUNCH_US); PowerSGD rank 4's whole hook took 0.87-1.06 ms on one 4096 x 4096 matrix and
# 3.9-4.5 ms on six, which beyond its bytes at the copy's speed is 0.31 ms per hook call and 0.48
# ms per matrix (GPU_CALL_US, GPU_TENSOR_US; one 1024 x 1024 matrix took 1.25 ms, more than this
# prices). The same fixed costs serve every GPU preset: launch- and host-bound work follows the
# host and the driver, not the GPU's bandwidth, and no other GPU was measured. Measured on the
# hook of 532ad50 (~16 launches per matrix); today's runs four kernels per bucket whatever its
# matrices, so GPU_TENSOR_US overprices it until bench_gpu measures it.
GPU_LAUNCH_US, GPU_CALL_US, GPU_TENSOR_US = 5.0, 313.0, 484.0


def _gpu(name: str, datasheet_gbps: float, peak_tflops: float, node_link: str) -> Device:
    return Device(name, 0.85 * datasheet_gbps, peak_tflops, GPU_LAUNCH_US, node_link, call_us=GPU_CALL_US,
                  tensor_us=GPU_TENSOR_US, kernel_rates=H100_KERNEL_RATES)


DEVICES: dict[str, Device] = {device.name: device for device in (
    Device("cpu", 0.85 * 100.0, 1.0, 20.0, "pcie4"),  # one server socket, 8 DDR4-3200 channels
    _gpu("v100", 900.0, 125.0, "nvlink2"),      # V100 SXM2: HBM2 900 GB/s, fp16 tensor 125 TF
    _gpu("a100", 2039.0, 312.0, "nvlink3"),     # A100 80GB SXM: HBM2e 2039 GB/s, bf16 312 TF
    _gpu("l40s", 864.0, 362.0, "pcie4"),        # L40S: GDDR6 864 GB/s, bf16 dense 362 TF
    _gpu("h100", 3350.0, 989.0, "nvlink4"),     # H100 SXM: HBM3 3.35 TB/s, bf16 989 TF
    _gpu("h200", 4800.0, 989.0, "nvlink4"),     # H200 SXM: HBM3e 4.8 TB/s, bf16 989 TF
    _gpu("mi300x", 5300.0, 1307.0, "infinity-fabric"),  # MI300X: HBM3 5.3 TB/s, bf16 dense 1307 TF
)}


@dataclass(frozen=True)
class Node:
    """A server class: ``gpus`` devices joined by ``intra`` (a LINKS name), each with its own
    ``inter`` network link (one NIC per GPU, as in the NVIDIA DGX reference designs), or one NIC
    for every ``gpus_per_nic`` of them (each rank then gets the NIC's bandwidth / gpus_per_nic)."""

    name: str
    device: str
    gpus: int
    intra: str
    inter: str
    gpus_per_nic: int = 1


NODES: dict[str, Node] = {node.name: node for node in (
    Node("dgx1-v100", "v100", 8, "nvlink2", "ib-edr", 2),  # DGX-1 (V100): 4 x EDR 100 Gbit/s for 8 GPUs
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
