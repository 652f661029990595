"""Predict the device time of benchmarks/bench_gpu.py's rows (100M, or 16M) on an H100 or an H200
without a GPU: a roofline from the declared bytes and from the sm_90 SASS that Triton's bundled
ptxas produces, launch by launch.

    python benchmarks/roofline.py                          # the working tree's kernels on an H100
    python benchmarks/roofline.py --device H200            # ... on an H200
    python benchmarks/roofline.py --device H200 --commit d75eb4b   # that commit's kernels against its rows
    python benchmarks/roofline.py --commit 532ad50         # 532ad50's kernels against its H100 rows
    python benchmarks/roofline.py --blind                  # d75eb4b's own roofline against its H200 rows
    python benchmarks/roofline.py --smoke                  # seconds: three rows, 532ad50 validated
    ... [--size 16M|100M] [--results FILE...] [--json PATH] [--detail]

The model. A row's launches (:func:`rows` lists them) run one after another: the row's time is the
sum over its launches of each launch's largest floor plus LAUNCH_S, plus LAUNCH_S per torch op
(their bytes are in the declared total, their work is not modelled). A launch's floors:
- bytes: its share of the row's declared bytes (the family's ``*_bytes``, what bench_gpu reports),
  shared out by each launch's global loads and stores in its SASS, plus its scatter's L2 misses
  (``Launch.scatter``: MISS_BYTES a miss instead of 8), over the copy bandwidth measured beside
  the rows (``copy_gbps`` of the results JSON; the device's preset without one);
- pipes: SASS instructions per warp, each loop body times its trip count (the row says how many),
  times the warps of the busiest SM (ceil(programs / SMs) programs), per pipe over its rate; a
  scatter's 4-byte accesses (a load and a store each) at 32 / SCATTER_TAGS load/store wavefronts
  a warp instruction;
- latency: one warp's in-order path through the SASS (:func:`warp_cycles`: dependent steps add
  their latencies, independent loads overlap; the loads a row names L2-resident, and a scatter's
  loads while its tiles fit the L2, at the L2's latency), times the waves of resident blocks
  (registers and shared memory set how many fit an SM);
- atomics (``Launch.atomics``): lane atomics over ATOMIC_RATE, or the hottest address's share at
  ATOMIC_SERIAL_CYCLES each.
The devices (SMs, clock, L2, a preset copy bandwidth) are in DEVICES. Autotuning: every shipped
config of a kernel is predicted and the fastest taken, as autotune picks. A kernel whose name,
constexprs, aligned arguments or loop structure no longer matches its row raises (the rows must
follow the redesign), so nothing is silently mispredicted. ``FROZEN`` keeps the rows of a validated
commit whose launches differ from the working tree's. Validation: measured = the slower of the
runs; ``--blind`` reruns the roofline of BLIND's commit, unchanged, on its first GPU rows.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import importlib.util
import itertools
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# ---- the machines ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    """A GPU as the model sees it: SMs, max SM clock, L2 bytes, and a copy bandwidth (GB/s) used
    when no results file of the device gives a measured one (``copy_gbps`` of bench_gpu's JSON)."""

    name: str
    sms: int
    clock_hz: float
    l2_bytes: int
    copy_gbps: float
    results: str


DEVICES = {
    "H100": Device("H100 80GB HBM3 (SXM)", 132, 1.98e9, 50 * 2**20, 2952.0, "benchmarks/results/bench_gpu_h100_*.json"),
    "H200": Device("H200 (SXM)", 132, 1.98e9, 60 * 2**20, 4137.7, "benchmarks/results/bench_gpu_h200_*.json"),
}
"""One place for the devices: SMs and max SM clock (nvidia-smi's clocks.max.sm: 1980 MHz on both,
benchmarks/results/gpu_h200_d75eb4b/device.txt), L2 (50 MB on the H100 SXM; 60 MB taken for the
H200), copy bandwidth measured beside the rows (H100 2952 GB/s at 532ad50, H200 4138 at d75eb4b)."""

PIPES = {"issue": 4.0, "fma": 4.0, "alu": 2.0, "xu": 0.5, "lsu": 1.0}
"""Warp-instructions per SM per cycle (roofline.md): issue 4 schedulers x 1; fma: 128 fp32 lanes
(IMAD runs on the heavy half only: counted twice); alu: 64 lanes (integer, logic, compare,
select, fp32 min/max, fast conversions); xu: 16 lanes (MUFU, I2F/F2I, F2F, popc); lsu: one
128-byte wavefront per cycle (a warp's 16-byte access is 4 wavefronts)."""
MEMORY_LATENCY_CYCLES = 1000
"""A global load's round trip to DRAM in SM cycles, about 500 ns at 1.98 GHz (assumed, order of
magnitude of published H100 microbenchmarks): what a dependent step waits (:func:`warp_cycles`)."""
L2_LATENCY_CYCLES = 300
"""A global load that hits the L2, in SM cycles (assumed: published H100 figures ~260-300): the
loads a row names as reading small tables every program shares (``Launch.l2_hits``)."""
SHARED_LATENCY_CYCLES = 30
"""A shared-memory load's (LDS, LDSM, ATOMS) or a shuffle's result, in cycles (assumed: the order
of published sm_90 microbenchmarks, ~30)."""
XU_LATENCY_CYCLES = 20
"""A MUFU / conversion result (variable latency on sm_90), in cycles (assumed)."""
BARRIER_CYCLES = 20
"""One barrier (BAR.SYNC) of a block whose warps arrive together, in cycles (assumed)."""
ATOMIC_RATE = 18e9
"""Lane atomics per second the memory system completes to scattered addresses: measured on the
H100 by 532ad50's top-k decode-sum (one fp32 atomic per entry: 2M / 8M / 64M atomics took 0.10 /
0.45 / 3.7 ms beyond its bytes, 17-20 G/s; bench_gpu_h100_532ad50*.json). Taken for every device
and every atomic (an L2-resident target may be faster; not measured)."""
ATOMIC_SERIAL_CYCLES = 1
"""Cycles the L2 needs per atomic on one address (same-address atomics serialize there): one, the
most optimistic plausible figure (assumed; nothing measured isolates it)."""
SCATTER_TAGS = 4
"""Distinct 128-byte lines the L1's tag stage resolves per cycle (one wavefront), on GV100 and
later (NVIDIA's forum, Greg Smith: "4 sets x 4 sectors per cycle"): a warp's 4-byte access to 32
scattered lines takes 32 / SCATTER_TAGS wavefronts of the load/store pipe, not the one the SASS
count gives it (``Launch.scatter``'s read-modify-writes: a load and a store each)."""
MISS_BYTES = 96
"""DRAM bytes of a scattered 4-byte read-modify-write that misses the L2: one 64-byte fetch (two
32-byte sectors, the HBM access granularity) and a 32-byte sector written back."""
LAUNCH_S = 4e-6
"""Per kernel launch, back to back (roofline.md: 3-5 us)."""
REGISTERS, MAX_WARPS, MAX_BLOCKS, SHARED_BYTES, SHARED_RESERVED = 65536, 64, 32, 228 * 1024, 1024
"""Per SM: registers, resident warps and blocks, shared memory and what each block reserves."""
MISS = 0.25
"""A prediction further than this from the measurement (relative) gets an explanation."""
VALIDATED = "532ad50"
"""The commit whose kernels were measured on an H100 (benchmarks/results/bench_gpu_h100_532ad50*.json)."""
SIZES = {"16M": 1 << 24, "100M": 100_000_000}
"""bench_gpu.py's sizes with 4096 x 4096 PowerSGD matrices (its 1M row has 1024 x 1024 ones)."""
BLOCK, CHUNK, RATIO, RANK, SIDE = 256, 1024, 0.01, 4, 4096
"""bench_gpu.py's int8/int4 block, sign chunk, top-k density, PowerSGD rank and matrix side."""
GPT2_BLOCK, GPT2_OP = [(768, 2304), (768, 768), (768, 3072), (3072, 768)], "hook gpt2-small block"
"""bench_gpu.py's PowerSGD hook on a GPT-2-small block's weight matrices (one bucket, at every size)."""
SMOKE = ("fp16 compress+EF", "int8 decode-sum p=8", "sign decode-sum p=64")
"""--smoke's rows: bytes-bound (one pass, a loop over ranks) and ALU-bound (sign unpacking)."""

# ---- SASS --------------------------------------------------------------------------------------
ALU = {"IADD3", "IADD", "VIADD", "LOP3", "LOP", "SHF", "SHL", "SHR", "ISETP", "SEL", "FSEL", "FSETP",
       "FMNMX", "IMNMX", "VIMNMX", "PRMT", "LEA", "MOV", "PLOP3", "P2R", "R2P", "IABS", "BMSK",
       "SGXT", "F2FP", "I2FP", "VABSDIFF", "CS2R", "FCHK", "HSETP2", "HMNMX2", "BFE", "BFI"}
FMA = {"FADD", "FMUL", "FFMA", "HADD2", "HMUL2", "HFMA2", "FSWZADD"}
FMA_HEAVY = {"IMAD", "IMUL", "IDP", "IDP4A"}
XU = {"MUFU", "I2F", "F2I", "F2F", "FRND", "POPC", "FLO", "BREV", "I2I"}
MEMORY = {"LDG", "STG", "LD", "ST", "LDS", "STS", "LDSM", "ATOM", "ATOMG", "ATOMS", "RED", "REDG",
          "LDGSTS", "SHFL", "STSM"}
GLOBAL_LOADS = {"LDG", "LD", "ATOM", "ATOMG", "LDGSTS"}
ATOMICS = {"ATOM", "ATOMG", "RED", "REDG", "ATOMS"}
WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
HINTS = {"EF", "EL", "LU", "NA"}
"""Cache-eviction hints of a global access (evict-first, evict-last, last-use, no-allocate), as
``Launch.l2_hits`` may name them: LDG.EL.32."""
INSTRUCTION = re.compile(r"^(\S+)\t(?:@!?U?P\w+ )?([A-Z0-9_]+)((?:\.[A-Z0-9_]+)*)(.*);$")
BRANCH = re.compile(r"\bBRA(?:\.\w+)* (LBB\d+);$")


@dataclass
class Sass:
    """A kernel's SASS as counted: per instruction (opcode, modifiers, stall cycles, executed:
    False on a slow path, the CALL that a forward branch skips, e.g. div_rn's) and the loops
    (first, last instruction index, in order of their first instruction)."""

    ops: list[tuple[str, tuple[str, ...], int, bool]]
    loops: list[tuple[int, int]]
    operands: list[tuple[tuple[str, ...], tuple[str, ...]]] = ()
    """Per instruction: (registers written, registers and predicates read)."""

    @classmethod
    def parse(cls, text: str) -> Sass:
        ops, labels, branches, operands = [], {}, [], []
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("LBB") and line.endswith(":"):
                labels[line[:-1]] = len(ops)
                continue
            found = INSTRUCTION.match(line)
            if not found:
                continue
            control, opcode, modifiers = found.group(1), found.group(2), found.group(3)
            target = BRANCH.search(line)
            if target and not line.split("\t")[1].startswith("@") and labels.get(target.group(1)) == len(ops):
                break  # the idle self-branch after the last EXIT: never executed, nor what follows
            if target:
                branches.append((len(ops), target.group(1)))
            ops.append((opcode, tuple(modifiers.split(".")[1:]), int(control.split(":")[-1], 16)))
            operands.append(registers(opcode, ops[-1][1], found.group(4), line))
        loops = sorted((labels[label], at) for at, label in branches if labels[label] <= at)
        executed = [True] * len(ops)
        for at, label in branches:  # a slow path (a CALL, no other entry) the fast path branches over
            end = labels[label]
            if (end > at and any(op[0] == "CALL" for op in ops[at + 1:end])
                    and not any(at < i < end for i in labels.values())):
                executed[at + 1:end] = [False] * (end - at - 1)
        return cls([(*op, run) for op, run in zip(ops, executed)], loops, operands)

    def weights(self, trips: tuple[float, ...]) -> list[float]:
        """Executions per warp of every instruction: the product of its loops' trip counts."""
        if len(trips) != len(self.loops):
            raise ValueError(f"{len(self.loops)} loops in the SASS, {len(trips)} trip counts in the row")
        weight = [1.0 if executed else 0.0 for *_, executed in self.ops]
        for (first, last), count in zip(self.loops, trips):
            for i in range(first, last + 1):
                weight[i] *= count
        return weight


REGISTER = re.compile(r"\b(U?R\d+|U?P\d+)(\.64)?")
NO_DESTINATION = {"STG", "ST", "STS", "STL", "RED", "REDG", "BAR", "BRA", "EXIT", "STSM", "MEMBAR",
                  "WARPSYNC", "BSYNC", "BSSY", "CALL", "RET", "NOP", "DEPBAR", "ERRBAR", "CCTL"}


def registers(opcode: str, modifiers: tuple, text: str, line: str) -> tuple[tuple, tuple]:
    """(registers written, registers read) of one instruction: the first operand is written
    (both of ATOM's leading operands; none for stores, reductions, barriers, branches), a load
    of w bytes writes w / 4 consecutive registers, ``.WIDE`` and ``R.64`` pairs two; the guard
    predicate is read."""
    parts = [part.strip() for part in text.split(",")] if text.strip() else []

    def expand(part: str, count: int = 1) -> list[str]:
        out = []
        for name, pair in REGISTER.findall(part):
            base = int(re.sub(r"\D", "", name))
            prefix = re.sub(r"\d", "", name)
            span = 2 if pair else count
            out += [f"{prefix}{base + i}" for i in range(span)]
        return out

    width = next((WIDTH[m] for m in modifiers if m in WIDTH), 4)
    lanes = max(1, width // 4) if opcode in MEMORY else (2 if "WIDE" in modifiers else 1)
    written_parts = 0 if opcode in NO_DESTINATION else (2 if opcode in ("ATOM", "ATOMG") else 1)
    written = [r for part in parts[:written_parts] for r in expand(part, lanes)]
    read = [r for part in parts[written_parts:] for r in expand(part)]
    guard = re.search(r"\t@!?(U?P\d+) ", line)
    if guard:
        read.append(guard.group(1))
    return tuple(written), tuple(read)


def warp_cycles(sass: Sass, trips: tuple[float, ...], memory_latency: float, l2_hits: tuple = ()) -> float:
    """One warp's cycles through the kernel, issued in order: each instruction issues when the
    previous one's stall cycles (the SASS control codes) have passed and its operands are ready; a
    global load or returning atomic's result is ready ``memory_latency`` cycles after it issues, a
    shared load's or shuffle's SHARED_LATENCY_CYCLES, a MUFU / conversion's XU_LATENCY_CYCLES, a
    barrier costs BARRIER_CYCLES (fixed-latency results: covered by the stall counts). So
    dependent steps add their latencies (a load whose address comes from a load waits for both)
    and independent loads overlap, in loop-free code as in a loop. Each loop runs its trip count:
    its body is simulated twice and the second trip's cycles repeat for the rest (a fractional
    count scales the one trip). ``l2_hits``: loads (opcode.bits) whose round trip is
    L2_LATENCY_CYCLES."""
    if len(trips) != len(sass.loops):
        raise ValueError(f"{len(sass.loops)} loops in the SASS, {len(trips)} trip counts in the row")
    operands = sass.operands or [((), ())] * len(sass.ops)
    loops = list(zip(sass.loops, trips))
    state = {"t": 0.0}
    ready: dict[str, float] = {}

    def latency(opcode: str, modifiers: tuple) -> float:
        if opcode in GLOBAL_LOADS:
            width = next((WIDTH[m] for m in modifiers if m in WIDTH), 4)
            hinted = ".".join([opcode, *(m for m in modifiers if m in HINTS), str(width * 8)])
            hit = f"{opcode}.{width * 8}" in l2_hits or hinted in l2_hits
            return L2_LATENCY_CYCLES if hit else memory_latency
        if opcode in ("LDS", "LDSM", "ATOMS", "SHFL"):
            return SHARED_LATENCY_CYCLES
        if opcode in XU:
            return XU_LATENCY_CYCLES
        return 0.0

    def step(i: int) -> None:
        opcode, modifiers, stall, executed = sass.ops[i]
        if not executed:
            return
        written, read = operands[i]
        start = max([state["t"]] + [ready.get(r, 0.0) for r in read])
        if opcode == "BAR":
            start += BARRIER_CYCLES
        state["t"] = start + stall
        for r in written:
            ready[r] = start + latency(opcode, modifiers)

    def run(lo: int, hi: int, skip=None) -> None:
        i = lo
        while i <= hi:
            loop = next(((bounds, count) for bounds, count in loops
                         if bounds[0] == i and bounds != skip and bounds[1] <= hi), None)
            if loop is None:
                step(i)
                i += 1
                continue
            (first, last), count = loop
            i = last + 1
            if count <= 0:
                continue
            t0 = state["t"]
            run(first, last, (first, last))
            t1 = state["t"]
            if count < 2:
                extra = (t1 - t0) * (count - 1)
            else:
                run(first, last, (first, last))
                extra = (state["t"] - t1) * (count - 2)
            state["t"] += extra
            for r, at in ready.items():
                if at > t0:
                    ready[r] = at + extra

    run(0, len(sass.ops) - 1)
    return max([state["t"]] + list(ready.values()))


def pipe_counts(sass: Sass, trips: tuple[float, ...]) -> dict:
    """Per warp: warp-instructions by pipe (``PIPES``), stall cycles, global-load round trips,
    atomics, and memory instructions by opcode and width in bytes per thread."""
    weight = sass.weights(trips)
    counts = dict.fromkeys(PIPES, 0.0) | {"stall": 0.0, "round_trips": 0.0, "atomics": 0.0,
                                          "global_bytes": 0.0}
    widths = {}
    waited = set()
    for i, ((opcode, modifiers, stall, _), w) in enumerate(zip(sass.ops, weight)):
        if not w:
            continue
        counts["issue"] += w
        counts["stall"] += w * stall
        if opcode in ALU:
            counts["alu"] += w
        elif opcode in FMA:
            counts["fma"] += w
        elif opcode in FMA_HEAVY:
            counts["fma"] += 2 * w
        elif opcode in XU:
            counts["xu"] += w
        elif opcode in MEMORY:
            width = next((WIDTH[m] for m in modifiers if m in WIDTH), 4)
            counts["lsu"] += w * max(1, 32 * width // 128)
            key = f"{opcode}.{width * 8}"
            widths[key] = widths.get(key, 0.0) + w
            counts["atomics"] += w if opcode in ATOMICS else 0
            if opcode in GLOBAL_LOADS or opcode in ("STG", "ST", "RED", "REDG"):
                counts["global_bytes"] += w * 32 * width  # every lane: an upper bound under masks
            if opcode in GLOBAL_LOADS:  # one round trip per executed innermost block that loads
                region = max((loop for loop in sass.loops if loop[0] <= i <= loop[1]),
                             key=lambda loop: loop[0], default=None)
                waited.add(region)
    for region in waited:
        counts["round_trips"] += 1.0 if region is None else weight[region[0]]
    counts["memory_ops"] = widths
    return counts


# ---- kernels of a tree -------------------------------------------------------------------------

class Tree:
    """The kernels package of the working tree (``commit`` None: gradcomp.kernels) or of a commit
    (``git archive`` of its kernels/ into a temporary directory, imported as its own package: its
    modules import each other relatively). Compiles each case once per run."""

    def __init__(self, commit: str | None, stack: contextlib.ExitStack):
        if commit is not None:  # short hashes name the results files and FROZEN's keys
            commit = subprocess.run(["git", "rev-parse", "--short=7", f"{commit}^{{commit}}"], cwd=REPO,
                                    capture_output=True, text=True, check=True).stdout.strip()
        self.commit = commit
        if commit is None:
            self.package = "gradcomp.kernels"
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            archive = subprocess.run(["git", "archive", commit, "kernels"], cwd=REPO,
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
            self.package = "roofline_kernels_" + re.sub(r"\W", "_", commit)
            spec = importlib.util.spec_from_file_location(
                self.package, root / "kernels" / "__init__.py",
                submodule_search_locations=[str(root / "kernels")])
            module = importlib.util.module_from_spec(spec)
            sys.modules[self.package] = module
            spec.loader.exec_module(module)
        self.compiled = {}

    def family(self, name: str):
        return importlib.import_module(f"{self.package}.{name}")

    def declared(self, family: str):
        """The module of ``family``'s declared bytes (``*_bytes``) and tiles: ``declared``, or the
        family module itself in a tree from before kernels/declared.py (532ad50)."""
        has_declared = importlib.util.find_spec(f"{self.package}.declared") is not None
        return self.family("declared" if has_declared else family)

    def configs(self, family: str, kernel: str, constexprs: dict) -> list:
        """The shipped compile cases of ``kernel`` (one per config) with ``constexprs`` set: cases
        that hold those values already, else the cases' constexprs overridden (flags the shipped
        cases do not cover, e.g. the bench's launch without a dropped-entry count)."""
        cases = [c for c in self.family(family).compile_cases()
                 if getattr(c.kernel, "fn", c.kernel).__name__ == kernel]
        if not cases:
            raise LookupError(f"{self.package}.{family} has no compile case of {kernel}: renamed or "
                              f"removed? (update the rows in benchmarks/roofline.py)")
        unknown = set(constexprs) - set(cases[0].constexprs)
        if unknown:
            raise LookupError(f"{kernel} has no constexpr {sorted(unknown)} (its constexprs: "
                              f"{sorted(cases[0].constexprs)}): update the rows in benchmarks/roofline.py")
        matching = [c for c in cases if all(c.constexprs[k] == v for k, v in constexprs.items())]
        chosen, unique = [], set()
        for case in matching or cases:
            values = {**case.constexprs, **constexprs}
            key = (tuple(sorted(values.items())), case.num_warps)
            if key not in unique:
                unique.add(key)
                chosen.append((case, values))
        return chosen

    def compile(self, case, constexprs: dict, unaligned: tuple = ()) -> dict:
        """SASS (parsed) and resources of a case with these constexprs, compiled for sm_90;
        ``unaligned``: arguments dropped from the case's 16-divisible ones."""
        from dataclasses import replace

        from gradcomp.kernels.aot import compile_case, resources, sass

        missing = set(unaligned) - set(case.aligned)
        if missing:
            raise LookupError(f"{case.name}: {sorted(missing)} not among its aligned arguments "
                              f"{list(case.aligned)}: update the rows in benchmarks/roofline.py")
        key = (case.name, tuple(sorted(constexprs.items())), case.num_warps, tuple(sorted(unaligned)))
        if key not in self.compiled:
            aligned = tuple(a for a in case.aligned if a not in unaligned)
            compiled = compile_case(replace(case, constexprs=constexprs, aligned=aligned), 90)
            self.compiled[key] = {"sass": Sass.parse(sass(compiled)), **resources(compiled),
                                  "warps": case.num_warps}
        return self.compiled[key]


# ---- rows --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Launch:
    """One kernel launch of a row: the family module, the @triton.jit function's name, the
    constexprs it is launched with, its programs from a config's meta-parameters (a function of
    them), the trip count of each loop of its SASS in order (numbers, or functions of the
    meta-parameters), and how many times the row launches it (e.g. once per matrix)."""

    family: str
    kernel: str
    constexprs: dict
    programs: object
    loops: tuple = ()
    repeat: int = 1
    atomics: tuple = ()
    """(lane atomics, the addresses they spread over): the launch's atomics beyond what the SASS
    shows (how many lanes are live, how many addresses are hot): the atomics floor is the larger
    of atomics / ATOMIC_RATE and the hottest address's share times ATOMIC_SERIAL_CYCLES. Several
    streams (a tuple of such pairs: e.g. a counter and a histogram): their lane atomics summed,
    the hottest address of any one of them."""
    scatter: tuple = ()
    """(4-byte read-modify-writes, output bytes each program keeps open): a scatter into
    per-program tiles; when the resident programs' tiles exceed the L2, the fraction that does not
    fit misses and costs MISS_BYTES instead of the 8 declared."""
    l2_hits: tuple = ()
    """Global loads (opcode.bits, as --detail lists them, or opcode.hint.bits with a cache hint:
    LDG.EL.32) that read small tables every program shares (L2-resident): their round trip is
    L2_LATENCY_CYCLES, not MEMORY_LATENCY_CYCLES."""
    scatter_loads: tuple = ()
    """The scatter's loads (as ``l2_hits`` names them): L2 hits while the resident programs'
    tiles fit the L2 (no miss), else DRAM round trips."""
    unaligned: tuple = ()
    """Arguments the launch does not pass 16-divisible (the hooks' row strides): compiled without
    their divisibility, as the JIT specializes such a launch."""


@dataclass(frozen=True)
class Row:
    """One bench_gpu row: its kernel launches, declared bytes and torch ops."""

    method: str
    op: str
    n: int
    launches: list
    declared_bytes: int
    torch_ops: tuple = ()
    """Launches of torch ops (name, count): their bytes are in the declared bytes; their
    instructions are not modelled."""

    @property
    def name(self) -> str:
        return f"{self.method} {self.op}"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def grid_programs(grid, meta: dict) -> int:
    return math.prod(grid(meta))


def plane_launches(tree: Tree, family: str, kernel: str, n: int, width: int, planes: int,
                   constexprs: dict, loops: tuple = ()) -> list[Launch]:
    """The launches of a plane-tiled kernel: one per run of common.plane_runs."""
    common = tree.family("common")
    return [Launch(family, kernel, constexprs,
                   lambda meta, f=first, e=end: grid_programs(common.plane_grid(f, e, width), meta), loops)
            for first, end, _ in common.plane_runs(n, width, planes)]


def payload_parts(method: str, n: int) -> list[int]:
    """The bytes of each part of one rank's payload of bench_gpu's rows (codes or values, then
    fp32 scales)."""
    if method in ("fp16", "bf16"):
        return [2 * n]
    if method == "int8":
        return [n, 4 * cdiv(n, BLOCK)]
    if method == "int4":
        return [cdiv(n, 2), 4 * cdiv(n, BLOCK)]
    if method == "sign":
        return [cdiv(n, 8), 4 * cdiv(n, CHUNK)]
    raise ValueError(method)


def payload_bytes(method: str, n: int, aligned: bool = False) -> int:
    """One rank's payload bytes: the row stride of a hook's gathered uint8[p, row bytes] buffer.
    Packed (``aligned`` False, the layout before gradcomp.payload's wire layout): at 100M int8
    101,562,500, int4 51,562,500, sign 12,890,628 (each 4 mod 16; at 16M multiples of 16).
    ``aligned``: every part and the row padded to 16 bytes (gradcomp.payload.WIRE_ALIGN)."""
    parts = payload_parts(method, n)
    return sum(cdiv(size, 16) * 16 for size in parts) if aligned else sum(parts)


def wire_aligned(tree: Tree) -> bool:
    """Whether the tree's gradcomp lays payload rows out 16-byte aligned (gradcomp/payload.py's
    WIRE_ALIGN; the working tree's, or the commit's file)."""
    if tree.commit is None:
        return hasattr(importlib.import_module("gradcomp.payload"), "WIRE_ALIGN")
    source = subprocess.run(["git", "show", f"{tree.commit}:gradcomp/payload.py"], cwd=REPO,
                            capture_output=True, text=True).stdout
    return "WIRE_ALIGN" in source


def hook_layout(row: Row, stride: int, strides: tuple) -> Row:
    """bench_gpu's "hook-layout" row of a p=64 decode-sum: the same launches on the payloads as
    a hook receives them (rows ``stride`` bytes apart in one gathered buffer): the row-stride
    arguments ``strides`` lose their 16-divisibility when ``stride`` is not a multiple of 16
    (Triton then compiles the kernel without the wide loads that need it). The declared bytes
    are the aligned row's (a padded row's few pad bytes are not counted)."""
    from dataclasses import replace

    unaligned = strides if stride % 16 else ()
    return Row(row.method, row.op + " hook-layout", row.n,
               [replace(launch, unaligned=unaligned) for launch in row.launches], row.declared_bytes,
               row.torch_ops)


def rows(tree: Tree, n: int) -> list[Row]:
    """bench_gpu.py's rows at n elements (PowerSGD: a bucket of SIDE x SIDE matrices, and the
    GPT-2-small block's), as launches."""
    cast = tree.family("cast")
    aligned = wire_aligned(tree)  # the hooks' payload rows: 16-byte aligned, or packed
    out = []
    for wire in ("fp16", "bf16"):
        bf16 = wire == "bf16"
        grid = cast.elementwise_grid(n)
        out.append(Row(wire, "compress+EF", n, [Launch(
            "cast", "ef_cast_kernel", {"HAS_RESIDUAL": True, "X_BF16": False, "TO_BF16": bf16},
            lambda meta, g=grid: grid_programs(g, meta))], tree.declared("cast").ef_cast_bytes(n, 4, True)))
        for world in (2, 8, 64):
            out.append(Row(wire, f"decode-sum p={world}", n, [Launch(
                "cast", "cast_decode_sum_kernel", {"FROM_BF16": bf16, "HAS_ADDEND": False, "OUT_BF16": False},
                lambda meta, g=grid: grid_programs(g, meta), (world - 1,))],
                tree.declared("cast").cast_decode_sum_bytes(n, world, 4)))
        out.append(hook_layout(out[-1], payload_bytes(wire, n, aligned), ()))
    for method, levels in (("int8", 127), ("int4", 7)):
        int4, planes = levels == 7, 2 if levels == 7 else 1
        out.append(Row(method, "compress+EF", n, plane_launches(
            tree, "quant", "ef_quantize_kernel", n, BLOCK, planes,
            {"INT4": int4, "STOCHASTIC": False, "HAS_RESIDUAL": True, "X_BF16": False, "QB": BLOCK}),
            tree.declared("quant").ef_quantize_bytes(n, BLOCK, levels, 4, True)))
        for world in (2, 8, 64):
            out.append(Row(method, f"decode-sum p={world}", n, plane_launches(
                tree, "quant", "dequantize_sum_kernel", n, BLOCK, planes,
                {"INT4": int4, "HAS_ADDEND": False, "OUT_BF16": False, "QB": BLOCK}, (world - 1,)),
                tree.declared("quant").dequantize_sum_bytes(n, BLOCK, levels, world, 4)))
        out.append(hook_layout(out[-1], payload_bytes(method, n, aligned), ("q_row",)))
    out.append(Row("sign", "compress+EF", n, plane_launches(
        tree, "sign", "ef_sign_kernel", n, CHUNK, 8, {"HAS_RESIDUAL": True, "X_BF16": False, "CB": CHUNK}),
        tree.declared("sign").ef_sign_bytes(n, CHUNK, 4, True)))
    group = getattr(tree.declared("sign"), "SIGN_GROUP", 1)  # ranks per loop trip (1 before groups)
    for world in (2, 8, 64):
        out.append(Row("sign", f"decode-sum p={world}", n, plane_launches(
            tree, "sign", "sign_decode_sum_kernel", n, CHUNK, 8,
            {"HAS_ADDEND": False, "OUT_BF16": False, "CB": CHUNK}, (cdiv(world, group) - 1,)),
            tree.declared("sign").sign_decode_sum_bytes(n, CHUNK, world, 4)))
    out.append(hook_layout(out[-1], payload_bytes("sign", n, aligned), ("bits_row",)))
    variant = FROZEN.get(tree.commit, {})
    out += variant.get("topk", topk_rows)(tree, n)
    out.append(variant.get("powersgd", powersgd_row)(tree, n))
    if "powersgd" not in variant:  # bench_gpu's block row came after the frozen commits
        out.append(powersgd_bucket_row(tree, GPT2_OP, GPT2_BLOCK))
    return out


def topk_rows_532ad50(tree: Tree, n: int) -> list[Row]:
    """532ad50's top-k, threshold selector: a sampled threshold (torch), the candidate pass,
    torch.topk over the candidate buffer, the gather, the non-finite zeroing (a pass that stops
    at once); its decode-sum: the start, then one fp32 atomic per entry."""
    topk = tree.family("topk")
    out = []
    k = max(1, round(RATIO * n))
    block = topk.CONFIGS[0].kwargs["BLOCK"]
    by_n, by_k = topk.elementwise_grid(n), topk.elementwise_grid(k)
    out.append(Row("topk", "compress+EF", n, [
        Launch("topk", "topk_candidates_kernel", {"HAS_RESIDUAL": True, "X_BF16": False, "DENSE": False},
               lambda meta: grid_programs(by_n, meta)),
        Launch("topk", "topk_gather_kernel", {"DIRECT": False, "EXACT_FALLBACK": False, "HAS_RESIDUAL": True,
                                              "X_BF16": False}, lambda meta: grid_programs(by_k, meta)),
        Launch("topk", "zero_nonfinite_kernel", {}, lambda meta: grid_programs(by_n, meta))],
        topk.ef_topk_bytes(n, k, round(1.1 * k), 4, True, block),
        (("randint, gather, add, abs (sample)", 4), ("kthvalue (sample)", 1), ("full, zeros", 2),
         ("topk", 1))))
    for world in (2, 8, 64):
        scatter = topk.scatter_add_grid(k, world)
        out.append(Row("topk", f"decode-sum p={world}", n, [
            Launch("topk", "scatter_start_kernel", {"HAS_ADDEND": False}, lambda meta: grid_programs(by_n, meta)),
            Launch("topk", "scatter_add_kernel", {"V_BF16": False},
                   lambda meta, g=scatter: grid_programs(g, meta), atomics=(world * k, world * k))],
            topk.scatter_add_sum_bytes(n, k, world, 4, 4)))
    return out


def powersgd_hook_row(tree: Tree, n: int, ortho: dict, tile_rows: int) -> Row:
    """532ad50's PowerSGD hook on a bucket of SIDE x SIDE matrices, per matrix: compress (Q's
    unit columns, ef_matmul P = M Q, Gram-Schmidt of P, Q = M^T P on cuBLAS's bmm, keep Q,
    residual update), then the all-reduces of P and Q and P Q^T decoded into the bucket. The
    Gram-Schmidt streams P in tiles of ``tile_rows`` rows, launched with ``ortho`` (its tile
    constexpr)."""
    psgd = tree.family("powersgd")
    count = max(1, round(n / SIDE**2))
    total = count * SIDE * SIDE
    config = psgd.MATMUL_CONFIGS[0].kwargs

    def splits(tile: int) -> int:  # the launcher's matmul_splits, from the first config's tile
        return max(1, min(SIDE // psgd.MIN_SPLIT_COLUMNS, cdiv(psgd.TARGET_PROGRAMS, cdiv(SIDE, tile))))

    columns = splits(config["BLOCK_N"])
    r_pad = 1 << (RANK - 1).bit_length()
    sweeps = cdiv(SIDE, tile_rows)
    step = psgd.power_step_bytes(SIDE, SIDE, RANK, 4, True, config["BLOCK_N"], config["BLOCK_M"])
    decode = 4 * (2 * SIDE * RANK + SIDE * SIDE)
    launches = [
        Launch("powersgd", "ef_matmul_kernel", {"HAS_RESIDUAL": True, "X_BF16": False, "R_PAD": r_pad},
               lambda meta: cdiv(SIDE, meta["BLOCK_N"]) * columns,
               (lambda meta: cdiv(cdiv(SIDE, columns), meta["BLOCK_M"]),), repeat=count),
        # Gram-Schmidt, one program: columns i < RANK, then four sweeps of the rows per column
        # (the first only for i > 0)
        Launch("powersgd", "orthonormalize_kernel", {"R_PAD": r_pad, **ortho}, lambda meta: 1,
               (RANK, sweeps * (RANK - 1) / RANK, sweeps, sweeps, sweeps), repeat=count),
        Launch("powersgd", "residual_update_kernel", {},
               lambda meta: cdiv(SIDE, meta["BLOCK_N"]) * cdiv(SIDE, meta["BLOCK_M"]), (RANK,), repeat=count)]
    return Row("powersgd", "hook", total, launches, count * (step + decode),
               (("Q unit columns (clone, norm, clamp, div)", 4 * count), ("P zero", count),
                ("orthonormalize tables (3 host copies)", 3 * count), ("bmm M^T P", count),
                ("keep Q (isfinite, all, where)", 3 * count), ("cat, all_reduce (P, Q)", 4),
                ("bmm P Q^T (decode)", count)))


def powersgd_row_532ad50(tree: Tree, n: int) -> Row:
    """532ad50's: a Gram-Schmidt tile of BLOCK_N rows, Q = M^T P on cuBLAS."""
    rows = tree.family("powersgd").ORTHO_CONFIGS[0].kwargs["BLOCK_N"]
    return powersgd_hook_row(tree, n, {"BLOCK_N": rows}, rows)


def split_trips(length: int, splits: int, per_split: int, block: int) -> int:
    """Loop trips of all the splits of a matmul program's loop: ``length`` rows or columns cut
    into ``splits`` of ``per_split`` (the last one shorter, or empty), ``block`` per trip."""
    return sum(cdiv(max(0, min(per_split, length - s * per_split)), block) for s in range(splits))


def powersgd_bucket_row(tree: Tree, op: str, shapes: list[tuple[int, int]]) -> Row:
    """The working tree's PowerSGD hook (gradcomp.hooks.powersgd_hook, rank RANK, error feedback)
    on one bucket of fp32 matrices of ``shapes`` laid back to back, as bench_gpu times it: each
    pass is one launch for every matrix of the bucket, over its runs (consecutive same-shape
    matrices: evenly spaced in the bucket), from the run and program tables (cached per bucket,
    no copy per call). The matmul kernels' loop trips are the mean over their programs (runs of
    other shapes, shorter last splits: the programs are scheduled as SMs free up); the
    Gram-Schmidt's are the longest matrix's (one program per matrix, all in one wave). Torch
    ops as the hook runs them per bucket (17, counted under the interpreter) and the 2
    all-reduces."""
    psgd, declared = tree.family("powersgd"), tree.declared("powersgd")
    runs = [(len(list(group)), *shape) for shape, group in itertools.groupby(shapes)]
    r_pad = 1 << (RANK - 1).bit_length()
    starts = list(itertools.accumulate((n * m for n, m in shapes), initial=0))
    # run_tables' ALIGN: every m, matrix size and offset in the bucket (and residual) divisible
    align = next(a for a in (8, 4, 1) if all(v % a == 0 for v in (*(m for _, m in shapes), *starts)))

    def matmul(kind: str, meta: dict) -> tuple[int, float]:
        """(programs, mean loop trips of a program) of the ``kind`` kernel over the runs."""
        programs = trips = 0
        for k, n, m in runs:
            count, splits, per_split = declared.run_programs(kind, k, n, m, meta["BLOCK_N"], meta["BLOCK_M"])
            programs += count
            if kind == "ef_matmul":  # row blocks x column splits, a trip per BLOCK_M columns
                trips += k * cdiv(n, meta["BLOCK_N"]) * split_trips(m, splits, per_split, meta["BLOCK_M"])
            elif kind == "transpose_matmul":  # column blocks x row splits, a trip per BLOCK_N rows
                trips += k * cdiv(m, meta["BLOCK_M"]) * split_trips(n, splits, per_split, meta["BLOCK_N"])
            else:  # residual_update: a trip per column of P and Q
                trips += count * RANK
        return programs, trips / programs

    def launch(kernel: str, kind: str, constexprs: dict) -> Launch:
        # the run and program tables (int64, int32) and P, Q (fp32, n x rank and m x rank per
        # matrix): read by every program, L2-resident
        return Launch("powersgd", kernel, {"ALIGN": align, **constexprs},
                      lambda meta: matmul(kind, meta)[0], (lambda meta: matmul(kind, meta)[1],),
                      l2_hits=("LDG.32", "LDG.64"))

    def sweeps(meta: dict) -> int:  # row tiles of the longest P, BLOCK / R_PAD rows each
        return cdiv(max(n for _, n, _ in runs), meta["BLOCK"] // r_pad)

    config = psgd.MATMUL_CONFIGS[0].kwargs
    step = sum(declared.power_step_bytes(n, m, RANK, 4, True, config["BLOCK_N"], config["BLOCK_M"]) for n, m in shapes)
    # bench_gpu.powersgd_bytes: residual_update's decode write (its reads of P and Q: in the step)
    decode = sum(4 * n * m for n, m in shapes)
    return Row("powersgd", op, sum(n * m for n, m in shapes), [
        launch("ef_matmul_kernel", "ef_matmul", {"HAS_RESIDUAL": True, "X_BF16": False, "R_PAD": r_pad}),
        # Gram-Schmidt: columns i < RANK, then four sweeps of the rows per column (the first
        # only for i > 0)
        Launch("powersgd", "orthonormalize_kernel", {"R_PAD": r_pad}, lambda meta: len(shapes),
               (RANK, lambda meta: sweeps(meta) * (RANK - 1) / RANK, sweeps, sweeps, sweeps)),
        launch("transpose_matmul_kernel", "transpose_matmul", {"FROM_X": False, "X_BF16": False, "R_PAD": r_pad}),
        launch("residual_update_kernel", "residual_update", {"DECODE": True, "HAS_RESIDUAL": True,
                                                             "OUT_BF16": False})],
        step + decode,
        (("P, Q zero-filled (zero_, zeros)", 2),
         ("Q unit columns (zeros, mul, index_add_, sqrt_, clamp_min_, index_select, div_)", 7),
         ("all_reduce (P, Q)", 2), ("Q / world", 1), ("Q finite (sum, abs, ne, eq, mul)", 5),
         ("keep Q (where, copy_)", 2)))


def powersgd_row(tree: Tree, n: int) -> Row:
    """The working tree's hook on a bucket of about n elements: SIDE x SIDE matrices."""
    return powersgd_bucket_row(tree, "hook", [(SIDE, SIDE)] * max(1, round(n / SIDE**2)))


def topk_rows(tree: Tree, n: int) -> list[Row]:
    """The working tree's top-k (either selector: the same kernels): its compress
    (:func:`topk_compress_row`) and decode-sums (:func:`topk_decode_rows`)."""
    k = max(1, round(RATIO * n))
    return [topk_compress_row(tree, n, k)] + topk_decode_rows(tree, n, k)


def topk_compress_row(tree: Tree, n: int, k: int) -> Row:
    """Top-k compress+EF at 1%: nine launches, no torch op. The sample (one program), the
    candidate pass, the radix select's two histograms and scans, the count, its scan and the
    write, its bytes the method's declared bytes (bench_gpu's: 1.1k candidates). The atomics
    and the select kernels' steps follow the candidates the sampled threshold passes on average
    (its rank in the sample is aimed low: about 1.5k at 100M), the hottest top bucket holding
    1/16 of them (the bytes account's estimate of the boundary bucket); one returning atomic per
    candidate-pass program, all on one counter.

    The working tree's form (``declared.SCAN_CHUNK``): the candidate pass counts the candidates
    into the top histogram (its atomics a second stream of that launch); the first histogram
    launch only completes it where the candidates missed the top k (no trip: it reads the
    count and stops); the scans read the histograms the atomics just wrote (L2 hits) in two
    dependent steps; the select kernels take the longest run of their group (the mean
    candidates a run, 3 standard deviations of a Poisson count above it) in steps of
    TOPK_LANES. Before it (d75eb4b, the measured form): the first histogram launch counts every
    candidate (its atomics), one step of each select kernel."""
    from gradcomp.methods.topk import CANDIDATE_OVERSHOOT, TopK, kernel_sample, sample_rank

    topk, declared = tree.family("topk"), tree.declared("topk")
    block = max(b for b, _ in declared.TOPK_TILES)
    sample = kernel_sample(n, k, TopK.sample)  # the method's default sample
    rank = sample_rank(n, k, sample) if sample else 0
    passed = n * (sample - rank) / sample if rank else n
    by_n, runs = topk.elementwise_grid(n), topk.run_grid(n)
    flags = {"FROM_X": False, "X_BF16": False, "GROUP": declared.TOPK_GROUP}
    program_atomics = (lambda meta: grid_programs(by_n, meta), 1)
    declared_bytes = declared.ef_topk_bytes(n, k, int(k * CANDIDATE_OVERSHOOT) if sample else 0, 4, True,
                                            block, sample)
    sample_launch = Launch("topk", "topk_sample_kernel", {"HAS_RESIDUAL": True, "X_BF16": False,
                                                          "SAMPLE": topk.sample_tile(sample)}, lambda meta: 1)
    if not hasattr(declared, "SCAN_CHUNK"):  # d75eb4b's form
        return Row("topk", "compress+EF", n, [
            sample_launch,
            Launch("topk", "topk_candidates_kernel", {"HAS_RESIDUAL": True, "X_BF16": False},
                   lambda meta: grid_programs(by_n, meta), atomics=program_atomics),
            Launch("topk", "topk_radix_hist_kernel", {"LOW": False, **flags}, lambda meta: grid_programs(runs, meta),
                   (1,), atomics=(passed, 16)),
            Launch("topk", "topk_radix_scan_kernel", {"LOW": False}, lambda meta: 1),
            Launch("topk", "topk_radix_hist_kernel", {"LOW": True, **flags}, lambda meta: grid_programs(runs, meta),
                   (1,), atomics=(passed / 16, declared.LOW_BUCKETS)),
            Launch("topk", "topk_radix_scan_kernel", {"LOW": True}, lambda meta: 1),
            Launch("topk", "topk_count_kernel", flags, lambda meta: grid_programs(runs, meta), (1,)),
            Launch("topk", "topk_tally_scan_kernel", {}, lambda meta: 1, (1,)),
            Launch("topk", "topk_write_kernel", {"HAS_RESIDUAL": True, "X_BF16": False,
                                                 "GROUP": declared.TOPK_GROUP},
                   lambda meta: grid_programs(runs, meta), (1,))], declared_bytes)
    mean = passed / cdiv(n, declared.TOPK_RUN)
    steps = cdiv(math.ceil(mean + 3 * math.sqrt(mean)), declared.TOPK_LANES)
    scan_hits = ("LDG.32", "LDG.128")  # the histograms the atomics just wrote, and the counter
    return Row("topk", "compress+EF", n, [
        sample_launch,
        Launch("topk", "topk_candidates_kernel", {"HAS_RESIDUAL": True, "X_BF16": False},
               lambda meta: grid_programs(by_n, meta), atomics=(program_atomics, (passed, 16))),
        Launch("topk", "topk_radix_hist_kernel", {"LOW": False, **flags}, lambda meta: grid_programs(runs, meta),
               (0,)),
        Launch("topk", "topk_radix_scan_kernel", {"LOW": False}, lambda meta: 1, l2_hits=scan_hits),
        Launch("topk", "topk_radix_hist_kernel", {"LOW": True, **flags}, lambda meta: grid_programs(runs, meta),
               (steps,), atomics=(passed / 16, declared.LOW_BUCKETS)),
        Launch("topk", "topk_radix_scan_kernel", {"LOW": True}, lambda meta: 1, l2_hits=scan_hits),
        Launch("topk", "topk_count_kernel", flags, lambda meta: grid_programs(runs, meta), (steps,)),
        Launch("topk", "topk_tally_scan_kernel", {}, lambda meta: 1,
               (lambda meta: cdiv(grid_programs(runs, meta), meta["ROWS"] * meta["CHUNK"]),)),
        Launch("topk", "topk_write_kernel", {"HAS_RESIDUAL": True, "X_BF16": False,
                                             "GROUP": declared.TOPK_GROUP},
               lambda meta: grid_programs(runs, meta), (steps,))], declared_bytes)


def topk_decode_rows(tree: Tree, n: int, k: int) -> list[Row]:
    """The top-k decode-sum of sorted payloads at p = 2, 8, 64: the index check (one loop trip
    per block: its entries cross about one tile boundary each), the tile decode, the atomic
    fallback; and the torch zeroing of the per-rank flags.

    The tile decode as the tree has it. With ``declared.DECODE_GROUP`` (the working tree): 4 KB
    tiles, each group of 4 ranks' bounds and first chunks loaded at once (the outer loop's trips:
    cdiv(p, 4)), each rank's further chunks in a loop of its own with no trip (a rank's entries
    of a tile, about 41 at 1%, fit its first chunk of decode_chunk's 128); the read-modify-writes
    stay in the L2 (``scatter``: the resident programs' tiles fit it) and their loads, evict-last
    (``LDG.EL.32``), are L2 hits; the fallback's programs (FALLBACK_SPLIT a rank) load their
    rank's flag and run no trip. Before it (d75eb4b, 0c490a6): 16 KB tiles, a loop over the ranks
    (ptxas unrolls the loop over a rank's chunks by 4 and leaves a 2- and a 1-chunk tail: one
    chunk per rank and tile runs the tail only, the unrolled loop 0 times; the row counts both
    tails, an upper bound), and a fallback program per block of every rank that loads the flag
    and stops."""
    topk, declared = tree.family("topk"), tree.declared("topk")
    tiles = -(-n // declared.DECODE_TILE)
    group = getattr(declared, "DECODE_GROUP", None)
    decode = {"HAS_ADDEND": False, "ADDEND_BF16": False, "V_BF16": False, "PART": topk.DECODE_PART,
              "CHUNK": declared.decode_chunk(n, k)}
    out = []
    for world in (2, 8, 64):
        check = topk.scatter_add_grid(k + 1, world)
        if group is None:
            scatter = topk.scatter_add_grid(k, world)
            tile = Launch("topk", "topk_decode_tile_kernel", decode, lambda meta: tiles, (world, 0),
                          scatter=(world * k, 4 * declared.DECODE_TILE))
            fallback = Launch("topk", "scatter_add_kernel", {"V_BF16": False, "COUNT": False},
                              lambda meta, g=scatter: grid_programs(g, meta))
        else:
            tile = Launch("topk", "topk_decode_tile_kernel", {**decode, "GROUP": group}, lambda meta: tiles,
                          (cdiv(world, group),) + (0,) * group, scatter=(world * k, 4 * declared.DECODE_TILE),
                          scatter_loads=("LDG.EL.32",))
            fallback = Launch("topk", "scatter_add_kernel", {"V_BF16": False, "COUNT": False},
                              lambda meta, g=topk.fallback_grid(k, world): grid_programs(g, meta), (0,))
        out.append(Row("topk", f"decode-sum p={world}", n, [
            Launch("topk", "topk_check_kernel", {"TILE": declared.DECODE_TILE},
                   lambda meta, g=check: grid_programs(g, meta), (1,)),
            tile, fallback],
            declared.scatter_add_sum_bytes(n, k, world, 4, 4), (("zeros", 1),)))
    return out


FROZEN = {"532ad50": {"topk": topk_rows_532ad50, "powersgd": powersgd_row_532ad50}}
"""Row builders of a commit whose launches differ from the working tree's (by short hash): what
--commit validates there; the working tree (and any other commit) uses the current builders."""


# ---- the model ---------------------------------------------------------------------------------

def blocks_per_sm(resources: dict) -> int:
    """Resident blocks per SM from registers (allocated per warp in units of 256), warps, shared."""
    per_warp = cdiv(resources["registers"] * 32, 256) * 256
    warps = min(MAX_WARPS, REGISTERS // per_warp) if per_warp else MAX_WARPS
    shared = resources["shared"]
    by_shared = SHARED_BYTES // (shared + SHARED_RESERVED) if shared else MAX_BLOCKS
    return max(1, min(MAX_BLOCKS, warps // resources["warps"], by_shared))


def predict_launch(tree: Tree, launch: Launch, device: Device) -> dict:
    """The fastest config's floors (seconds) of one launch, with what decided them: pipes and
    latency from the SASS; atomics and the scatter's L2 misses from the row's annotations. Bytes
    come later (:func:`predict`: the row's declared bytes shared out by each launch's SASS bytes)."""
    best = None
    for case, constexprs in tree.configs(launch.family, launch.kernel, launch.constexprs):
        compiled = tree.compile(case, constexprs, launch.unaligned)
        trips = tuple(t(constexprs) if callable(t) else t for t in launch.loops)
        programs = launch.programs(constexprs)
        resident = blocks_per_sm(compiled)
        miss, extra_bytes, scattered = 0.0, 0.0, 0.0
        if launch.scatter:
            accesses, open_bytes = launch.scatter
            footprint = min(programs, device.sms * resident) * open_bytes
            miss = max(0.0, 1 - device.l2_bytes / footprint)
            extra_bytes = accesses * miss * (MISS_BYTES - 8)
            # a load and a store per access, 32 / SCATTER_TAGS wavefronts a warp instruction
            # where the SASS count gives one
            scattered = 2 * accesses / 32 * (32 / SCATTER_TAGS - 1)
        hits = launch.l2_hits + (launch.scatter_loads if miss == 0 else ())
        try:
            counts = pipe_counts(compiled["sass"], trips)
            cycles = warp_cycles(compiled["sass"], trips, MEMORY_LATENCY_CYCLES, hits)
        except ValueError as error:
            raise ValueError(f"{launch.kernel} [{case.name}]: {error}: update the rows in "
                             "benchmarks/roofline.py") from None
        per_sm = cdiv(programs, device.sms) * compiled["warps"]  # warp-programs on the busiest SM
        pipes = {pipe: counts[pipe] * per_sm / (rate * device.clock_hz) for pipe, rate in PIPES.items()}
        pipes["lsu"] += scattered / device.sms / (PIPES["lsu"] * device.clock_hz)
        waves = programs / (device.sms * resident)
        latency = math.ceil(waves) * cycles / device.clock_hz
        atomics_s = 0.0
        if launch.atomics:
            streams = launch.atomics if isinstance(launch.atomics[0], tuple) else (launch.atomics,)
            streams = [tuple(a(constexprs) if callable(a) else a for a in stream) for stream in streams]
            atomics_s = max(sum(count for count, _ in streams) / ATOMIC_RATE,
                            max(count / addresses for count, addresses in streams)
                            * ATOMIC_SERIAL_CYCLES / device.clock_hz)
        bound = max(pipes, key=pipes.get)
        result = {"kernel": launch.kernel, "config": case.name, "programs": programs,
                  "warps": compiled["warps"], "registers": compiled["registers"],
                  "shared": compiled["shared"], "spills": compiled["local"], "blocks_per_sm": resident,
                  "waves": waves, "pipe_s": pipes, "pipe": bound, "latency_s": latency, "warp_cycles": cycles,
                  "atomics_s": atomics_s, "l2_miss": miss, "extra_bytes": extra_bytes,
                  "instr_s": max(pipes[bound], latency, atomics_s),
                  "atomics": counts["atomics"] * programs * compiled["warps"],
                  "sass_bytes": counts["global_bytes"] * programs * compiled["warps"],
                  "per_warp": {k: counts[k] for k in PIPES}, "memory_ops": counts["memory_ops"],
                  "repeat": launch.repeat, "unaligned": list(launch.unaligned)}
        if best is None or result["instr_s"] < best["instr_s"]:
            best = result
    return best


def bound(launch: dict) -> str:
    """What bounds a launch: bytes, atomics, latency or its busiest pipe."""
    floors = {"bytes": launch["bytes_s"], "atomics": launch["atomics_s"], "latency": launch["latency_s"],
              launch["pipe"]: launch["pipe_s"][launch["pipe"]]}
    return max(floors, key=floors.get)


def predict(tree: Tree, row: Row, device: Device, copy_gbps: float) -> dict:
    """A row's time: its launches one after another, each the largest of its floors (its share
    of the row's declared bytes, plus its scatter's L2 misses, over the copy bandwidth; its
    busiest pipe; one warp's path times the waves; its atomics) plus LAUNCH_S, and LAUNCH_S per
    torch op. The declared bytes are shared out in proportion to each launch's global bytes in
    its SASS (every lane of every load and store: an upper bound under masks), so the row's
    bytes are the declared total, never more or less."""
    launches = [predict_launch(tree, launch, device) for launch in row.launches]
    sass_total = sum(l["sass_bytes"] * l["repeat"] for l in launches)
    for l in launches:
        share = l["sass_bytes"] / sass_total if sass_total else 1 / sum(x["repeat"] for x in launches)
        l["declared_bytes"] = row.declared_bytes * share
        l["bytes_s"] = (l["declared_bytes"] + l["extra_bytes"]) / (copy_gbps * 1e9)
        l["time_s"] = max(l["bytes_s"], l["instr_s"]) + LAUNCH_S
        l["bound"] = bound(l)
    torch_launches = sum(c for _, c in row.torch_ops)
    count = sum(l["repeat"] for l in launches) + torch_launches
    total = sum(l["time_s"] * l["repeat"] for l in launches) + torch_launches * LAUNCH_S
    bytes_s = row.declared_bytes / (copy_gbps * 1e9)
    slowest = max(launches, key=lambda l: l["time_s"] * l["repeat"])
    return {"method": row.method, "op": row.op, "n": row.n, "declared_bytes": row.declared_bytes,
            "bytes_ms": 1e3 * bytes_s, "instr_ms": 1e3 * sum(l["instr_s"] * l["repeat"] for l in launches),
            "launches": count, "launch_ms": 1e3 * count * LAUNCH_S, "predicted_ms": 1e3 * total,
            "bound": slowest["bound"] if len(launches) == 1 else f"{slowest['kernel']}: {slowest['bound']}",
            "torch_ops": [list(op) for op in row.torch_ops], "kernels": launches}


def explain(p: dict, measured_ms: float) -> str:
    """What the model leaves out of a row that misses by more than MISS (empty when it does not):
    the costs it does not count, not a fit."""
    ratio = p["predicted_ms"] / measured_ms
    if abs(ratio - 1) <= MISS:
        return ""
    reasons = []
    slowest = max(p["kernels"], key=lambda l: l["time_s"] * l["repeat"])
    reasons.append(f"largest launch {slowest['kernel']} {1e3 * slowest['time_s'] * slowest['repeat']:.3f} ms "
                   f"({slowest['bound']})")
    if any(l["atomics_s"] for l in p["kernels"]):
        reasons.append("atomics at ATOMIC_RATE and one cycle per same-address atomic (both optimistic for "
                       "an L2-resident histogram: not measured)")
    if any(l["l2_miss"] for l in p["kernels"]):
        reasons.append("scattered read-modify-writes: L2 miss latency under load not modelled")
    if p["torch_ops"]:
        reasons.append("torch ops' work not modelled (" + "; ".join(name for name, _ in p["torch_ops"]) + ")")
    if p["launches"] >= 10:
        reasons.append(f"{p['launches']} launches: host time between them not modelled beyond "
                       f"{LAUNCH_S * 1e6:.0f} us each")
    return "; ".join(reasons)


# ---- measured rows and the command ---------------------------------------------------------------

def measurements(commit: str | None, device: Device, files: list[str] | None = None
                 ) -> tuple[float, dict, list[str]]:
    """(copy GB/s, {(row name, n): [(kernel ms, declared bytes), ...]}, the files read): the rows
    of ``files`` (default: the device's results files named after ``commit``, none for the
    working tree); the copy bandwidth is the mean of those files' own ``copy_gbps`` (measured in
    the same runs), else of every results file of the device, else the device's preset."""
    every = sorted(glob.glob(str(REPO / device.results)))
    if files is None:
        files = [f for f in every if commit is not None and f"_{commit}" in Path(f).name]
    else:
        files = [str(REPO / f) if not Path(f).is_absolute() else f for f in files]
    runs = [json.loads(Path(f).read_text()) for f in files]
    copies = [run["copy_gbps"] for run in runs] or [json.loads(Path(f).read_text())["copy_gbps"] for f in every]
    copy = statistics.mean(copies) if copies else device.copy_gbps
    measured = {}
    for run in runs:
        for r in run["rows"]:
            measured.setdefault((f"{r['method']} {r['op']}", r["n"]), []).append(
                (r["kernel_ms"], r["declared_bytes"]))
    return copy, measured, [str(Path(f).relative_to(REPO)) if Path(f).is_relative_to(REPO) else f for f in files]


KERNEL_TIMES = {"d75eb4b": "benchmarks/results/gpu_h200_d75eb4b/kernel_times.txt"}
"""Per-kernel CUDA times (torch.profiler, bench_gpu --kernel-times) measured with a commit's kernels."""


def kernel_times(path: Path) -> dict:
    """{(row name, n): {kernel name: us a call}} from bench_gpu --kernel-times' text."""
    out, current = {}, None
    for line in path.read_text().splitlines():
        head = re.match(r"^(\w+)/(.+)/(\d+): [\d.]+ us of kernels a call$", line)
        if head:
            current = out.setdefault((f"{head.group(1)} {head.group(2)}", int(head.group(3))), {})
            continue
        cells = line.split()
        if current is not None and len(cells) >= 3 and re.fullmatch(r"[\d.]+", cells[-1]) and cells[-2].isdigit():
            name = " ".join(cells[:-2])
            current[name] = current.get(name, 0.0) + float(cells[-1])
    return out


def run(commit: str | None, smoke: bool, n: int = SIZES["100M"], device: str = "H100",
        files: list[str] | None = None) -> dict:
    """Every row at n (``smoke``: SMOKE's only) predicted on ``device``, against the measured
    rows (:func:`measurements`) by the validation rule: measured = the slower of the runs (the
    prediction is not a floor to be met by the luckiest run), declared bytes equal to the row's
    (a row whose launch differs raises)."""
    spec = DEVICES[device]
    with contextlib.ExitStack() as stack:
        tree = Tree(commit, stack)
        copy, measured, used = measurements(tree.commit, spec, files)
        timed = KERNEL_TIMES.get(tree.commit)
        profiled_times = kernel_times(REPO / timed) if timed and used and files is None else {}
        out = []
        for row in rows(tree, n):
            if smoke and row.name not in SMOKE:
                continue
            p = predict(tree, row, spec, copy)
            times = measured.get((row.name, row.n))
            if times:
                if any(b != row.declared_bytes for _, b in times):
                    raise ValueError(f"{row.name}: declared bytes {row.declared_bytes}, measured with "
                                     f"{sorted({b for _, b in times})}: the row is not the measured launch")
                p["measured_ms"] = max(t for t, _ in times)  # the slower run
                p["measured_runs_ms"] = [t for t, _ in times]
                p["ratio"] = p["predicted_ms"] / p["measured_ms"]
                p["why"] = explain(p, p["measured_ms"])
                host = [r.get("host_ms") for f in used for r in json.loads((REPO / f).read_text())["rows"]
                        if f"{r['method']} {r['op']}" == row.name and r["n"] == row.n and r.get("host_ms")]
                if host and max(host) >= 0.8 * p["measured_ms"] and p["why"]:
                    p["why"] = (f"host-bound: the bench's host time {max(host):.3f} ms a call (not modelled); "
                                + p["why"])
            profiled = next((v for (name, size), v in profiled_times.items()  # PowerSGD: keyed by its size
                             if name == row.name and abs(size - row.n) <= 0.01 * row.n), None)
            if profiled:
                for l in p["kernels"]:
                    name = l["kernel"]
                    if name in profiled:
                        l["profiled_us"] = profiled[name]
            out.append(p)
    ratios = [p["ratio"] for p in out if "ratio" in p]
    summary = {}
    if ratios:
        misses = [abs(r - 1) for r in ratios]
        summary = {"rows": len(ratios), "median_miss": statistics.median(misses), "max_miss": max(misses),
                   "within": sum(m <= MISS for m in misses), "optimistic": sum(r < 1 for r in ratios),
                   "median_ratio": statistics.median(ratios)}
    return {"commit": tree.commit or "working tree", "device": device, "copy_gbps": copy, "results": used,
            "model": {"sms": spec.sms, "clock_hz": spec.clock_hz, "l2_bytes": spec.l2_bytes, "pipes": PIPES,
                      "launch_s": LAUNCH_S, "memory_latency_cycles": MEMORY_LATENCY_CYCLES,
                      "atomic_rate": ATOMIC_RATE, "miss_bytes": MISS_BYTES},
            "rows": out, "summary": summary}


def table(report: dict, detail: bool) -> str:
    """The rows (and against their measurements), then every row's launches one after another."""
    from tabulate import tabulate

    headers = ["row", "bytes ms", "launches", "predicted ms", "of copy", "slowest launch: bound"]
    validated = any("measured_ms" in p for p in report["rows"])
    if validated:
        headers += ["measured ms (slower run)", "pred/meas", "not modelled (misses > 25%)"]
    body = []
    for p in report["rows"]:
        line = [f"{p['method']} {p['op']}", f"{p['bytes_ms']:.3f}", p["launches"], f"{p['predicted_ms']:.3f}",
                f"{p['bytes_ms'] / p['predicted_ms']:.2f}", p["bound"]]
        if validated:
            line += ([f"{p['measured_ms']:.3f}", f"{p['ratio']:.2f}", p["why"]] if "measured_ms" in p
                     else ["", "", ""])
        body.append(line)
    text = tabulate(body, headers=headers, disable_numparse=True)
    if report["summary"]:
        s = report["summary"]
        text += (f"\n{s['within']} of {s['rows']} rows within {MISS:.0%} (measured: the slower run); "
                 f"{s['optimistic']} predicted faster than measured; median pred/meas {s['median_ratio']:.2f}, "
                 f"median miss {s['median_miss']:.1%}, max {s['max_miss']:.0%}")
    body = []
    for p in report["rows"]:
        for l in p["kernels"]:
            body.append([f"{p['method']} {p['op']}", l["config"] + (" unaligned " + ",".join(l["unaligned"])
                                                                      if l["unaligned"] else ""),
                         f"x{l['repeat']}" if l["repeat"] > 1 else "", l["programs"],
                         f"{1e3 * l['bytes_s']:.3f}", f"{1e3 * l['pipe_s'][l['pipe']]:.3f} {l['pipe']}",
                         f"{1e3 * l['latency_s']:.3f}", f"{1e3 * l['atomics_s']:.3f}" if l["atomics_s"] else "",
                         f"{l['l2_miss']:.2f}" if l["l2_miss"] else "", f"{1e3 * l['time_s']:.3f}", l["bound"]])
    text += "\n\nper launch, one after another (each: the largest floor + the launch):\n" + tabulate(
        body, headers=["row", "kernel config", "repeat", "programs", "bytes ms", "busiest pipe ms", "latency ms",
                       "atomics ms", "L2 miss", "launch ms", "bound"], disable_numparse=True)
    body = []
    for p in report["rows"]:
        named = {}
        for l in p["kernels"]:
            if "profiled_us" in l:
                named.setdefault(l["kernel"], [0.0, l["profiled_us"]])[0] += 1e6 * l["time_s"] * l["repeat"]
        for kernel, (predicted, profiled) in named.items():
            body.append([f"{p['method']} {p['op']}", kernel, f"{predicted:.1f}", f"{profiled:.1f}",
                         f"{predicted / profiled:.2f}"])
    if body:
        text += ("\n\nper kernel against its CUDA time (torch.profiler, "
                 + KERNEL_TIMES[report["commit"]] + "; launches of one kernel summed):\n"
                 + tabulate(body, headers=["row", "kernel", "predicted us", "profiled us", "pred/prof"],
                            disable_numparse=True))
    if detail:
        body = []
        for p in report["rows"]:
            for l in p["kernels"]:
                body.append([f"{p['method']} {p['op']}", l["config"], l["programs"], l["registers"],
                             l["blocks_per_sm"], f"{l['waves']:.1f}", f"{l['warp_cycles']:.0f}",
                             f"{32 * l['per_warp']['issue'] * l['warps'] * l['programs'] / p['n']:.2f}"]
                            + [f"{1e3 * l['pipe_s'][pipe]:.3f}" for pipe in PIPES]
                            + [" ".join(f"{k}:{v:g}" for k, v in sorted(l["memory_ops"].items()))])
        text += "\n\n" + tabulate(body, headers=["row", "kernel config", "programs", "regs", "blocks/SM",
                                                  "waves", "warp cycles", "instr/element"]
                                  + [f"{pipe} ms" for pipe in PIPES]
                                  + ["memory ops per warp (opcode.bits: count)"], disable_numparse=True)
    model = report["model"]
    return (f"{report['device']} roofline of {report['commit']}'s kernels: copy {report['copy_gbps']:.0f} GB/s "
            f"({', '.join(report['results']) or 'the device results mean'}), {model['sms']} SMs at "
            f"{model['clock_hz'] / 1e9:.2f} GHz, L2 {model['l2_bytes'] / 2**20:.0f} MB, "
            f"{LAUNCH_S * 1e6:.0f} us a launch\n" + text)


BLIND = {"commit": "d75eb4b", "results": "benchmarks/results/bench_gpu_h200_d75eb4b.json", "device": "H200"}
"""The blind check: the roofline as committed at ``commit`` (benchmarks/roofline.py of that
commit, read from git, written before any GPU had run its kernels) predicting that commit's
kernels on the rows of ``results`` (their first GPU run, an H200)."""


def blind(sizes: tuple[str, ...] = ("100M", "16M")) -> dict:
    """The blind table, by this rule (written before it was computed): the roofline module of
    BLIND's commit unchanged, its kernels' SASS, the copy bandwidth measured in the results
    file's own run (its ``copy_gbps``), the H200's 132 SMs at 1.98 GHz (the module's constants,
    the same as the H100's); every row that module predicts at ``sizes`` (the GPT-2 block once)
    against the one measured time of that row; a row is within if |pred/meas - 1| <= MISS.
    The module knows no L2, so the H200's 60 MB plays no part. Rows the module does not predict
    (bench_gpu's hook-layout rows) are listed as not predicted."""
    measured = json.loads((REPO / BLIND["results"]).read_text())
    copy = measured["copy_gbps"]
    by_row = {(f"{r['method']} {r['op']}", r["n"]): r for r in measured["rows"]}
    source = subprocess.run(["git", "show", f"{BLIND['commit']}:benchmarks/roofline.py"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    out, seen = [], set()
    with contextlib.ExitStack() as stack:
        path = Path(stack.enter_context(tempfile.TemporaryDirectory())) / f"roofline_{BLIND['commit']}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        module.REPO = REPO  # its git commands run in this repository
        device = DEVICES[BLIND["device"]]
        if (module.SMS, module.CLOCK_HZ) != (device.sms, device.clock_hz):
            raise ValueError(f"{BLIND['commit']}'s roofline models {module.SMS} SMs at {module.CLOCK_HZ} Hz, "
                             f"not the {BLIND['device']}'s")
        tree = module.Tree(BLIND["commit"], stack)
        for size in sizes:
            for row in module.rows(tree, SIZES[size]):
                key = (row.name, row.n)
                if key in seen:
                    continue
                seen.add(key)
                p = module.predict(tree, row, copy)
                m = by_row[key]
                out.append({"row": row.name, "n": row.n, "bound": p["bound"], "bytes_ms": p["bytes_ms"],
                            "instr_ms": p["instr_ms"], "launches": p["launches"],
                            "predicted_ms": p["predicted_ms"], "measured_ms": m["kernel_ms"],
                            "ratio": p["predicted_ms"] / m["kernel_ms"],
                            "declared_bytes": row.declared_bytes, "measured_declared_bytes": m["declared_bytes"]})
    return blind_summary(out, copy, sorted(set(by_row) - seen))


def blind_summary(rows_: list[dict], copy: float, unpredicted: list) -> dict:
    """The blind table's counts: within MISS, optimistic (predicted faster than measured)."""
    ratios = [r["ratio"] for r in rows_]
    return {"commit": BLIND["commit"], "results": BLIND["results"], "device": BLIND["device"], "copy_gbps": copy,
            "rows": rows_, "not_predicted": [f"{name} n={n}" for name, n in unpredicted],
            "summary": {"rows": len(ratios), "within": sum(abs(r - 1) <= MISS for r in ratios),
                        "optimistic": sum(r < 1 for r in ratios),
                        "optimistic_misses": sum(r < 1 - MISS for r in ratios),
                        "pessimistic_misses": sum(r > 1 + MISS for r in ratios),
                        "median_ratio": statistics.median(ratios)}}


def blind_table(report: dict) -> str:
    from tabulate import tabulate

    body = [[r["row"], f"{r['n'] / 1e6:.1f}M", r["bound"], f"{r['bytes_ms']:.3f}", f"{r['instr_ms']:.3f}",
             r["launches"], f"{r['predicted_ms']:.3f}", f"{r['measured_ms']:.3f}", f"{r['ratio']:.2f}",
             "yes" if abs(r["ratio"] - 1) <= MISS else ("optimistic" if r["ratio"] < 1 else "pessimistic")]
            for r in report["rows"]]
    s = report["summary"]
    return (f"Blind check: the roofline of {report['commit']} (its own file), {report['device']} copy "
            f"{report['copy_gbps']:.0f} GB/s measured in the same run, against {report['results']}\n"
            + tabulate(body, headers=["row", "n", "bound", "bytes ms", "instr ms", "launches", "predicted ms",
                                      "measured ms", "pred/meas", "within 25%"], disable_numparse=True)
            + f"\n{s['within']} of {s['rows']} rows within {MISS:.0%}; {s['optimistic']} predicted faster than "
              f"measured ({s['optimistic_misses']} optimistic misses, {s['pessimistic_misses']} pessimistic); "
              f"median pred/meas {s['median_ratio']:.2f}\nnot predicted: {', '.join(report['not_predicted'])}")


def build_parser() -> argparse.ArgumentParser:
    """The command line (standard library only: parsed before the heavy imports)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--commit", help="predict this commit's kernels (and compare with its measured rows: "
                                         "the device's results files named after it)")
    parser.add_argument("--device", choices=DEVICES, default="H100", help="the device preset (default H100)")
    parser.add_argument("--results", nargs="+", help="compare with these bench_gpu JSON files instead")
    parser.add_argument("--smoke", action="store_true",
                        help=f"seconds: rows {', '.join(SMOKE)} of {VALIDATED}'s kernels (unless --commit), "
                             "validated")
    parser.add_argument("--size", choices=SIZES, default="100M", help="bench_gpu's rows of this size")
    parser.add_argument("--detail", action="store_true", help="also each launch's pipes, registers, waves and "
                                                              "memory ops")
    parser.add_argument("--blind", action="store_true",
                        help=f"the blind check: {BLIND['commit']}'s own roofline against {BLIND['results']}")
    parser.add_argument("--json", help="write the report as JSON to this path")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.blind:
        report = blind()
        print(blind_table(report))
    else:
        commit = args.commit or (VALIDATED if args.smoke else None)
        report = run(commit, args.smoke, SIZES[args.size], args.device, args.results)
        print(table(report, args.detail))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
