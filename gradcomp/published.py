"""Published measurements of compressed against uncompressed training, and what the analyser
predicts for each as a user would run it (docs/breakeven.md, "Against published measurements";
``python benchmarks/breakeven_validation.py --published`` prints the tables,
tests/test_analysis_published.py recomputes them).

Every row is predicted twice, nothing fitted to the number being checked:

(a) ``argv``: from presets and the paper's stated hardware only: its model, world size, GPUs per
    node, the preset link of the class it names (its nominal bandwidth shared by the GPUs behind
    one NIC; each collective at the transport's typical achieved fraction), and the compute time
    the source measured or states apart from the speedup (``--compute-ms``, ``--optimizer-ms``);
(b) ``measured_argv``: the same with the link the source measured apart from the speedup, where it
    gives one (the 1-bit Adam paper's Table 1 all-reduce times, ``--allreduce-ms``); empty where it
    gives none.

``implied_argv`` keeps the link each source's own uncompressed step implies (fitted to it: the
baseline half of the speedup under test, so never used for the check); those links are the spread
of achieved fractions ``gradcomp.analysis.linkfit.PLAUSIBLE_FRACTIONS`` states.

1-bit Adam trains in mixed precision: baseline fp16 (``--baseline fp16``), its compressed all-reduce
gradcomp's ``sign:twophase``.

Another implementation's compressor cost: ``gradcomp breakeven`` takes it as a profile (``--profile``:
per-method compress and decompress costs, ``gradcomp.analysis.profile.MethodCost``), and a row would
give it one where its source states that cost apart from the speedup. None does: the 1-bit Adam
paper's Table 1 (as TABLE1 transcribes it) times Adam's step (forward, backward, the fp16 all-reduce, the optimizer), not the
compressed exchange; DeepSpeed's blog, BytePS's doc, Bagua's and CGX's benchmark pages give
throughput or epoch time only (CGX's paper, arXiv 2111.08617, could be read here no further than its
introduction); GRACE's released data (below, GRACE_DATA_VOLUME) state the bytes each worker sends,
used as an input, and no time of the compressor or of the exchange. So no row is given a measured
compressor cost.

Where the implementation's code says how it compresses, the row prices that instead of gradcomp's
kernels, from the code and the device preset alone (``--implementation``,
``gradcomp.analysis.implementations``, whose docstring states the rules): the 1-bit Adam rows,
DeepSpeed 0.3's ``Compressed_Allreduce`` (unfused torch and cupy ops on the flat fp32 momentum,
``deepspeed-2020:onebit``); the GRACE rows, GRACE's TensorFlow compressors op by op and tensor by tensor
(``grace-tf:NAME``, with ``:memory`` where the run had its memory on). BytePS's, Bagua's and CGX's rows
price gradcomp's kernels (their compressors are CUDA or C++ kernels whose costs were not read here).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

DEEPSPEED_BLOG = ("https://www.deepspeed.ai/2020/09/08/onebit-adam-blog-post.html (github.com/deepspeedai/"
                  "DeepSpeed docs/_posts/2020-09-09-onebit-adam-blog-post.md)")
ONEBIT_PAPER = "Tang et al., 1-bit Adam, ICML 2021, arXiv 2102.02888"
TABLE1 = ("Table 1 as transcribed at rajatbisht.net/paper_summaries/detailed_summary/0043_1Bit_Adam.html "
          "(not checked against the PDF)")

BYTEPS = ("https://github.com/bytedance/byteps/blob/master/docs/gradient-compression.md (BytePS's gradient "
          "compression design doc, section \"Exps\")")

BAGUA = ("https://tutorials.baguasys.com/benchmark/ (github.com/BaguaSys/tutorials src/benchmark/index.md and its "
         "figures; Bagua: Gan et al., VLDB 2022, arXiv 2107.01499)")
_BAGUA = ("--device", "v100", "--gpus-per-node", "8", "--methods", "hier:int8:twophase", "--world-size", "128")
_BAGUA_CLUSTER = ("128 V100s, 16 servers of 8 with NVLink, TCP between them; Bagua's ByteGrad (8-bit, hierarchical) "
                  "against {}")


def _per_gpu(gbps: float, gpus: int) -> str:
    """A node's NIC shared by its GPUs: each rank's nominal share, Gbit/s."""
    return f"{gbps / gpus:.4g}"


def _bagua(key, figure, setting, published, how, compute_ms, baseline_ms, model, server_gbps, implied, predicted):
    preset = "100gbe" if server_gbps >= 100 else "25gbe" if server_gbps > 10 else "10gbe"
    base = ("--model", model, *_BAGUA, "--compute-ms", f"{compute_ms:.4g}")
    return Measurement(key, f"{BAGUA}, {figure}", setting, round(published, 3), how, baseline_ms,
                       base + ("--link", preset, "--bandwidth-gbps", _per_gpu(server_gbps, 8)),
                       compare="hier:int8:twophase", predicted=predicted,
                       implied_argv=base + ("--latency-us", "25", "--bandwidth-gbps", implied),
                       note="compute: Bagua's asynchronous algorithm (no wait for the exchange) on the same run; "
                            f"link: {server_gbps} Gbit/s TCP per server of 8 ({preset}'s class)")


_VGG_STEP_MS = 32 * 128 / 28900 * 1e3  # 32 images per GPU at the asynchronous run's 28.9k images/s
_SQUAD_STEPS = 116  # SQuAD v1.1's ~88.6k features of 384 tokens, 6 per GPU on 128 GPUs


CGX = ("https://pytorch-cgx.github.io/benchmarks (github.com/pytorch-cgx/pytorch-cgx.github.io benchmarks.md and "
       "its assets/images; CGX: Markov et al., arXiv 2111.08617)")

_V100 = ("--model", "bert-large", "--device", "v100", "--gpus-per-node", "4", "--overlap-ms", "0",
         "--baseline", "fp16", "--methods", "sign:twophase", "--implementation", "deepspeed-2020:onebit")
_TCP = _V100 + ("--compute-ms", "96.5", "--optimizer-ms", "75.6")
_IB = _V100 + ("--compute-ms", "96.5", "--optimizer-ms", "63.5")
_SQUAD = _V100 + ("--compute-ms", "82.4", "--optimizer-ms", "75.6")
_E2E = _V100 + ("--compute-ms", "381.5", "--optimizer-ms", "74.9", "--optimizers", "zeroone",
                "--run-steps", "1000", "--optimizer-set", "zeroone.warmup_steps=150",
                "--optimizer-set", "zeroone.warmup_method=fp16", "--optimizer-set", "zeroone.warmup_scheme=allreduce")
# (a) the stated hardware: 4 V100s per node (PCIe assumed: the blog names no link inside the node), one
# 40 Gbit/s Ethernet or 40 Gbit/s InfiniBand QDR (32 of data) NIC per node, shared by its 4 GPUs
_ETH = ("--intra-link", "pcie3", "--link", "40gbe", "--bandwidth-gbps", _per_gpu(40, 4))
_QDR = ("--intra-link", "pcie3", "--link", "ib-qdr", "--bandwidth-gbps", _per_gpu(32, 4))
# (b) the link the 1-bit Adam paper's Table 1 measured on its 40 GbE cluster (4 V100s per node): BERT-Large's
# fp16 all-reduce in 239.76 ms inside one node and 2259.36 ms on 64 GPUs; the 64-GPU row gives it as measured
# (--allreduce-ms), the others take the achieved bandwidths it fits (TABLE1_LINK; the test fits them again)
TABLE1_ALLREDUCE = ("--intra-link", "pcie3", "--link", "40gbe", "--allreduce-ms", "intra=239.76,inter=2259.36")
TABLE1_LINK = {"intra": "33.55", "inter": "1.113"}
_TABLE1 = ("--intra-link", "pcie3", "--intra-gbps", TABLE1_LINK["intra"], "--bandwidth-gbps", TABLE1_LINK["inter"],
           "--latency-us", "25")


@dataclass(frozen=True)
class Measurement:
    """One published measurement and the analyser's predictions of it.

    published: the speedup the source reports (compressed over uncompressed, step time or
        throughput), None where no number could be verified; ``how``: where it is, and how read.
    baseline_ms: the source's uncompressed step (ms), when it gives one (the predicted baseline
        step is set beside it; nothing is fitted to it).
    argv: ``gradcomp breakeven`` arguments of prediction (a): presets and the stated hardware only
        (empty: setting not matched).
    measured_argv: prediction (b), with the link the source measured apart from the speedup
        (empty: it gives none).
    compare: the row whose speedup is the prediction (a method label, or ``optimizer:NAME``).
    predicted, predicted_measured: (a) and (b) as recorded (tests/test_analysis_published.py
        recomputes them).
    implied_argv: the link the source's own uncompressed step implies (fitted to it; not a prediction).
    """

    key: str
    source: str
    setting: str
    published: float | None
    how: str
    baseline_ms: float | None = None
    argv: tuple[str, ...] = ()
    compare: str = "sign:twophase"
    predicted: float | None = None
    note: str = ""
    measured_argv: tuple[str, ...] = ()
    predicted_measured: float | None = None
    implied_argv: tuple[str, ...] = ()

    @property
    def ratio(self) -> float | None:
        """Published / predicted (a) (> 1: the analyser under-predicts the speedup)."""
        if self.published is None or self.predicted is None:
            return None
        return self.published / self.predicted

    @property
    def ratio_measured(self) -> float | None:
        """Published / predicted (b)."""
        if self.published is None or self.predicted_measured is None:
            return None
        return self.published / self.predicted_measured


def _figure(key, figure, setting, gpus, adam, onebit, per_gpu_batch, base, link, predicted=None,
            measured=None, implied=(), stated=None, note=""):
    how = (f"{figure}: {onebit} / {adam} samples/s read from the figure (+-5%)"
           + (f"; the text states {stated}" if stated else ""))
    argv = base + ("--world-size", str(gpus))
    return Measurement(key, f"{DEEPSPEED_BLOG}, {figure}", setting, round(onebit / adam, 3), how,
                       gpus * per_gpu_batch / adam * 1e3, argv + link, predicted=predicted, note=note,
                       measured_argv=argv + _TABLE1 if link is _ETH else (), predicted_measured=measured,
                       implied_argv=argv + ("--latency-us", "25" if link is _ETH else "5") + implied)


def _implied(intra, inter=None):
    return ("--intra-gbps", intra) + (("--bandwidth-gbps", inter) if inter else ())


_PRETRAIN_TCP = "BERT-Large pre-training, seq 128, 16 per GPU, V100s 4 per node, 40 Gbit/s Ethernet (TCP)"
_PRETRAIN_IB = "BERT-Large pre-training, seq 128, 16 per GPU, V100s 4 per node, 40 Gbit/s InfiniBand QDR"
_SQUAD_TCP = "BERT-Large SQuAD fine-tuning, 3 per GPU, V100s 4 per node, 40 Gbit/s Ethernet (TCP)"
_ONE_NODE = ("inside one node (V100s over PCIe, assumed: the blog names no link); the compressed all-reduce "
             "priced as DeepSpeed 0.3's ops (--implementation deepspeed-2020:onebit)")


def _cgx(key, figure, setting, gpus, single, nccl, cgx, unit, per_gpu, batch_note, model, intra, predicted):
    """A CGX weak-scaling bar chart: throughput of one GPU (``single``, the "Ideal" bar at 1 GPU), of
    NCCL and of CGX at ``gpus`` GPUs of one server. Compute: ``per_gpu`` items a step at one GPU's
    throughput; the uncompressed step: that compute times the ideal / NCCL throughput."""
    compute_ms = per_gpu / single * 1e3
    argv = ("--model", model, "--device", "l40s", "--gpus-per-node", str(gpus), "--methods", "int4:twophase",
            "--set", "int4.block=1024", "--compute-ms", f"{compute_ms:.4g}", "--world-size", str(gpus))
    how = (f"{figure}: {unit} of one GPU {single}, at {gpus} GPUs NCCL {nccl} and CGX {cgx}, read from the "
           f"figure (+-5%); compute {per_gpu} {batch_note} a step at one GPU's rate ({compute_ms:.4g} ms: the "
           f"batch is assumed; at 2x it (ResNet-50) or 4x (BERT) the prediction moves by 2% or less), the "
           f"uncompressed step that times {single * gpus} / {nccl}")
    return Measurement(key, f"{CGX}, {figure}", setting, round(cgx / nccl, 3), how,
                       compute_ms * single * gpus / nccl, argv + ("--intra-link", "pcie4"), compare="int4:twophase",
                       predicted=predicted, implied_argv=argv + ("--intra-gbps", intra),
                       note="CGX's 4-bit all-reduce is gradcomp's int4:twophase at block 1024; the L40S preset stands "
                            "in for the RTX 3090's kernels (864 against 936 GB/s); link: PCIe 4.0 (the RTX 3090's; "
                            "the page says only \"low-bandwidth inter-GPU communication\")")


_CGX_SERVER = ("8 RTX 3090s in one server with low-bandwidth inter-GPU communication (Genesis Cloud), CGX 4-bit "
               "quantization with buckets of 1024, weak scaling against NCCL")

GRACE = ("https://github.com/sands-lab/grace-data GRACE_data_release.pickle (the measurements the GRACE authors "
         "released with Xu et al., \"GRACE: A Compressed Communication Framework for Distributed Machine Learning\", "
         "ICDCS 2021; report hdl.handle.net/10754/662495), frame imagenet-classification, mode throughput, column "
         "total_images_per_sec")
# The data's columns state the hardware: gpu_type v100, env mcnodes, bw 10g / 25g, workers 1-8. One GPU per server:
# the GRACE benchmarks' launch script (github.com/sands-lab/grace-benchmarks TF_scripts.sh) runs
# `mpirun -np 2 -H server1_ip:1,server2_ip:1` with NCCL_IB_DISABLE=1 and `-mca btl ^openib` (TCP). Compute: the
# uncompressed run on 1 worker (id 1ipvrhj50: 365.93 images/s, no exchange) at 64 images a step, tf_cnn_benchmarks'
# default batch for resnet50 (models/resnet_model.py default_batch_sizes; assumed: the data does not record the batch).
_GRACE_ONE_GPU_IMG_S = 365.934702
_GRACE_BATCH = 64
_GRACE_COMPUTE_MS = _GRACE_BATCH / _GRACE_ONE_GPU_IMG_S * 1e3
# What GRACE's data state apart from the speedup, per method, besides the 1-worker run (docs/breakeven.md,
# "Against published measurements", GRACE):
# - the bytes each worker sends a step: mode data-volume, column data_volume (pull_from_wandb.py sums the sizes of
#   the tensors its debug log prints each step), runs of their own (8 workers, 25g, memory false): an input.
#   GRACE's signSGD sends one byte per sign (grace_dl/tensorflow/compressor/signsgd.py: tf.math.greater_equal, a
#   tf.bool tensor), as many bytes as its 8-bit quantization: priced as gradcomp's int8:allgather, the scheme that
#   sends those bytes (gradcomp's sign:allgather packs 8 signs a byte: 3.29 MB, 1/7.8 of GRACE's). The PowerSGD
#   run's 54.7 MB (kmdmxgmz0, 8 workers, 10g) is not matched: GRACE's TensorFlow PowerSGD reshapes a conv kernel
#   [kh, kw, in, out] to [kh, kw * in * out] (grace_dl/tensorflow/compressor/powersgd.py) and all-reduces P and Q
#   inside compress, so which tensors the debug log counts is not known here;
# - no compress or decompress time, no communication time, no breakdown of the step. The runs of mode upper-bound
#   (the wandb tag "upper-bound"; pull_from_wandb.py names the mode and nothing else, the paper, the only place it
#   could be defined, could not be read here) are recorded in each row's note (GRACE_UPPER_BOUND) and used nowhere:
#   if the mode is the run without the compressor's cost, as its values suggest (signSGD's 1% under its
#   throughput run, top-k 1% 1.41x it; the uncompressed VGG-19's within 0.5%), the compressor's cost a step is the
#   row's compressed step minus that run's, which contains the compressed run under test: fitted to the row's own
#   speedup, not an input.
GRACE_DATA_VOLUME = {"topk": ("mdeupuys0", 2044264), "signsgd": ("b6higck20", 25559081), "8bit": ("s7r1gdp20", 25559725)}
"""Bytes each worker sends a step in GRACE's data-volume runs (run id, bytes): 8 workers, 25g, memory false."""
GRACE_UPPER_BOUND = {
    "grace-resnet50-topk-8-10g": ("3si0d57q0", 1726.133076), "grace-resnet50-signsgd-8-10g": ("arkcbmv00", 1319.757090),
    "grace-resnet50-8bit-8-10g": ("cq3aie1r0", 1248.305805), "grace-resnet50-powersgd-8-10g": ("ju07wpj10", 1743.210512),
    "grace-resnet50-topk-2-10g": ("gw1lr8pu0", 633.182000), "grace-resnet50-powersgd-2-10g": ("dq813ygm0", 587.042746),
    "grace-resnet50-topk-8-25g": ("nxczc9hr0", 1851.511429)}
"""Each GRACE row's run of mode upper-bound at the same method, memory, workers and bw (run id, images/s);
recorded, never used (above); the NCCL row has none."""
_GRACE_METHODS = {"topk": ("topk", ("--set", "topk.ratio=0.01")), "signsgd": ("int8:allgather", ()),
                  "8bit": ("int8:allgather", ()), "powersgd": ("powersgd", ("--set", "powersgd.rank=1"))}
_GRACE_COMPRESSOR = {"topk": "topk", "signsgd": "signsgd", "8bit": "u8bit", "powersgd": "powersgd"}
"""GRACE's TensorFlow compressor behind each row (``--implementation grace-tf:NAME``, with ``:memory`` where the
run had its memory on): gradcomp.analysis.implementations prices its ops from GRACE's code."""
_GRACE_HOW = {"topk": "top-k 1% (all-gather of values and indices)",
              "signsgd": "signSGD (all-gather of signs, a byte each: priced as int8:allgather, the same bytes)",
              "8bit": "8-bit quantization (all-gather)", "powersgd": "PowerSGD rank 1 (compress_rank's default; two "
              "all-reduces, P then Q)"}


def _grace(method, gpus, gbps, backend, run, ours, none, none_id, memory):
    """A GRACE row: ResNet-50 on ImageNet, ``gpus`` servers of one V100 each at ``gbps`` Gbit/s (TCP); the
    compressed run's and the uncompressed run's total_images_per_sec in the same frame (``ours``, ``none``)."""
    label, options = _GRACE_METHODS[method]
    ub = GRACE_UPPER_BOUND.get(f"grace-resnet50-{method}-{gpus}-{gbps}g" + ("-nccl" if backend == "nccl" else ""))
    link = {10: "10gbe", 25: "25gbe"}[gbps]
    implementation = f"grace-tf:{_GRACE_COMPRESSOR[method]}" + (":memory" if memory == "true" else "")
    argv = ("--model", "resnet50", "--device", "v100", "--gpus-per-node", "1", "--link", link, "--methods", label,
            *options, "--implementation", implementation, "--compute-ms", f"{_GRACE_COMPUTE_MS:.4g}",
            "--world-size", str(gpus))
    comm = "allreduce" if method == "powersgd" else "allgather"
    how = (f"the pickle's rows: {method} (id {run}, memory {memory}, comm {comm}, backend {backend}) {ours} images/s against none (id {none_id}, backend {backend}) {none} images/s, "
           f"{gpus} workers, bw {gbps}g, v100; compute {_GRACE_COMPUTE_MS:.4g} ms: {_GRACE_BATCH} images at the "
           f"1-worker run's {_GRACE_ONE_GPU_IMG_S:.2f} images/s (batch assumed, see _GRACE_BATCH)")
    return Measurement(f"grace-resnet50-{method}-{gpus}-{gbps}g" + ("-nccl" if backend == "nccl" else ""), GRACE,
                       f"ResNet-50 on ImageNet (TensorFlow tf_cnn_benchmarks, Horovod {backend.upper()}), {gpus} "
                       f"servers of one V100, {gbps} Gbit/s TCP; GRACE's {_GRACE_HOW[method]} against the "
                       "uncompressed all-reduce", round(ours / none, 3), how, _GRACE_BATCH * gpus / none * 1e3,
                       argv, compare=label,
                       note="GRACE runs its compressors in TensorFlow graph ops and its all-gathers through Horovod "
                            "(MPI over TCP unless -nccl); the analyser prices those ops from GRACE's code "
                            f"(--implementation {implementation}) and its collectives for the same bytes" + (f" (GRACE's data-volume run {GRACE_DATA_VOLUME[method][0]}: "
                                            f"{GRACE_DATA_VOLUME[method][1]:,} bytes a worker a step)"
                                            if method in GRACE_DATA_VOLUME else "")
                            + "; the data state no compress, decompress or communication time"
                            + (f" (upper-bound run {ub[0]}: {ub[1]:.1f} images/s, recorded, not used: its meaning is "
                               "not stated in the released files)" if ub else ""))


_ROWS: tuple[Measurement, ...] = (
    _figure("1bit-adam-tcp-2", "Figure 5", _PRETRAIN_TCP, 2, 93, 88, 16, _TCP, _ETH, None, None, _implied("31.3"),
            note=_ONE_NODE),
    _figure("1bit-adam-tcp-4", "Figure 5", _PRETRAIN_TCP, 4, 140, 185, 16, _TCP, _ETH, None, None,
            _implied("28.3"), note=_ONE_NODE),
    _figure("1bit-adam-tcp-8", "Figure 5", _PRETRAIN_TCP, 8, 45, 245, 16, _TCP, _ETH, None, None,
            _implied("28.3", "0.502")),
    _figure("1bit-adam-tcp-16", "Figure 5", _PRETRAIN_TCP, 16, 88, 450, 16, _TCP, _ETH, None, None,
            _implied("28.3", "0.736")),
    _figure("1bit-adam-tcp-32", "Figure 5", _PRETRAIN_TCP, 32, 130, 870, 16, _TCP, _ETH, None, None,
            _implied("28.3", "0.625"), stated="up to 6.6x higher throughput during the compression phase"),
    _figure("1bit-adam-ib-2", "Figure 6", _PRETRAIN_IB, 2, 110, 115, 16, _IB, _QDR, None, implied=_implied("41.1"),
            note=_ONE_NODE),
    _figure("1bit-adam-ib-4", "Figure 6", _PRETRAIN_IB, 4, 150, 185, 16, _IB, _QDR, None, implied=_implied("30.3"),
            note=_ONE_NODE),
    _figure("1bit-adam-ib-8", "Figure 6", _PRETRAIN_IB, 8, 290, 420, 16, _IB, _QDR, None,
            implied=_implied("30.3", "4.79")),
    _figure("1bit-adam-ib-16", "Figure 6", _PRETRAIN_IB, 16, 545, 915, 16, _IB, _QDR, None,
            implied=_implied("30.3", "6.54")),
    _figure("1bit-adam-ib-32", "Figure 6", _PRETRAIN_IB, 32, 850, 1710, 16, _IB, _QDR, None,
            implied=_implied("30.3", "5.35"), stated="up to 2x higher throughput"),
    _figure("1bit-adam-squad-tcp-32", "Figure 7", _SQUAD_TCP, 32, 27, 170, 3, _SQUAD, _ETH, None, None,
            _implied("29.8", "0.693"), stated="up to 6.2x higher throughput (during the compression stage)"),
    Measurement(
        "1bit-adam-e2e-64", f"{ONEBIT_PAPER}: abstract (3.3x); compute and all-reduce: {TABLE1}",
        "BERT-Large pre-training end to end, batch 4096 (16 per GPU x 4 accumulation steps), 64 V100s 4 per "
        "node, 40 Gbit/s Ethernet; 1-bit Adam with a 15% fp16 warm-up against Adam",
        3.3, "abstract: \"up to 3.3x higher throughput for BERT-Large pre-training\" (174.3 h against 51.5 h "
        "as one summary transcribes it: 3.38x); Table 1: forward 137.80 ms, all-reduce 2259.36 ms, backward "
        "243.72 ms, step 74.92 ms (4 accumulation steps); one node: all-reduce 239.76 ms",
        137.80 + 2259.36 + 243.72 + 74.92, _E2E + ("--world-size", "64") + _ETH,
        compare="optimizer:zeroone", predicted=None,
        measured_argv=_E2E + ("--world-size", "64") + TABLE1_ALLREDUCE, predicted_measured=None,
        implied_argv=_E2E + ("--world-size", "64", "--latency-us", "25", "--intra-gbps", "33.7",
                             "--bandwidth-gbps", "1.12"),
        note="warm-up 15% of the steps (the blog: \"the warmup stage to be just 15% of the end-to-end training "
             "time\")"),
    Measurement(
        "byteps-cifar100-onebit-32", f"{BYTEPS}: CIFAR100, End-to-End Training, its table",
        "ResNet18_v2 on CIFAR100, 200 epochs, 4 AWS p3.16xlarge (8 V100s each, NVLink), 25 Gbit/s network; "
        "BytePS: fp16 NCCL reduce inside the node, onebit (sign, error feedback) between nodes through its "
        "servers, against uncompressed fp32",
        round(703.15 / 629.42, 3), "table: baseline 703.15 s, onebit 629.42 s (1.117x); topk with k = 1 and "
        "randomk with k = 8 (\"We set k = 1 for topk and k = 8 for randomk\": elements per tensor, so they send "
        "almost nothing) 507.91 and 502.00 s. Steps: 200 epochs of 50,000 images at 32 per GPU (the example "
        "script's default batch, assumed) on 32 GPUs: 49 x 200 = 9800; compute: the topk and randomk runs, "
        "505.0 s / 9800 = 51.5 ms a step (forward, backward, optimizer; overlap as DDP's)",
        703.15 / 9800 * 1e3,
        ("--model", "resnet18-cifar", "--device", "v100", "--gpus-per-node", "8", "--intra-link", "nvlink2",
         "--link", "25gbe", "--bandwidth-gbps", _per_gpu(25, 8), "--methods", "hier:sign:twophase",
         "--compute-ms", "51.5", "--world-size", "32"),
        compare="hier:sign:twophase", predicted=None,
        implied_argv=("--model", "resnet18-cifar", "--device", "v100", "--gpus-per-node", "8", "--intra-link",
                      "nvlink2", "--latency-us", "25", "--methods", "hier:sign:twophase", "--compute-ms", "51.5",
                      "--world-size", "32", "--bandwidth-gbps", "1.3"),
        note="BytePS compresses and sums onebit payloads on its CPU servers; the analyser prices gradcomp's GPU "
             "kernels and NCCL for the same bytes"),
    *(_cgx(f"cgx-resnet50-{g}", "RN50_comparison.png", f"ResNet-50 on ImageNet, {_CGX_SERVER}", g, 390, n, c,
           "images/s", 64, "images (64 per GPU)", "resnet50", intra, None)
      for g, n, c, intra in ((2, 680, 750, "6.13"), (4, 1350, 1500, "9.11"), (8, 2520, 3000, "9.67"))),
    *(_cgx(f"cgx-bert-large-{g}", "BERT_comparison.png", f"BERT-Large on SQuAD, {_CGX_SERVER}", g, 6500, n, c,
           "tokens/s", 8 * 384, "tokens (8 sequences of 384 per GPU)", "bert-large", intra, None)
      for g, n, c, intra in ((2, 5800, 10900, "12"), (4, 10500, 20400, "16"), (8, 17000, 38500, "14.6"))),
    *(_bagua(f"bagua-vgg16-{name}", "e2e_vgg16_128.png", f"VGG-16 on ImageNet, 32 images per GPU, {name} "
             f"between servers, {_BAGUA_CLUSTER.format('Bagua (AllReduce)')}", bytegrad / allreduce,
             f"the bar chart: Bagua (AllReduce) {allreduce}, ByteGrad {bytegrad}, Asynchronous 28900 images/s, read "
             f"from the figure (+-3%); compute: the asynchronous run, {_VGG_STEP_MS:.1f} ms a step",
             _VGG_STEP_MS, 32 * 128 / allreduce * 1e3, "vgg16", gbps, implied, None)
      for name, gbps, allreduce, bytegrad, implied in (("100gbps", 100, 12300, 21800, "3.69"),
                                                        ("10gbps", 10, 4500, 19700, "1.21"))),
    *(_bagua(f"bagua-bert-large-{gbps}gbps", "tradeoff_network_bert-large-bandwidth.png",
             f"BERT-Large fine-tuning on SQuAD, 6 sequences per GPU, {gbps} Gbit/s between servers, "
             f"{_BAGUA_CLUSTER.format('PyTorch-DDP')}", ddp / bytegrad,
             f"epoch seconds against bandwidth: PyTorch-DDP {ddp}, ByteGrad {bytegrad}, Async 60, read from the "
             f"figure (+-5%, +-10% at 16 Gbit/s; 100 Gbit/s from its inset); {_SQUAD_STEPS} steps an epoch",
             60 / _SQUAD_STEPS * 1e3, ddp / _SQUAD_STEPS * 1e3, "bert-large", gbps, implied, None)
      for gbps, ddp, bytegrad, implied in ((1, 2600, 700, "0.113"), (4, 650, 175, "0.465"), (16, 150, 85, "2.32"),
                                           (100, 125, 86, "2.89"))),
    # GRACE's released measurements (GRACE above): every row one compressed run against the uncompressed run of
    # the same frame, workers, bw and backend; none of the numbers enters the prediction except the 1-worker run
    # (method, workers, Gbit/s, backend, run id, its images/s, the uncompressed run's, that run's id, memory)
    _grace("topk", 8, 10, "mpi", "wtdimug80", 1220.956388, 1677.358549, "csptnxrv0", "false"),
    _grace("signsgd", 8, 10, "mpi", "zficj7k10", 1333.212933, 1677.358549, "csptnxrv0", "false"),
    _grace("8bit", 8, 10, "mpi", "ncq7ga8l0", 984.638421, 1677.358549, "csptnxrv0", "false"),
    _grace("powersgd", 8, 10, "mpi", "xa1kk3ne0", 1412.958539, 1677.358549, "csptnxrv0", "true"),
    _grace("topk", 2, 10, "mpi", "xzbtewu80", 368.746276, 582.286212, "ahct8xyh0", "true"),
    _grace("powersgd", 2, 10, "mpi", "i9y4pj4d0", 424.999164, 582.286212, "ahct8xyh0", "true"),
    _grace("powersgd", 8, 10, "nccl", "2sedjd6i0", 1610.462158, 2044.610839, "jprnbiz90", "true"),
    _grace("topk", 8, 25, "mpi", "qln67bbj0", 1147.690170, 1649.092544, "d93b4gh80", "false"),
    Measurement(
        "byteps-cifar100-onebit-100mbps", f"{BYTEPS}: CIFAR100, Slow Network, its table",
        "as byteps-cifar100-onebit-32 with the network limited to 100 Mbit/s", round(518.32 / 195.24, 3),
        "table: baseline 518.32 s, onebit 195.24 s (2.65x), topk 83.93 s, randomk 89.67 s; not matched: the run's "
        "step count is not stated, and at the 25 Gbit/s run's 51.5 ms of compute a step its topk and randomk runs "
        "would be 1,700 steps, which puts the baseline's 45 MB gradient exchange at 256 ms a step, impossible at 100 Mbit/s",
        note="setting not matched: no step count"),
    Measurement(
        "byteps-imagenet-resnet50-64", f"{BYTEPS}: IMAGENET, End-to-End Training, its table",
        "ResNet50_v2 on ImageNet, 8 AWS p3.16xlarge (64 V100s), 25 Gbit/s; dist-EF-SGDM (onebit) against SGDM",
        round(2.6506 / 2.4378, 3), "table: SGDM 2.6506 h, dist-EF-SGDM 2.4378 h (8.0% less); not matched: neither "
        "the epochs nor the batch size nor a compute time is stated",
        note="setting not matched: no step count or compute time"),
    Measurement(
        "byteps-imagenet-vgg16-32", f"{BYTEPS}: IMAGENET, End-to-End Training, the text",
        "VGG-16 on ImageNet, 100 epochs, 4 AWS p3.16xlarge (32 V100s), 25 Gbit/s; dist-EF-SGDM (onebit) against "
        "SGDM", round(1 / (1 - 0.3904), 3), "text: \"reduces the training time for 100 epochs by 39.04%\" (1.64x); "
        "not matched: no batch size or compute time stated",
        note="setting not matched: no compute time"),
    Measurement(
        "horovod-fp16-resnet50-32", "https://github.com/horovod/horovod/issues/578 (a Horovod maintainer's comment)",
        "ResNet-50, 32 workers on 4 nodes, Horovod with fp16 compression of the all-reduce against fp32",
        1.10, "\"we've generally seen around a 10% speedup (resnet50, 32 workers, 4 nodes)\"; not matched: the "
        "GPUs, network and compute time are not stated",
        note="setting not matched: no GPUs, link or compute time"),
    Measurement(
        "powersgd-resnet18", "Vogels et al., PowerSGD, NeurIPS 2019, arXiv 1905.13727 (epfml/powersgd)",
        "ResNet-18 on CIFAR-10, 16 GPUs, rank 2, against SGD with NCCL all-reduce",
        None, "23% less time per batch (1.30x), as a summary of the paper transcribes it; its table was "
        "not readable here, nor the GPUs, link and compute time of its cluster",
        note="setting not matched: no verified compute time or link"),
)


RECORDED: dict[str, tuple[float, float | None]] = {
    "1bit-adam-tcp-2": (0.827, 1.177),
    "1bit-adam-tcp-4": (0.977, 1.52),
    "1bit-adam-tcp-8": (1.553, 3.372),
    "1bit-adam-tcp-16": (1.922, 3.982),
    "1bit-adam-tcp-32": (2.09, 4.148),
    "1bit-adam-ib-2": (0.82, None),
    "1bit-adam-ib-4": (0.976, None),
    "1bit-adam-ib-8": (1.313, None),
    "1bit-adam-ib-16": (1.606, None),
    "1bit-adam-ib-32": (1.745, None),
    "1bit-adam-squad-tcp-32": (2.141, 4.23),
    "1bit-adam-e2e-64": (1.482, 2.344),
    "byteps-cifar100-onebit-32": (1.175, None),
    "cgx-resnet50-2": (0.995, None),
    "cgx-resnet50-4": (0.997, None),
    "cgx-resnet50-8": (0.998, None),
    "cgx-bert-large-2": (0.98, None),
    "cgx-bert-large-4": (0.99, None),
    "cgx-bert-large-8": (0.995, None),
    "bagua-vgg16-100gbps": (1.255, None),
    "bagua-vgg16-10gbps": (3.387, None),
    "bagua-bert-large-1gbps": (3.86, None),
    "bagua-bert-large-4gbps": (3.667, None),
    "bagua-bert-large-16gbps": (2.909, None),
    "bagua-bert-large-100gbps": (1.001, None),
    "grace-resnet50-topk-8-10g": (0.8, None),
    "grace-resnet50-signsgd-8-10g": (0.946, None),
    "grace-resnet50-8bit-8-10g": (0.907, None),
    "grace-resnet50-powersgd-8-10g": (1.113, None),
    "grace-resnet50-topk-2-10g": (0.53, None),
    "grace-resnet50-powersgd-2-10g": (0.979, None),
    "grace-resnet50-powersgd-8-10g-nccl": (1.113, None),
    "grace-resnet50-topk-8-25g": (0.432, None),
}
"""Each row's predictions as recorded, (a) and (b) (None: no measured link given); tests/test_analysis_published.py
recomputes them."""

MEASUREMENTS: tuple[Measurement, ...] = tuple(
    replace(m, predicted=RECORDED[m.key][0], predicted_measured=RECORDED[m.key][1]) if m.key in RECORDED else m
    for m in _ROWS)


def _scenario_and_choices(argv):
    from .cli import _scenario_from_args, build_parser, parse_choices, parse_options

    args = build_parser().parse_args(["breakeven", *argv])
    return args, _scenario_from_args(args), parse_choices(args.methods, parse_options(args.set))


PREDICTIONS = {"preset": "argv", "measured": "measured_argv", "implied": "implied_argv"}
"""Which argv a prediction runs: (a) ``preset``, (b) ``measured``, or the link the source's
uncompressed step implies (``implied``: fitted to it, for reference only)."""


def predict(measurement: Measurement, which: str = "preset") -> tuple[float, float]:
    """(predicted speedup, the analyser's baseline step in ms) of ``measurement``'s (a) ``preset``
    or (b) ``measured`` command, as ``gradcomp breakeven`` computes them (without the crossover
    searches)."""
    from .cli import parse_options
    from .analysis.breakeven import estimate
    from .analysis.costmodel import Choice, simulate
    from .analysis.optim import estimate_optimizer

    args, scenario, choices = _scenario_and_choices(getattr(measurement, PREDICTIONS[which]))
    baseline = Choice.parse(args.baseline)
    baseline_ms = simulate(scenario, baseline).step_s * 1e3
    if measurement.compare.startswith("optimizer:"):
        name = measurement.compare.partition(":")[2]
        options = parse_options(args.optimizer_set).get(name, {})
        return estimate_optimizer(scenario, name, args.run_steps, baseline=baseline, **options).speedup, baseline_ms
    records = estimate(scenario, choices, crossovers=False, baseline=baseline)
    return next(r.speedup for r in records if r.method == measurement.compare), baseline_ms


def fit_bandwidth(measurement: Measurement, flag: str = "--bandwidth-gbps") -> float:
    """The value of ``flag`` in ``implied_argv`` at which the analyser's baseline step equals the
    source's (bisection in log space): the link the source's own uncompressed step implies."""
    from .analysis.costmodel import Choice, simulate

    argv = list(measurement.implied_argv)
    at = argv.index(flag) + 1

    def step_ms(gbps):
        argv[at] = f"{gbps}"
        args, scenario, _ = _scenario_and_choices(argv)
        return simulate(scenario, Choice.parse(args.baseline)).step_s * 1e3

    lo, hi = 1e-3, 1e4
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if step_ms(mid) > measurement.baseline_ms else (lo, mid)
    return math.sqrt(lo * hi)


def verdict(speedup: float | None) -> str:
    from .analysis.breakeven import verdict_class

    return "-" if speedup is None else verdict_class(speedup)


OUTCOMES = ("pays", "marginal", "does not pay")


def _predicted(m: Measurement, which: str):
    return m.predicted if which == "preset" else m.predicted_measured


def summary(measurements=MEASUREMENTS, which: str = "preset") -> dict:
    """Over the rows with a published speedup and a (a) ``preset`` or (b) ``measured`` prediction:
    the confusion of verdicts (published outcome -> predicted outcome -> rows), the agreement per
    published outcome, the ratios' median (published / predicted) and median factor (exp of the
    median |log ratio|: how far off a typical row is, either way), and the rows within 1.25x."""
    rated = [m for m in measurements if m.published is not None and _predicted(m, which) is not None]
    confusion = {o: {p: 0 for p in OUTCOMES} for o in OUTCOMES}
    for m in rated:
        confusion[verdict(m.published)][verdict(_predicted(m, which))] += 1
    ratios = [m.published / _predicted(m, which) for m in rated]
    factors = [math.exp(abs(math.log(r))) for r in ratios]
    return {"rows": len(rated), "verdicts_agree": sum(confusion[o][o] for o in OUTCOMES),
            "confusion": confusion,
            "agree_by_outcome": {o: (confusion[o][o], sum(confusion[o].values())) for o in OUTCOMES},
            "median_ratio": statistics.median(ratios) if ratios else None,
            "median_factor": statistics.median(factors) if factors else None,
            "within_1_25": sum(f <= 1.25 for f in factors),
            "implementations": sorted({m.key.split("-")[0] for m in rated}),
            "by_implementation": {
                name: {"rows": len(own), "verdicts_agree": sum(verdict(m.published) == verdict(_predicted(m, which))
                                                               for m in own),
                       "median_factor": statistics.median(math.exp(abs(math.log(m.published / _predicted(m, which))))
                                                          for m in own)}
                for name in sorted({m.key.split("-")[0] for m in rated})
                for own in [[m for m in rated if m.key.split("-")[0] == name]]}}


def _confusion_lines(s: dict) -> list[str]:
    lines = ["| published \\ predicted | " + " | ".join(OUTCOMES) + " | agree |", "| --- | --- | --- | --- | --- |"]
    for o in OUTCOMES:
        agree, of = s["agree_by_outcome"][o]
        lines.append(f"| {o} | " + " | ".join(str(s["confusion"][o][p]) for p in OUTCOMES)
                     + f" | {agree} of {of} |")
    return lines


def table(measurements=MEASUREMENTS) -> str:
    """The published check as Markdown (docs/breakeven.md): each row's (a) and (b), then the
    confusion tables and the summaries."""
    lines = ["| setting | published | (a) presets | (b) measured link | published / (a) | published / (b) | "
             "baseline step: paper / (a) | verdicts (published; a; b) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in measurements:
        published = "not verified" if m.published is None else f"{m.published:.2f}x"
        a = "not matched" if m.predicted is None else f"{m.predicted:.2f}x"
        b = "-" if m.predicted_measured is None else f"{m.predicted_measured:.2f}x"
        ratio_a = "-" if m.ratio is None else f"{m.ratio:.2f}"
        ratio_b = "-" if m.ratio_measured is None else f"{m.ratio_measured:.2f}"
        base = ("-" if m.baseline_ms is None or m.predicted is None or not m.argv else
                f"{m.baseline_ms / predict_baseline_ms(m):.2f}")
        verdicts = "-" if m.ratio is None else "; ".join(
            [verdict(m.published), verdict(m.predicted) + ("" if verdict(m.predicted) == verdict(m.published)
                                                           else " **(disagree)**")]
            + ([verdict(m.predicted_measured) + ("" if verdict(m.predicted_measured) == verdict(m.published)
                                                 else " **(disagree)**")] if m.ratio_measured else []))
        gpus = next((m.argv[i + 1] for i, arg in enumerate(m.argv) if arg == "--world-size"), "")
        name = f"`{m.key}`" + (f" ({gpus} GPUs)" if gpus else "")
        lines.append(f"| {name} | {published} | {a} | {b} | {ratio_a} | {ratio_b} | {base} | {verdicts} |")
    for which, title in (("preset", "(a) presets and stated hardware"), ("measured", "(b) the measured link")):
        s = summary(measurements, which)
        lines += ["", f"{title}: {s['rows']} rows, verdicts agree in {s['verdicts_agree']}; median published / "
                      f"predicted {s['median_ratio']:.2f}; median factor either way {s['median_factor']:.2f}x; "
                      f"{s['within_1_25']} within 1.25x", ""] + _confusion_lines(s)
        lines += ["", "| implementation | rows | verdicts agree | median factor |", "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {own['rows']} | {own['verdicts_agree']} | {own['median_factor']:.2f}x |"
                  for name, own in s["by_implementation"].items()]
    return "\n".join(lines)


_BASELINE_MS: dict = {}


def predict_baseline_ms(m: Measurement) -> float:
    """The analyser's baseline step (ms) of prediction (a), computed once per row."""
    if m.key not in _BASELINE_MS:
        _BASELINE_MS[m.key] = predict(m)[1]
    return _BASELINE_MS[m.key]


def commands(measurements=MEASUREMENTS) -> str:
    """Each row's ``gradcomp breakeven`` commands: (a), and (b) where there is one."""
    out = []
    for m in measurements:
        if m.argv:
            out.append(f"gradcomp breakeven {' '.join(m.argv)}  # {m.key} (a)")
        if m.measured_argv:
            out.append(f"gradcomp breakeven {' '.join(m.measured_argv)}  # {m.key} (b)")
    return "\n".join(out)


POWERSGD_CUT = 0.54
"""PowerSGD's cut of ResNet-18's communication time on CIFAR-10 (16 GPUs, rank 2) as issue 50 quotes
Vogels et al. (NeurIPS 2019); the paper's cluster (GPUs, link, GPUs per node) could not be read here."""


def powersgd_cut_grid(links=("10gbe", "25gbe", "100gbe", "ib-edr"), gpus_per_node=(1, 2, 8),
                      devices=("v100", "a100")) -> list[dict]:
    """PowerSGD rank 2's cut of ResNet-18's (CIFAR) communication time at 16 GPUs, 1 - its network
    seconds per step / uncompressed SGD's, over plausible settings (presets; compute from FLOPs)."""
    from .analysis import Choice, make_scenario, simulate

    rows = []
    for link in links:
        for gpn in gpus_per_node:
            for device in devices:
                scenario = make_scenario("resnet18-cifar", 16, device, link, gpus_per_node=gpn)
                sgd, psgd = simulate(scenario, Choice("none")), simulate(scenario, Choice("powersgd", {"rank": 2}))
                rows.append({"link": link, "gpus_per_node": gpn, "device": device, "sgd_comm_ms": sgd.comm_s * 1e3,
                             "powersgd_comm_ms": psgd.comm_s * 1e3, "cut": 1 - psgd.comm_s / sgd.comm_s})
    return rows
