"""Projected GPU cost of every fused kernel, from the bytes it moves (no GPU needed).

The kernels are memory-bound, so their time on a GPU is close to (global-memory bytes) /
(memory bandwidth). Each operation runs once through the public API with GRADCOMP_BACKEND=triton
under the Triton interpreter, counting the bytes every kernel loads and stores (and the torch glue
around them), and once with GRADCOMP_BACKEND=torch as a chain of separate eager torch ops, each
counted as reading its operands and writing its results once (gradcomp.kernels.traffic). Bytes
per element are fitted as fixed + per-element bytes on N and 2N elements (top-k's threshold
sample, for one, does not grow with the gradient) and projected to a 100M-element fp32 gradient:

    time = bytes_per_element * 1e8 / bandwidth + launches * LAUNCH_US

on an A100-80GB (2.0 TB/s) and an H100-SXM (3.35 TB/s). The speedup is the torch chain's
projected time over the kernels'. Both are ideal-bandwidth projections: real kernels reach
~80-90% of peak, and the torch chain's count is a lower bound (a sort or a reduction can make
more than one pass), so the projected speedups are conservative.

    python benchmarks/bench_kernels.py [--n 2097152] [--json PATH] [--smoke]

Prints the table; writes JSON only with ``--json``. ``--smoke``: 4096 elements (seconds; checks the
script end to end: the byte counts are dominated by fixed costs at that size).
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run the kernels on the CPU
os.environ["GRADCOMP_CPU_COMPILE"] = "0"  # the torch path as separate eager ops
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 21,
                        help="elements measured per operation (and twice as many, for the fit)")
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--smoke", action="store_true", help="seconds: 4096 elements")
    return parser


if __name__ == "__main__":  # --help and argument errors answer before torch is imported
    build_parser().parse_args()

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import gradcomp  # noqa: E402
from gradcomp.kernels.traffic import count_bytes  # noqa: E402

GRADIENT = 100_000_000
GPUS = {"A100-80GB": 2.0e12, "H100-SXM": 3.35e12}
LAUNCH_US = 4.0
"""Per kernel / per torch op launch overhead assumed in the projection (microseconds)."""
WORLD = 4
"""Ranks whose payloads the decoders sum (what an all-gather hook hands them)."""

ENCODERS = [("fp16", {}), ("bf16", {}), ("int8", {}), ("int4", {}), ("sign", {}),
            ("topk", {"ratio": 0.01, "selector": "threshold"}), ("powersgd", {"rank": 4})]
DECODERS = [("fp16", {}), ("int8", {}), ("int4", {}), ("sign", {}), ("topk", {"ratio": 0.01})]


def gradient(n: int, seed: int, shape=None) -> torch.Tensor:
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return g.view(shape) if shape else g


def measure(setup, n: int, backend: str):
    """(n, bytes, launches, traffic) of one run of ``setup(backend)()`` on that backend."""
    os.environ["GRADCOMP_BACKEND"] = backend
    run = setup(backend)
    with count_bytes() as traffic:
        run()
    return n, traffic.total, len(traffic.launches) + len(traffic.torch_ops), traffic


def cases():
    """(label, n -> (setup, elements)) for every operation; PowerSGD gets a square matrix."""
    for name, options in ENCODERS:
        if name == "powersgd":
            def square(n, name=name, options=options):
                side = math.isqrt(n)
                return encoder(name, options, side * side, (side, side)), side * side
            yield f"{name} encode + EF", square
        else:
            yield f"{name} encode + EF", lambda n, name=name, options=options: (
                encoder(name, options, n, None), n)
    for name, options in DECODERS:
        yield f"{name} decode, sum of {WORLD} ranks", lambda n, name=name, options=options: (
            decoder(name, options, n), n)


def encoder(name: str, options: dict, n: int, shape):
    """Setup of an error-feedback step (after one warm-up step, so the residual is not zero)."""
    def setup(backend):
        ef = gradcomp.ErrorFeedback()
        ef.compress("g", gradient(n, 0, shape), name, **options)
        g = gradient(n, 1, shape)
        return lambda: ef.compress("g", g, name, **options)
    return setup


def decoder(name: str, options: dict, n: int):
    """Setup of the sum of WORLD ranks' decoded payloads (fp32): one kernel, or torch decodes
    and adds one rank after another."""
    def setup(backend):
        payloads = [gradcomp.compress(gradient(n, w), name, **options) for w in range(WORLD)]
        if backend == "triton":
            return kernel_decoder(name, payloads, n)

        def run():
            total = gradcomp.decompress(payloads[0]).float()
            for p in payloads[1:]:
                total += gradcomp.decompress(p).float()
            return total
        return run
    return setup


def kernel_decoder(name: str, payloads, n: int):
    from gradcomp.kernels import cast, quant, sign, topk
    method = gradcomp.get_method(name, **payloads[0].options)
    parts = {k: torch.stack([p.parts[k] for p in payloads]) for k in payloads[0].parts}
    if name in ("fp16", "bf16"):
        return lambda: cast.cast_decode_sum(parts["values"], method.scale)
    if name in ("int8", "int4"):
        return lambda: quant.dequantize_sum(parts["q"], parts["scales"], n, method.block)
    if name == "sign":
        return lambda: sign.sign_decode_sum(parts["bits"], parts["scales"], n, method.chunk)
    return lambda: topk.scatter_add_sum(parts["values"], parts["indices"], n)


def project(bytes_per_element: float, launches: int, bandwidth: float) -> float:
    """Projected milliseconds for a GRADIENT-element fp32 gradient."""
    return (bytes_per_element * GRADIENT / bandwidth + launches * LAUNCH_US * 1e-6) * 1e3


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args.n = 1 << 12
    rows, report = [], []
    for label, setup_at in cases():
        started = time.perf_counter()
        entry = {"operation": label}
        for backend in ("triton", "torch"):
            # bytes = fixed + per_element * n, fitted on n and 2n: fixed costs such as top-k's
            # threshold sample do not scale with the gradient and must not be projected as if
            # they did
            (n1, b1, l1, t1), (n2, b2, _, _) = (measure(*setup_at(n), backend)
                                                for n in (args.n, 2 * args.n))
            per_element = (b2 - b1) / (n2 - n1)
            fixed = b1 - per_element * n1
            entry[backend] = {"bytes_per_element": (fixed + per_element * GRADIENT) / GRADIENT,
                              "fixed_bytes": fixed, "launches": l1,
                              "kernels": [name for name, _ in t1.launches]}
        kernel, chain = entry["triton"], entry["torch"]
        for gpu, bandwidth in GPUS.items():
            fused = project(kernel["bytes_per_element"], kernel["launches"], bandwidth)
            slow = project(chain["bytes_per_element"], chain["launches"], bandwidth)
            entry[gpu] = {"kernel_ms": fused, "torch_ms": slow, "speedup": slow / fused,
                          "gradient_GBps": 4 * GRADIENT / (fused * 1e-3) / 1e9}
        report.append(entry)
        rows.append([label, f"{kernel['bytes_per_element']:.2f}", f"{chain['bytes_per_element']:.2f}",
                     kernel["launches"], chain["launches"], f"{entry['A100-80GB']['kernel_ms']:.3f}",
                     f"{entry['H100-SXM']['kernel_ms']:.3f}",
                     f"{entry['H100-SXM']['gradient_GBps']:.0f}",
                     f"{entry['A100-80GB']['speedup']:.1f}x", f"{entry['H100-SXM']['speedup']:.1f}x"])
        print(f"  measured {label} in {time.perf_counter() - started:.1f} s", flush=True)
    print(tabulate(rows, headers=["operation (100M fp32 elements)", "kernel B/elem", "torch B/elem",
                                  "launches", "torch ops", "A100 ms", "H100 ms",
                                  "H100 grad GB/s", "speedup A100", "speedup H100"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"gradient_elements": GRADIENT, "bandwidth_Bps": GPUS,
                                               "launch_us": LAUNCH_US, "world": WORLD, "n": args.n,
                                               "results": report}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
