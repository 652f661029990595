"""GPU benchmark of the Triton kernels against plain torch: one command, about 6-8 minutes on an H100.

    python benchmarks/bench_gpu.py [--sizes 1M,16M,100M] [--methods sign,topk] [--no-cold-start] [--json PATH]
    python benchmarks/bench_gpu.py --smoke    # 1M only, 3 runs each, no cold start: seconds
    python benchmarks/bench_gpu.py --profile 'sign/decode-sum p=64/100000000'   # under ncu
    python benchmarks/bench_gpu.py --compare BEFORE.json AFTER.json             # no GPU needed

For fp16, bf16, int8, int4, sign, the top-k threshold pass and PowerSGD rank 4, at 1M, 16M and
100M fp32 elements: compress + error feedback, and the decode-sum of p = 2, 8, 64 payloads (p
distinct payloads, each compressed from its own random tensor, as an all-gather delivers them).
Each time is the median of REPS runs timed with CUDA events, L2 flushed between runs by writing
FLUSH_BYTES; beside it the host time of the call (launches and dispatch, no sync: a row whose host
time nears its kernel time is bound by the host, not the GPU). Bytes are the kernels' declared
global-memory bytes (``kernels/*_bytes``); GB/s and the fraction of a device-to-device copy's
bandwidth measured in the same run follow from them.
Beside each kernel: the same operation on the GRADCOMP_BACKEND=torch path (plain eager torch),
torch.topk for top-k. PowerSGD is timed as a whole DDP comm hook (gradcomp.hooks.powersgd_hook) on a
bucket of 4096 x 4096 matrices, like for like with torch's powerSGD_hook on a 1-rank NCCL group:
both compress with error feedback, all-reduce every P and every Q (one collective each) and decode
P Q^T into the bucket; once more on
a GPT-2-small block's four matrices of three shapes (7.1M elements). Cold start:
the first calls of each hook's kernels in a fresh process with an empty TRITON_CACHE_DIR (compile +
autotune). Then the targets, as pass/fail ratios.

Prints the tables; with ``--json PATH`` the JSON is rewritten after every measured row, so a late
failure loses nothing measured before it; each target names its row, which ``--profile`` runs warm
once between cudaProfilerStart/Stop for `ncu --profile-from-start off` (benchmarks/gpu_call.sh
profiles every row below its target). ``--compare`` prints two runs' shared rows side by side
(the same script on an older commit's kernels gives the "before"). Without CUDA it exits with status 2 and says so
(``--smoke`` prints the declared bytes per element first, which need no GPU, and exits with 0).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--sizes", default="1M,16M,100M", help="comma-separated of 1M, 16M, 100M")
    parser.add_argument("--methods", help="comma-separated methods to measure (default: every method)")
    parser.add_argument("--no-cold-start", action="store_true")
    parser.add_argument("--first-calls", metavar="METHOD", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the results as JSON to this path (rewritten after every row)")
    parser.add_argument("--smoke", action="store_true", help="seconds: 1M only, 3 runs each, no cold start")
    parser.add_argument("--profile", metavar="METHOD/OPERATION/N",
                        help="run one row's kernels once between cudaProfilerStart and Stop, after a "
                             "warm-up, for `ncu --profile-from-start off` (e.g. 'sign/decode-sum p=64/100000000')")
    parser.add_argument("--below-target", metavar="JSON",
                        help="print the --profile spec of each row of a run below its target, worst first")
    parser.add_argument("--kernel-times", metavar="SPEC;SPEC",
                        help="per-kernel CUDA times (torch.profiler, no counter permissions needed) of "
                             "each row METHOD/OPERATION/N, ';'-separated, run warm 10 times")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="print the rows two JSON files share side by side (no GPU needed)")
    return parser


if __name__ == "__main__":  # --help and argument errors answer before torch is imported
    build_parser().parse_args()

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import gradcomp  # noqa: E402
from gradcomp.kernels import cast, declared, powersgd, quant, sign, topk  # noqa: E402
from gradcomp.methods.base import forced_backend  # noqa: E402
from gradcomp.payload import Payload  # noqa: E402

DEVICE = "cuda"
SIZES = {"1M": 1 << 20, "16M": 1 << 24, "100M": 100_000_000}
WORLDS = (2, 8, 64)
METHODS = tuple(gradcomp.METHODS)
"""Every registered method (the kernel-backed ones: gradcomp.kernels.FAMILIES)."""
ELEMENTWISE = ("fp16", "bf16", "int8", "int4", "sign")
"""The methods held to the copy-bandwidth target: a subset by intent, the streaming encoders
(top-k selects, PowerSGD multiplies matrices)."""
REPS = 20
WARMUP = 3
FLUSH_BYTES = 256 * 2**20
BLOCK, CHUNK, RATIO, RANK = 256, 1024, 0.01, 4
"""int8/int4 block, sign chunk, top-k density, PowerSGD rank: the methods' defaults."""
SIDE = 4096
"""PowerSGD matrices are SIDE x SIDE (1024 x 1024 at 1M): 100M is a bucket of six of them."""
GPT2_BLOCK = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]
"""The weight matrices of one GPT-2-small transformer block (c_attn, attn.c_proj, mlp.c_fc,
mlp.c_proj, [in, out]): 7.1M elements of three shapes, about one 25 MB DDP bucket."""
GPT2_OP = "hook gpt2-small block"
TARGETS = {"copy_fraction": 0.85, "powersgd_vs_torch_hook": 0.5, "topk_copy_fraction": 0.8,
           "topk_decode_p64_copy_fraction": 0.5, "cold_start_s": 30.0}


@dataclass
class Row:
    """One timed operation: the kernel path and its plain-torch counterpart (ms, medians)."""

    method: str
    op: str
    n: int
    kernel_ms: float
    declared_bytes: int
    baseline: str
    baseline_ms: float | None
    host_ms: float | None = None
    """Host time of one kernel-path call (Timer.host_ms)."""

    def gbps(self) -> float:
        return self.declared_bytes / self.kernel_ms / 1e6

    def copy_fraction(self, copy_gbps: float) -> float:
        return self.gbps() / copy_gbps


# ---- byte accounting (no GPU needed) -----------------------------------------------------------

def powersgd_shapes(n: int) -> list[tuple[int, int]]:
    """The matrices a PowerSGD bucket of about n elements holds: 1024 x 1024 at 1M, else
    n / SIDE^2 (rounded, at least one) SIDE x SIDE matrices."""
    side = 1024 if n <= 1 << 20 else SIDE
    return [(side, side)] * max(1, round(n / side**2))


def declared_bytes(method: str, op: str, n: int, world: int = 1) -> int:
    """Declared global-memory bytes of one benchmarked operation on n fp32 elements: ``op`` is
    "encode" (compress + error feedback), "decode" (sum of ``world`` payloads into fp32) or, for
    PowerSGD, "hook" (encode, then P Q^T decoded into the bucket; the 1-rank all-reduces are not
    counted)."""
    encode = op == "encode"
    if method in ("fp16", "bf16"):
        return declared.ef_cast_bytes(n, 4, True) if encode else declared.cast_decode_sum_bytes(n, world, 4)
    if method in ("int8", "int4"):
        levels = 127 if method == "int8" else 7
        return (declared.ef_quantize_bytes(n, BLOCK, levels, 4, True) if encode
                else declared.dequantize_sum_bytes(n, BLOCK, levels, world, 4))
    if method == "sign":
        return (declared.ef_sign_bytes(n, CHUNK, 4, True) if encode
                else declared.sign_decode_sum_bytes(n, CHUNK, world, 4))
    if method == "topk":  # the method's own account (the baseline's package has its own)
        compress, decode = method_of("topk").declared_bytes((n,), world)
        return compress if encode else decode
    if method == "powersgd" and op in ("encode", "hook"):
        return powersgd_bytes(powersgd_shapes(n), decode=op == "hook")
    raise ValueError(f"no declared bytes for {method} {op}")


def powersgd_bytes(shapes: list[tuple[int, int]], decode: bool = True) -> int:
    """Declared bytes of PowerSGD's compress + error feedback of fp32 matrices of ``shapes``
    and, with ``decode``, of P Q^T decoded into them (the residual update writes it: 4 B per
    element; its reads of P and Q are in the power step's)."""
    config = powersgd.MATMUL_CONFIGS[0].kwargs
    step = sum(declared.power_step_bytes(rows, cols, RANK, 4, True, config["BLOCK_N"], config["BLOCK_M"])
               for rows, cols in shapes)
    return step + (sum(4 * rows * cols for rows, cols in shapes) if decode else 0)


# ---- tables and targets (no GPU needed) --------------------------------------------------------

def table(rows: list[Row], copy_gbps: float) -> str:
    body = [[r.method, r.op, f"{r.n / 1e6:.1f}M", f"{r.kernel_ms:.3f}", f"{r.declared_bytes / 1e6:.1f}",
             f"{r.gbps():.0f}", f"{100 * r.copy_fraction(copy_gbps):.0f}%",
             "" if r.host_ms is None else f"{r.host_ms:.3f}", r.baseline,
             "" if r.baseline_ms is None else f"{r.baseline_ms:.3f}",
             "" if r.baseline_ms is None else f"{r.baseline_ms / r.kernel_ms:.1f}x"] for r in rows]
    return tabulate(body, headers=["method", "operation", "n", "kernel ms", "declared MB", "GB/s",
                                   "of copy", "host ms", "plain torch", "torch ms", "speedup"])


def targets(rows: list[Row], copy_gbps: float, cold: dict[str, float]) -> list[dict]:
    """The targets: measured value, requirement, ratio (>= 1 passes), pass, and the row measured
    (method, op, n; None for cold starts): ``--profile`` takes it."""
    largest = {}
    for r in rows:
        largest[r.method] = max(largest.get(r.method, 0), r.n)
    out = []

    def add(name, measured, required, ratio, row=None):
        out.append({"target": name, "measured": measured, "required": required, "ratio": ratio,
                    "pass": ratio >= 1.0,
                    "row": None if row is None else {"method": row.method, "op": row.op, "n": row.n}})

    def fraction_target(name, r, need):
        fraction = r.copy_fraction(copy_gbps)
        add(name, fraction, f">= {need}", fraction / need, r)

    need = TARGETS["copy_fraction"]
    for r in rows:
        if r.method in ELEMENTWISE and r.n == largest[r.method]:
            fraction_target(f"{r.method} {r.op} at {r.n / 1e6:.0f}M: of copy bandwidth", r, need)
    for r in rows:
        if r.n != largest[r.method] and r.op != GPT2_OP:
            continue
        if r.method == "int8" and r.op == "decode-sum p=8":
            fraction_target("int8 decode-sum of 8 payloads: of copy bandwidth", r, need)
        if r.method == "topk" and r.op == "compress+EF":
            fraction_target(f"top-k 1% compress+EF at {r.n / 1e6:.0f}M: of copy bandwidth", r,
                            TARGETS["topk_copy_fraction"])
        if r.method == "topk" and r.op == "decode-sum p=64":
            fraction_target(f"top-k decode-sum p=64 at {r.n / 1e6:.0f}M: of copy bandwidth", r,
                            TARGETS["topk_decode_p64_copy_fraction"])
        if r.method == "powersgd" and r.baseline_ms:
            share = r.kernel_ms / r.baseline_ms
            limit = TARGETS["powersgd_vs_torch_hook"]
            bucket = "a GPT-2-small block" if r.op == GPT2_OP else f"{r.n / 1e6:.0f}M of {SIDE}^2"
            add(f"PowerSGD rank 4 hook / torch powerSGD_hook, {bucket} (both whole hook)", share,
                f"<= {limit}", limit / share, r)
    for method, seconds in cold.items():
        limit = TARGETS["cold_start_s"]
        add(f"{method} hook kernels, cold start (s)", seconds, f"< {limit}", limit / max(seconds, 1e-9))
    return out


def targets_table(results: list[dict]) -> str:
    body = [[t["target"], f"{t['measured']:.3g}", t["required"], f"{t['ratio']:.2f}",
             "pass" if t["pass"] else "FAIL"] for t in results]
    return tabulate(body, headers=["target", "measured", "required", "ratio", ""])


# ---- timing ------------------------------------------------------------------------------------

class Timer:
    """Median milliseconds of ``fn`` over ``reps`` runs (after WARMUP), CUDA events, L2 flushed;
    ``host_ms``: the median host time of the last ``fn``'s calls, from entry to return without a
    sync (launches and torch's dispatch). Near the event time, the row is bound by the host."""

    def __init__(self, reps: int = REPS):
        self.reps = reps
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
        self.host_ms = None

    def __call__(self, fn) -> float:
        for _ in range(WARMUP):
            fn()
        times, host = [], []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            called = time.perf_counter()
            fn()
            host.append(1e3 * (time.perf_counter() - called))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        self.host_ms = statistics.median(host)
        return statistics.median(times)


def method_of(name: str):
    options = {"int8": {"block": BLOCK}, "int4": {"block": BLOCK}, "sign": {"chunk": CHUNK},
               "topk": {"ratio": RATIO, "selector": "threshold"}, "powersgd": {"rank": RANK}}
    return gradcomp.get_method(name, **options.get(name, {}))


def encode_kernel(name: str, x: torch.Tensor, residual: torch.Tensor):
    """A callable running the kernels of ``name``'s compress + error feedback on x."""
    if name in ("fp16", "bf16"):
        wire = torch.float16 if name == "fp16" else torch.bfloat16
        return lambda: cast.ef_cast(x, residual, 1.0, wire)
    if name in ("int8", "int4"):
        return lambda: quant.ef_quantize(x, residual, BLOCK, 127 if name == "int8" else 7)
    if name == "sign":
        return lambda: sign.ef_sign(x, residual, CHUNK)
    if name == "topk":  # the whole method: sampled threshold, candidate pass, selection, gather
        method = method_of("topk")
        return lambda: method.compress(x, residual)
    raise ValueError(name)


def stacked_payloads(name: str, n: int, world: int, device=DEVICE) -> Payload:
    """``world`` payloads of ``name`` stacked as rows [world, ...], as an all-gather delivers them;
    row i is compressed (torch path) from its own n random elements (seed i), so the rows are
    distinct payloads: a decode-sum reads different data per row, and top-k's rows scatter to
    different indices (copies of one row would measure atomic contention on the same addresses).
    Filled row by row into preallocated parts: peak memory is the stack plus one payload."""
    method = method_of(name)
    generator = torch.Generator(device=device)
    parts, first = None, None
    with forced_backend("torch"):
        for row in range(world):
            payload = method.compress(torch.randn(n, generator=generator.manual_seed(row), device=device))
            if parts is None:
                first = payload
                parts = {k: torch.empty((world, *v.shape), dtype=v.dtype, device=device)
                         for k, v in payload.parts.items()}
            for k, v in payload.parts.items():
                if v.shape != parts[k].shape[1:]:
                    raise ValueError(f"{name}: payload part {k!r} of row {row} has shape {list(v.shape)}, "
                                     f"row 0's {list(parts[k].shape[1:])}: rows must share one layout")
                parts[k][row].copy_(v)
    return Payload(first.method, first.shape, first.dtype, parts, dict(first.options), world)


def decode_kernel(name: str, stacked: Payload, n: int, out: torch.Tensor | None = None):
    """A callable running ``name``'s decode-sum kernel over the stacked payloads."""
    stacked = stacked.parts
    if name in ("fp16", "bf16"):
        return lambda: cast.cast_decode_sum(stacked["values"], 1.0, out=out)
    if name in ("int8", "int4"):
        return lambda: quant.dequantize_sum(stacked["q"], stacked["scales"], n, BLOCK, out=out)
    if name == "sign":
        return lambda: sign.sign_decode_sum(stacked["bits"], stacked["scales"], n, CHUNK, out=out)
    if name == "topk":
        indices = stacked["indices"].int()
        return lambda: topk.scatter_add_sum(stacked["values"], indices, n, out=out)
    raise ValueError(name)


def bench_encode(name: str, n: int, timer: Timer) -> Row:
    method = method_of(name)
    x = torch.randn(n, device=DEVICE)
    residual, torch_residual = torch.zeros_like(x), torch.zeros_like(x)
    kernel_ms = timer(encode_kernel(name, x, residual))
    host_ms = timer.host_ms
    if name == "topk":
        baseline, baseline_fn = "torch.topk", lambda: torch.topk((x + torch_residual).abs(), method.k(n))
    else:
        baseline = "eager method"

        def baseline_fn():
            with forced_backend("torch"):
                method.compress(x, torch_residual)
    return Row(name, "compress+EF", n, kernel_ms, declared_bytes(name, "encode", n), baseline,
               timer(baseline_fn), host_ms)


HOOK_LAYOUT = " hook-layout"
"""Suffix of a decode row timed on the payloads as a hook receives them (below)."""


def hook_layout_kernel(name: str, stacked: Payload, n: int, out: torch.Tensor):
    """The decode-sum as a hook runs it: the rows are one all-gathered uint8[p, nbytes] buffer in
    the wire layout (``Payload.flatten``: rows and parts 16-byte aligned), unflattened into part
    views and decoded; the unflatten is inside the timed call."""
    template, gathered = stacked.row(0), stacked.flatten()

    def run():
        received = template.unflatten(gathered)
        return decode_kernel(name, received, n, out)()
    return run


def bench_decode(name: str, n: int, world: int, timer: Timer, hook_layout: bool = False) -> Row:
    """The decode-sum kernel of ``world`` payloads against decompressing each on the torch path
    and adding them up; ``hook_layout``: the kernel on the payloads as a hook receives them."""
    method = method_of(name)
    stacked = stacked_payloads(name, n, world)
    if hook_layout:
        kernel_ms = timer(hook_layout_kernel(name, stacked, n, torch.empty(n, device=DEVICE)))
        return Row(name, f"decode-sum p={world}{HOOK_LAYOUT}", n, kernel_ms,
                   declared_bytes(name, "decode", n, world), "aligned rows", None, timer.host_ms)

    def eager():
        with forced_backend("torch"):
            total = method.decompress(stacked.row(0)).float()
            for row in range(1, world):
                total += method.decompress(stacked.row(row))

    kernel = decode_kernel(name, stacked, n, torch.empty(n, device=DEVICE))
    kernel_ms = timer(kernel)
    host_ms = timer.host_ms
    return Row(name, f"decode-sum p={world}", n, kernel_ms, declared_bytes(name, "decode", n, world),
               "eager method", timer(eager), host_ms)


class FakeBucket:
    """What torch's powerSGD_hook reads of a DDP GradBucket: one flat buffer and its matrices."""

    def __init__(self, buffer: torch.Tensor, shapes: list[tuple[int, int]]):
        self._buffer, self._grads, start = buffer, [], 0
        for rows, cols in shapes:
            self._grads.append(buffer[start:start + rows * cols].view(rows, cols))
            start += rows * cols

    def buffer(self):
        return self._buffer

    def index(self):
        return 0

    def is_last(self):
        return True

    def gradients(self):
        return self._grads

    def parameters(self):
        return self._grads


def powersgd_hooks(bucket: FakeBucket):
    """(ours, theirs): callables running one PowerSGD rank-RANK step over ``bucket`` on the
    default process group, each the whole DDP comm hook as a model registers it: gradcomp's
    powersgd_hook (compress with error feedback, one all-reduce of every P, one of every Q, P Q^T
    decoded into the bucket) and torch's powerSGD_hook (after its start_powerSGD_iter of plain
    all-reduces). Both write the decoded gradients into the bucket, as under DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    from gradcomp.hooks import PowerSGDState, powersgd_hook

    ours_state = PowerSGDState(process_group=None, matrix_rank=RANK)
    state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=RANK,
                                         start_powerSGD_iter=2, min_compression_rate=2)
    for _ in range(2):  # iterations before start_powerSGD_iter are plain all-reduces
        torch_powersgd.powerSGD_hook(state, bucket).wait()
    return (lambda: powersgd_hook(ours_state, bucket).wait(),
            lambda: torch_powersgd.powerSGD_hook(state, bucket).wait())


def powersgd_bucket(shapes: list[tuple[int, int]]) -> FakeBucket:
    return FakeBucket(torch.randn(sum(rows * cols for rows, cols in shapes), device=DEVICE), shapes)


def bench_powersgd(shapes: list[tuple[int, int]], op: str, timer: Timer) -> Row:
    """gradcomp's PowerSGD against torch's powerSGD_hook, rank 4, both as a whole hook over a
    bucket of matrices of ``shapes``."""
    bucket = powersgd_bucket(shapes)
    ours, theirs = powersgd_hooks(bucket)
    kernel_ms = timer(ours)
    host_ms = timer.host_ms
    return Row("powersgd", op, bucket.buffer().numel(), kernel_ms, powersgd_bytes(shapes),
               "torch powerSGD_hook", timer(theirs), host_ms)


def copy_bandwidth(timer: Timer, n: int) -> float:
    """GB/s of a device-to-device copy of n fp32 elements (bytes read + written)."""
    src, dst = torch.randn(n, device=DEVICE), torch.empty(n, device=DEVICE)
    return 8 * n / timer(lambda: dst.copy_(src)) / 1e6


# ---- cold start --------------------------------------------------------------------------------

def first_calls(name: str, n: int = SIZES["16M"]) -> float:
    """Seconds of the first compress + EF and the first decode-sum of 8 payloads of ``name``
    (compile + autotune: run this in a fresh process with an empty TRITON_CACHE_DIR)."""
    torch.zeros(1, device=DEVICE).add_(1)  # CUDA context and torch's own kernels, not counted
    torch.cuda.synchronize()
    x, residual = torch.randn(n, device=DEVICE), torch.zeros(n, device=DEVICE)
    if name == "powersgd":  # the decode is P Q^T with torch
        start = time.perf_counter()
        method_of(name).compress(x.view(-1, SIDE), residual.view(-1, SIDE), {})
        torch.cuda.synchronize()
        return time.perf_counter() - start
    stacked = stacked_payloads(name, n, 8)
    torch.cuda.synchronize()
    start = time.perf_counter()
    encode_kernel(name, x, residual)()
    decode_kernel(name, stacked, n)()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def cold_start(name: str) -> float:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        done = subprocess.run([sys.executable, __file__, "--first-calls", name], env=env,
                              capture_output=True, text=True, timeout=300, check=True)
    return float(done.stdout.strip().splitlines()[-1])


# ---- main --------------------------------------------------------------------------------------

def init_nccl() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))


class JsonReport:
    """The benchmark's JSON at ``path`` (None: not written), rewritten whole (to a temporary file,
    then renamed) after every change: rows land one by one as they are measured, so a failure
    late in the run loses nothing measured before it."""

    def __init__(self, path: str | None, header: dict):
        self.path, self.data = path, {**header, "rows": []}
        self.save()

    def add_row(self, row: Row, copy_gbps: float) -> None:
        self.data["rows"].append({**asdict(row), "gbps": row.gbps(), "copy_fraction": row.copy_fraction(copy_gbps)})
        self.save()

    def update(self, **fields) -> None:
        self.data.update(fields)
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.data, indent=1))
        os.replace(partial, path)


def measured_rows(sizes: list[int], methods: list[str], timer: Timer):
    """Every benchmarked row of ``methods``, yielded as soon as it is measured; PowerSGD's
    GPT-2-small block once, after the sizes."""
    for n in sizes:
        for name in methods:
            if gradcomp.get_method(name).per_tensor:  # PowerSGD: timed as its hook
                yield bench_powersgd(powersgd_shapes(n), "hook", timer)
            else:
                yield bench_encode(name, n, timer)
                for world in WORLDS:
                    yield bench_decode(name, n, world, timer)
                if name in ELEMENTWISE:
                    yield bench_decode(name, n, WORLDS[-1], timer, hook_layout=True)
            torch.cuda.empty_cache()
    if "powersgd" in methods and max(sizes) > SIZES["1M"]:
        yield bench_powersgd(GPT2_BLOCK, GPT2_OP, timer)


def row_kernels(method: str, op: str, n: int):
    """The kernel path of one benchmarked row as a callable (what ``--profile`` runs)."""
    if op.startswith("hook"):
        init_nccl()
        return powersgd_hooks(powersgd_bucket(GPT2_BLOCK if op == GPT2_OP else powersgd_shapes(n)))[0]
    if op == "compress+EF":
        x = torch.randn(n, device=DEVICE)
        return encode_kernel(method, x, torch.zeros_like(x))
    if op.startswith("decode-sum p="):
        world = int(op.removesuffix(HOOK_LAYOUT).split("=")[1])
        decode = hook_layout_kernel if op.endswith(HOOK_LAYOUT) else decode_kernel
        return decode(method, stacked_payloads(method, n, world), n, torch.empty(n, device=DEVICE))
    raise ValueError(f"--profile: no row {method}/{op}")


def parse_spec(spec: str) -> tuple[str, str, int]:
    """METHOD/OPERATION/N (a row's name in --profile, --kernel-times, --below-target)."""
    try:
        method, op, n = spec.split("/")
        n = int(n)
    except ValueError:
        raise SystemExit(f"expected a row as METHOD/OPERATION/N, got {spec!r}") from None
    if method not in METHODS:
        raise SystemExit(f"unknown method {method!r} in {spec!r}; choose from {', '.join(METHODS)}")
    return method, op, n


def profile(spec: str) -> None:
    """Run the row ``METHOD/OPERATION/N`` warm (compiled and autotuned), then once between
    cudaProfilerStart and cudaProfilerStop: `ncu --profile-from-start off` sees only that run."""
    run = row_kernels(*parse_spec(spec))
    for _ in range(WARMUP):
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def kernel_times(specs: str, runs: int = 10) -> str:
    """Each row's kernels' CUDA time per call (us, torch.profiler's device times), after a
    warm-up: the per-launch breakdown of a row, without the hardware counters ncu needs."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    out = []
    for spec in specs.split(";"):
        method, op, n = parse_spec(spec)
        run = row_kernels(method, op, n)
        for _ in range(WARMUP):
            run()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                run()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        events.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events) / runs
        body = [[e.key[:70], e.count // runs, f"{e.device_time_total / runs:.1f}"] for e in events[:12]]
        out.append(f"{spec}: {total:.1f} us of kernels a call\n"
                   + tabulate(body, headers=["kernel", "launches", "us a call"]))
    return "\n\n".join(out)


def below_target(path: str) -> list[str]:
    """``--profile`` specs (METHOD/OPERATION/N) of the rows of a benchmark JSON below their
    targets, worst first (targets recomputed from the rows: a run cut short has none saved)."""
    data = json.loads(Path(path).read_text())
    rows = [Row(**{f: r[f] for f in Row.__dataclass_fields__ if f in r}) for r in data["rows"]]
    failing = sorted((t for t in targets(rows, data["copy_gbps"], {}) if not t["pass"] and t["row"]),
                     key=lambda t: t["ratio"])
    specs = [f"{t['row']['method']}/{t['row']['op']}/{t['row']['n']}" for t in failing]
    return list(dict.fromkeys(specs))


def compare(before_path: str, after_path: str) -> str:
    """The rows two benchmark JSON files share, side by side: each file's time and fraction of its
    own run's copy bandwidth, and the speedup (before ms / after ms: meaningful on one card)."""
    before, after = (json.loads(Path(p).read_text()) for p in (before_path, after_path))

    def key(row: dict) -> tuple:
        return row["method"], row["op"], row["n"]

    earlier = {key(r): r for r in before["rows"]}
    body = [[r["method"], r["op"], f"{r['n'] / 1e6:.1f}M", f"{earlier[key(r)]['kernel_ms']:.3f}",
             f"{r['kernel_ms']:.3f}", f"{100 * earlier[key(r)]['copy_fraction']:.0f}%",
             f"{100 * r['copy_fraction']:.0f}%", f"{earlier[key(r)]['kernel_ms'] / r['kernel_ms']:.2f}x"]
            for r in after["rows"] if key(r) in earlier]
    cards = f"before: {before['device']}, after: {after['device']}"
    if before["device"] != after["device"]:
        cards += " (different cards: compare the copy fractions, not the times)"
    return cards + "\n" + tabulate(body, headers=["method", "operation", "n", "before ms", "after ms",
                                                  "before of copy", "after of copy", "speedup"],
                                  disable_numparse=True)


def bytes_table() -> str:
    """Declared bytes per element of every benchmarked operation at 100M elements (no GPU)."""
    n = SIZES["100M"]
    square = sum(rows * cols for rows, cols in powersgd_shapes(n))
    body = [[m, f"{declared_bytes(m, 'encode', n) / n:.2f}"]
            + [f"{declared_bytes(m, 'decode', n, w) / n:.2f}" for w in WORLDS] for m in METHODS
            if not gradcomp.get_method(m).per_tensor]
    body.append(["powersgd (hook)", f"{declared_bytes('powersgd', 'hook', square) / square:.2f}"] + [""] * len(WORLDS))
    return tabulate(body, headers=["method", "compress+EF B/elem"] + [f"decode-sum p={w} B/elem" for w in WORLDS])


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare:
        print(compare(*args.compare))
        return 0
    if args.below_target:
        print("\n".join(below_target(args.below_target)))
        return 0
    unknown = [key for key in args.sizes.split(",") if key not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {', '.join(SIZES)}")
    methods = args.methods.split(",") if args.methods else list(METHODS)
    unknown = [name for name in methods if name not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    if args.smoke:
        args.sizes, args.no_cold_start = "1M", True
        print(bytes_table())
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device found; this benchmark needs a GPU "
              "(benchmarks/bench_kernels.py projects GPU times without one)", file=sys.stderr)
        return 0 if args.smoke else 2
    if args.first_calls:
        print(first_calls(args.first_calls))
        return 0
    if args.profile:
        profile(args.profile)
        return 0
    if args.kernel_times:
        print(kernel_times(args.kernel_times))
        return 0
    import triton

    init_nccl()
    timer = Timer(reps=3 if args.smoke else REPS)
    sizes = [SIZES[key] for key in args.sizes.split(",")]
    copy_gbps = copy_bandwidth(timer, max(sizes))
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbps:.0f} GB/s")
    report = JsonReport(args.json, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
                                    "reps": timer.reps, "flush_bytes": FLUSH_BYTES, "copy_gbps": copy_gbps})
    rows = []
    for row in measured_rows(sizes, methods, timer):
        rows.append(row)
        report.add_row(row, copy_gbps)
        print(table([row], copy_gbps).splitlines()[-1], flush=True)
    cold = {}
    for name in () if args.no_cold_start else methods:
        cold[name] = cold_start(name)
        report.update(cold_start_s=cold)
    results = targets(rows, copy_gbps, cold)
    report.update(cold_start_s=cold, targets=results)
    print()
    print(table(rows, copy_gbps))
    print()
    print(targets_table(results))
    if args.json:
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
