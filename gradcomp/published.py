"""Published measurements of compressed against uncompressed training, and what the analyser
predicts for each as a user would ask it: ``gradcomp breakeven`` with the paper's model, world
size, measured compute time and measured network (docs/breakeven.md, "Against published
measurements"; ``python benchmarks/breakeven_validation.py --published`` prints the table,
tests/test_analysis_published.py recomputes it).

How each setting becomes a command:

- compute: the paper's own measured forward + backward and optimizer time per step
  (``--compute-ms``, ``--optimizer-ms``); DeepSpeed exchanges after backward (``--overlap-ms 0``);
- network: the paper's measured uncompressed step, through its all-reduce: the achieved
  bandwidth inside a node (``--intra-gbps``) at which the analyser's fp16 step equals the
  paper's one-node step, and between nodes (``--bandwidth-gbps``, per GPU: the node's NIC
  is shared by its 4 GPUs) at which it equals the paper's step on that many GPUs
  (:func:`fit_bandwidth`; the test checks each row's baseline reproduces the paper's step);
- baseline: fp16 (``--baseline fp16``): the papers train in mixed precision, their gradients
  already 16-bit; 1-bit Adam's compressed all-reduce is gradcomp's ``sign:twophase`` (1 bit per
  element with a scale per chunk, all-to-all then all-gather with error feedback on both sides).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

DEEPSPEED_BLOG = ("https://www.deepspeed.ai/2020/09/08/onebit-adam-blog-post.html (github.com/deepspeedai/"
                  "DeepSpeed docs/_posts/2020-09-09-onebit-adam-blog-post.md)")
ONEBIT_PAPER = "Tang et al., 1-bit Adam, ICML 2021, arXiv 2102.02888"
TABLE1 = ("Table 1 as transcribed at rajatbisht.net/paper_summaries/detailed_summary/0043_1Bit_Adam.html "
          "(not checked against the PDF)")

BYTEPS = ("https://github.com/bytedance/byteps/blob/master/docs/gradient-compression.md (BytePS's gradient "
          "compression design doc, section \"Exps\")")

BAGUA = ("https://tutorials.baguasys.com/benchmark/ (github.com/BaguaSys/tutorials src/benchmark/index.md and its "
         "figures; Bagua: Gan et al., VLDB 2022, arXiv 2107.01499)")
_BAGUA = ("--device", "v100", "--gpus-per-node", "8", "--latency-us", "25", "--methods", "hier:int8:twophase",
          "--world-size", "128")
_BAGUA_CLUSTER = ("128 V100s, 16 servers of 8 with NVLink, TCP between them; Bagua's ByteGrad (8-bit, hierarchical) "
                  "against {}")


def _bagua(key, figure, setting, published, how, compute_ms, baseline_ms, model, bandwidth, predicted):
    return Measurement(key, f"{BAGUA}, {figure}", setting, round(published, 3), how, baseline_ms,
                       ("--model", model, *_BAGUA, "--compute-ms", f"{compute_ms:.4g}", "--bandwidth-gbps", bandwidth),
                       compare="hier:int8:twophase", predicted=predicted,
                       note="compute: Bagua's asynchronous algorithm (no wait for the exchange) on the same run")


_VGG_STEP_MS = 32 * 128 / 28900 * 1e3  # 32 images per GPU at the asynchronous run's 28.9k images/s
_SQUAD_STEPS = 116  # SQuAD v1.1's ~88.6k features of 384 tokens, 6 per GPU on 128 GPUs


CGX = ("https://pytorch-cgx.github.io/benchmarks (github.com/pytorch-cgx/pytorch-cgx.github.io benchmarks.md and "
       "its assets/images; CGX: Markov et al., arXiv 2111.08617)")

_V100 = ("--model", "bert-large", "--device", "v100", "--gpus-per-node", "4", "--overlap-ms", "0",
         "--baseline", "fp16", "--methods", "sign:twophase")
_TCP = _V100 + ("--latency-us", "25", "--compute-ms", "96.5", "--optimizer-ms", "75.6")
_IB = _V100 + ("--latency-us", "5", "--compute-ms", "96.5", "--optimizer-ms", "63.5")
_SQUAD = _V100 + ("--latency-us", "25", "--compute-ms", "82.4", "--optimizer-ms", "75.6")
_E2E = _V100 + ("--latency-us", "25", "--compute-ms", "381.5", "--optimizer-ms", "74.9", "--optimizers", "zeroone",
                "--run-steps", "1000", "--optimizer-set", "zeroone.warmup_steps=150",
                "--optimizer-set", "zeroone.warmup_method=fp16", "--optimizer-set", "zeroone.warmup_scheme=allreduce")


@dataclass(frozen=True)
class Measurement:
    """One published measurement and the analyser's prediction of it.

    published: the speedup the source reports (compressed over uncompressed, step time or
        throughput), None where no number could be verified; ``how``: where it is, and how read.
    baseline_ms: the source's uncompressed step (ms) the network was fitted to (None: not fitted).
    argv: ``gradcomp breakeven`` arguments that predict it (empty: setting not matched).
    compare: the row whose speedup is the prediction (a method label, or ``optimizer:NAME``).
    predicted: the prediction as recorded (tests/test_analysis_published.py recomputes it).
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

    @property
    def ratio(self) -> float | None:
        """Published / predicted (> 1: the analyser under-predicts the speedup)."""
        if self.published is None or self.predicted is None:
            return None
        return self.published / self.predicted


def _figure(key, figure, setting, gpus, adam, onebit, per_gpu_batch, base, intra=None, bandwidth=None,
            predicted=None, stated=None, note=""):
    how = (f"{figure}: {onebit} / {adam} samples/s read from the figure (+-5%)"
           + (f"; the text states {stated}" if stated else ""))
    argv = base + ("--world-size", str(gpus))
    if intra is not None:
        argv += ("--intra-gbps", intra)
    if bandwidth is not None:
        argv += ("--bandwidth-gbps", bandwidth)
    return Measurement(key, f"{DEEPSPEED_BLOG}, {figure}", setting, round(onebit / adam, 3), how,
                       gpus * per_gpu_batch / adam * 1e3, argv, predicted=predicted, note=note)


_PRETRAIN_TCP = "BERT-Large pre-training, seq 128, 16 per GPU, V100s 4 per node, 40 Gbit/s Ethernet (TCP)"
_PRETRAIN_IB = "BERT-Large pre-training, seq 128, 16 per GPU, V100s 4 per node, 40 Gbit/s InfiniBand QDR"
_SQUAD_TCP = "BERT-Large SQuAD fine-tuning, 3 per GPU, V100s 4 per node, 40 Gbit/s Ethernet (TCP)"
_ONE_NODE = ("inside one node: the blog's implementation (2020, MPI, host-staged on Ethernet systems) "
             "paid 120-190 ms per step for its compressed exchange at 2-4 GPUs; the analyser prices "
             "gradcomp's kernels and NCCL")

def _cgx(key, figure, setting, gpus, single, nccl, cgx, unit, per_gpu, batch_note, model, intra, predicted):
    """A CGX weak-scaling bar chart: throughput of one GPU (``single``, the "Ideal" bar at 1 GPU), of
    NCCL and of CGX at ``gpus`` GPUs of one server. Compute: ``per_gpu`` items a step at one GPU's
    throughput; the uncompressed step: that compute times the ideal / NCCL throughput."""
    compute_ms = per_gpu / single * 1e3
    argv = ("--model", model, "--device", "l40s", "--gpus-per-node", str(gpus), "--methods", "int4:twophase",
            "--set", "int4.block=1024", "--compute-ms", f"{compute_ms:.4g}", "--world-size", str(gpus),
            "--intra-gbps", intra)
    how = (f"{figure}: {unit} of one GPU {single}, at {gpus} GPUs NCCL {nccl} and CGX {cgx}, read from the "
           f"figure (+-5%); compute {per_gpu} {batch_note} a step at one GPU's rate ({compute_ms:.4g} ms: the "
           f"batch is assumed; at 2x it (ResNet-50) or 4x (BERT) the prediction moves by 2% or less), the "
           f"uncompressed step that times {single * gpus} / {nccl}; the bandwidth inside the server fitted to it")
    return Measurement(key, f"{CGX}, {figure}", setting, round(cgx / nccl, 3), how,
                       compute_ms * single * gpus / nccl, argv, compare="int4:twophase", predicted=predicted,
                       note="CGX's 4-bit all-reduce is gradcomp's int4:twophase at block 1024; the L40S preset stands "
                            "in for the RTX 3090's kernels (864 against 936 GB/s)")


_CGX_SERVER = ("8 RTX 3090s in one server with low-bandwidth inter-GPU communication (Genesis Cloud), CGX 4-bit "
               "quantization with buckets of 1024, weak scaling against NCCL")

MEASUREMENTS: tuple[Measurement, ...] = (
    _figure("1bit-adam-tcp-2", "Figure 5", _PRETRAIN_TCP, 2, 93, 88, 16, _TCP, intra="31.3", predicted=1.787,
            note=_ONE_NODE),
    _figure("1bit-adam-tcp-4", "Figure 5", _PRETRAIN_TCP, 4, 140, 185, 16, _TCP, intra="28.3", predicted=2.341,
            note=_ONE_NODE),
    _figure("1bit-adam-tcp-8", "Figure 5", _PRETRAIN_TCP, 8, 45, 245, 16, _TCP, "28.3", "0.502", 4.688),
    _figure("1bit-adam-tcp-16", "Figure 5", _PRETRAIN_TCP, 16, 88, 450, 16, _TCP, "28.3", "0.736", 4.692),
    _figure("1bit-adam-tcp-32", "Figure 5", _PRETRAIN_TCP, 32, 130, 870, 16, _TCP, "28.3", "0.625", 4.965,
            stated="up to 6.6x higher throughput during the compression phase"),
    _figure("1bit-adam-ib-2", "Figure 6", _PRETRAIN_IB, 2, 110, 115, 16, _IB, intra="41.1", predicted=1.625,
            note=_ONE_NODE),
    _figure("1bit-adam-ib-4", "Figure 6", _PRETRAIN_IB, 4, 150, 185, 16, _IB, intra="30.3", predicted=2.34,
            note=_ONE_NODE),
    _figure("1bit-adam-ib-8", "Figure 6", _PRETRAIN_IB, 8, 290, 420, 16, _IB, "30.3", "4.79", 2.106),
    _figure("1bit-adam-ib-16", "Figure 6", _PRETRAIN_IB, 16, 545, 915, 16, _IB, "30.3", "6.54", 2.196),
    _figure("1bit-adam-ib-32", "Figure 6", _PRETRAIN_IB, 32, 850, 1710, 16, _IB, "30.3", "5.35", 2.552,
            stated="up to 2x higher throughput"),
    _figure("1bit-adam-squad-tcp-32", "Figure 7", _SQUAD_TCP, 32, 27, 170, 3, _SQUAD, "29.8", "0.693", 4.941,
            stated="up to 6.2x higher throughput (during the compression stage)"),
    Measurement(
        "1bit-adam-e2e-64", f"{ONEBIT_PAPER}: abstract (3.3x); compute and all-reduce: {TABLE1}",
        "BERT-Large pre-training end to end, batch 4096 (16 per GPU x 4 accumulation steps), 64 V100s 4 per "
        "node, 40 Gbit/s Ethernet; 1-bit Adam with a 15% fp16 warm-up against Adam",
        3.3, "abstract: \"up to 3.3x higher throughput for BERT-Large pre-training\" (174.3 h against 51.5 h "
        "as one summary transcribes it: 3.38x); Table 1: forward 137.80 ms, all-reduce 2259.36 ms, backward "
        "243.72 ms, step 74.92 ms (4 accumulation steps); one node: all-reduce 239.76 ms",
        137.80 + 2259.36 + 243.72 + 74.92,
        _E2E + ("--world-size", "64", "--intra-gbps", "33.7", "--bandwidth-gbps", "1.12"),
        compare="optimizer:zeroone", predicted=2.462,
        note="warm-up 15% of the steps (the blog: \"the warmup stage to be just 15% of the end-to-end training "
             "time\"); the compression stage alone is predicted at 3.26x"),
    Measurement(
        "byteps-cifar100-onebit-32", f"{BYTEPS}: CIFAR100, End-to-End Training, its table",
        "ResNet18_v2 on CIFAR100, 200 epochs, 4 AWS p3.16xlarge (8 V100s each, NVLink), 25 Gbit/s network; "
        "BytePS: fp16 NCCL reduce inside the node, onebit (sign, error feedback) between nodes through its "
        "servers, against uncompressed fp32",
        round(703.15 / 629.42, 3), "table: baseline 703.15 s, onebit 629.42 s (1.117x); topk and randomk with k = 1 "
        "(one element per tensor: BytePS's topk.cc reads k >= 1 as a count) 507.91 and 502.00 s. Steps: 200 epochs "
        "of 50,000 images at 32 per GPU (the example script's default batch, assumed) on 32 GPUs: 49 x 200 = 9800; "
        "compute: the k = 1 runs, which send almost nothing, 505.0 s / 9800 = 51.5 ms a step (forward, backward, "
        "optimizer; overlap as DDP's); network: fitted to the baseline's 71.75 ms",
        703.15 / 9800 * 1e3,
        ("--model", "resnet18-cifar", "--device", "v100", "--gpus-per-node", "8", "--intra-link", "nvlink2",
         "--latency-us", "25", "--methods", "hier:sign:twophase", "--compute-ms", "51.5", "--world-size", "32",
         "--bandwidth-gbps", "1.3"),
        compare="hier:sign:twophase", predicted=1.331,
        note="BytePS compresses and sums onebit payloads on its CPU servers; the analyser prices gradcomp's GPU "
             "kernels and NCCL for the same bytes"),
    *(_cgx(f"cgx-resnet50-{g}", "RN50_comparison.png", f"ResNet-50 on ImageNet, {_CGX_SERVER}", g, 390, n, c,
           "images/s", 64, "images (64 per GPU)", "resnet50", intra, predicted)
      for g, n, c, intra, predicted in ((2, 680, 750, "6.13", 1.112), (4, 1350, 1500, "9.11", 1.121),
                                        (8, 2520, 3000, "9.67", 1.198))),
    *(_cgx(f"cgx-bert-large-{g}", "BERT_comparison.png", f"BERT-Large on SQuAD, {_CGX_SERVER}", g, 6500, n, c,
           "tokens/s", 8 * 384, "tokens (8 sequences of 384 per GPU)", "bert-large", intra, predicted)
      for g, n, c, intra, predicted in ((2, 5800, 10900, "12", 2.101), (4, 10500, 20400, "16", 2.326),
                                        (8, 17000, 38500, "14.6", 2.863))),
    *(_bagua(f"bagua-vgg16-{name}", "e2e_vgg16_128.png", f"VGG-16 on ImageNet, 32 images per GPU, {name} "
             f"between servers, {_BAGUA_CLUSTER.format('Bagua (AllReduce)')}", bytegrad / allreduce,
             f"the bar chart: Bagua (AllReduce) {allreduce}, ByteGrad {bytegrad}, Asynchronous 28900 images/s, read "
             f"from the figure (+-3%); compute: the asynchronous run, {_VGG_STEP_MS:.1f} ms a step",
             _VGG_STEP_MS, 32 * 128 / allreduce * 1e3, "vgg16", bandwidth, predicted)
      for name, allreduce, bytegrad, bandwidth, predicted in (("100gbps", 12300, 21800, "3.69", 1.757),
                                                               ("10gbps", 4500, 19700, "1.21", 2.965))),
    *(_bagua(f"bagua-bert-large-{gbps}gbps", "tradeoff_network_bert-large-bandwidth.png",
             f"BERT-Large fine-tuning on SQuAD, 6 sequences per GPU, {gbps} Gbit/s between servers, "
             f"{_BAGUA_CLUSTER.format('PyTorch-DDP')}", ddp / bytegrad,
             f"epoch seconds against bandwidth: PyTorch-DDP {ddp}, ByteGrad {bytegrad}, Async 60, read from the "
             f"figure (+-5%, +-10% at 16 Gbit/s; 100 Gbit/s from its inset); {_SQUAD_STEPS} steps an epoch",
             60 / _SQUAD_STEPS * 1e3, ddp / _SQUAD_STEPS * 1e3, "bert-large", bandwidth, predicted)
      for gbps, ddp, bytegrad, bandwidth, predicted in ((1, 2600, 700, "0.113", 3.808), (4, 650, 175, "0.465", 3.472),
                                                        (16, 150, 85, "2.32", 1.832), (100, 125, 86, "2.89", 1.6))),
    Measurement(
        "byteps-cifar100-onebit-100mbps", f"{BYTEPS}: CIFAR100, Slow Network, its table",
        "as byteps-cifar100-onebit-32 with the network limited to 100 Mbit/s", round(518.32 / 195.24, 3),
        "table: baseline 518.32 s, onebit 195.24 s (2.65x), topk 83.93 s, randomk 89.67 s; not matched: the run's "
        "step count is not stated, and at the 25 Gbit/s run's 51.5 ms of compute a step its k = 1 runs would be "
        "1,700 steps, which puts the baseline's 45 MB gradient exchange at 256 ms a step, impossible at 100 Mbit/s",
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
        "not matched: no batch size or compute time stated, no VGG-16 preset",
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


def _scenario_and_choices(argv):
    from .cli import _scenario_from_args, build_parser, parse_choices, parse_options

    args = build_parser().parse_args(["breakeven", *argv])
    return args, _scenario_from_args(args), parse_choices(args.methods, parse_options(args.set))


def predict(measurement: Measurement) -> tuple[float, float]:
    """(predicted speedup, the analyser's baseline step in ms) of ``measurement``'s command, as
    ``gradcomp breakeven`` computes them (without the crossover searches)."""
    from .cli import parse_options
    from .analysis.breakeven import estimate
    from .analysis.costmodel import Choice, simulate
    from .analysis.optim import estimate_optimizer

    args, scenario, choices = _scenario_and_choices(measurement.argv)
    baseline = Choice.parse(args.baseline)
    baseline_ms = simulate(scenario, baseline).step_s * 1e3
    if measurement.compare.startswith("optimizer:"):
        name = measurement.compare.partition(":")[2]
        options = parse_options(args.optimizer_set).get(name, {})
        return estimate_optimizer(scenario, name, args.run_steps, baseline=baseline, **options).speedup, baseline_ms
    records = estimate(scenario, choices, crossovers=False, baseline=baseline)
    return next(r.speedup for r in records if r.method == measurement.compare), baseline_ms


def fit_bandwidth(measurement: Measurement, flag: str = "--bandwidth-gbps") -> float:
    """The value of ``flag`` (an achieved bandwidth in ``argv``) at which the analyser's baseline
    step equals the source's (bisection in log space)."""
    from .analysis.costmodel import Choice, simulate

    argv = list(measurement.argv)
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


def summary(measurements=MEASUREMENTS, nodes: int = 1) -> dict:
    """Verdict agreement and the ratios' median (published / predicted) and median factor
    (exp of the median |log ratio|: how far off a typical row is, either way), over the rows
    with a prediction on more than ``nodes - 1`` of their nodes (``nodes=2``: across nodes)."""
    def flag(m, name):
        return int(next(m.argv[i + 1] for i, a in enumerate(m.argv) if a == name))

    rated = [m for m in measurements
             if m.ratio is not None and flag(m, "--world-size") > flag(m, "--gpus-per-node") * (nodes - 1)]
    ratios = [m.ratio for m in rated]
    return {"rows": len(rated), "verdicts_agree": sum(verdict(m.published) == verdict(m.predicted) for m in rated),
            "median_ratio": statistics.median(ratios),
            "median_factor": math.exp(statistics.median(abs(math.log(r)) for r in ratios)),
            "within_1_25": sum(1 / 1.25 <= r <= 1.25 for r in ratios)}


def table(measurements=MEASUREMENTS) -> str:
    """The published table as Markdown (docs/breakeven.md)."""
    lines = ["| setting | published | predicted | published / predicted | verdicts (published, predicted) |",
             "| --- | --- | --- | --- | --- |"]
    for m in measurements:
        published = "not verified" if m.published is None else f"{m.published:.2f}x"
        predicted = "not matched" if m.predicted is None else f"{m.predicted:.2f}x"
        ratio = "-" if m.ratio is None else f"{m.ratio:.2f}"
        agree = "-" if m.ratio is None else (
            f"{verdict(m.published)}, {verdict(m.predicted)}"
            + ("" if verdict(m.published) == verdict(m.predicted) else " **(disagree)**"))
        gpus = next((m.argv[i + 1] for i, a in enumerate(m.argv) if a == "--world-size"), "")
        name = f"`{m.key}`" + (f" ({gpus} GPUs)" if gpus else "")
        lines.append(f"| {name} | {published} | {predicted} | {ratio} | {agree} |")
    lines.append("")
    for nodes, which in ((1, "rows with a prediction"), (2, "rows across nodes")):
        s = summary(measurements, nodes)
        lines.append(f"- {s['rows']} {which}: verdicts agree in {s['verdicts_agree']}; median published / "
                     f"predicted {s['median_ratio']:.2f}; median factor either way {s['median_factor']:.2f}x; "
                     f"{s['within_1_25']} within 1.25x.")
    return "\n".join(lines)


def commands(measurements=MEASUREMENTS) -> str:
    """Each row's ``gradcomp breakeven`` command."""
    return "\n".join(f"gradcomp breakeven {' '.join(m.argv)}  # {m.key}" for m in measurements if m.argv)
