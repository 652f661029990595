"""What the kernels declare, without triton: the GPU tiles the declared bytes depend on and the
global-memory bytes every launcher moves (``*_bytes``).

Plain integers and integer arithmetic, importable where triton is not installed (macOS, Windows):
the methods' ``declared_bytes``, which the analyser's GPU presets (gradcomp.analysis.profile) and
the traffic accounting charge, work on any machine. The one place of these formulas and tiles:
callers reach them here (``gradcomp.kernels.declared.ef_cast_bytes``, ``from .declared import``);
the family modules (gradcomp.kernels.cast, ...) import only the tiles and helpers their own code
uses (their ``triton.Config`` lists are built from the tiles here). A launcher's ":func:"
references below name the family module's function.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (``triton.cdiv``)."""
    return -(-a // b)


# ---- cast: fp16 / bf16 ----------------------------------------------------------------------

def ef_cast_bytes(n: int, x_itemsize: int, has_residual: bool) -> int:
    """Declared global-memory bytes of :func:`.cast.ef_cast`: read x, write 2-byte values, and
    with error feedback read + write the fp32 residual."""
    return n * (x_itemsize + 2 + (8 if has_residual else 0))


def cast_decode_sum_bytes(n: int, world: int, out_itemsize: int, addend_itemsize: int = 0) -> int:
    """Declared global-memory bytes of :func:`.cast.cast_decode_sum`: every rank's values once,
    the addend once (``addend_itemsize`` 0: none), out once."""
    return n * (2 * world + addend_itemsize + out_itemsize)


# ---- quant: int8 / int4 ---------------------------------------------------------------------

def ef_quantize_bytes(n: int, block: int, levels: int, x_itemsize: int, has_residual: bool) -> int:
    """Declared global-memory bytes of :func:`.quant.ef_quantize`: read x, write codes and
    scales, and with error feedback read + write the fp32 residual."""
    codes = cdiv(n, 2) if levels == 7 else n
    return n * (x_itemsize + (8 if has_residual else 0)) + codes + 4 * cdiv(n, block)


def dequantize_sum_bytes(n: int, block: int, levels: int, world: int, out_itemsize: int,
                         addend_itemsize: int = 0) -> int:
    """Declared global-memory bytes of :func:`.quant.dequantize_sum`: each rank's codes and
    scales once, the addend once (``addend_itemsize`` 0: none), the output once."""
    codes = cdiv(n, 2) if levels == 7 else n
    return world * (codes + 4 * cdiv(n, block)) + n * (addend_itemsize + out_itemsize)


# ---- sign -----------------------------------------------------------------------------------

SIGN_GROUP = 4
"""Ranks a sign decode-sum adds up as one group: each group's decoded values are summed in rank
order, then each group's sum is added to the total in group order (``Sign.decode_sum``), on the
kernel and the torch path alike."""


def ef_sign_bytes(n: int, chunk: int, x_itemsize: int, has_residual: bool) -> int:
    """Declared global-memory bytes of :func:`.sign.ef_sign`: read x, write bits and scales, and
    with error feedback read + write the fp32 residual."""
    return (n * (x_itemsize + (8 if has_residual else 0)) + cdiv(n, 8)
            + 4 * cdiv(n, chunk))


def sign_decode_sum_bytes(n: int, chunk: int, world: int, out_itemsize: int,
                          addend_itemsize: int = 0) -> int:
    """Declared global-memory bytes of :func:`.sign.sign_decode_sum`: each rank's bits and scales
    once, the addend once (``addend_itemsize`` 0: none), the output once."""
    return (world * (cdiv(n, 8) + 4 * cdiv(n, chunk))
            + n * (addend_itemsize + out_itemsize))


# ---- topk -----------------------------------------------------------------------------------

TOPK_TILES = ((2048, 4), (4096, 8))
"""(BLOCK, num_warps) of each GPU config of the top-k kernels (``gradcomp.kernels.topk.CONFIGS``)."""
MIN_CAPACITY = 4096
"""Candidate slots beyond 2k (:func:`candidate_capacity`)."""
DECODE_TILE = 1 << 12
"""Outputs each program of the top-k tile decode owns (``gradcomp.kernels.topk.DECODE_CONFIGS``):
16 KB of fp32, so that the open tiles of every resident program (16 blocks of DECODE_WARPS warps
on each of 132 SMs: 34.6 MB) stay in an H100's 50 MB L2 while every rank is added to them."""
DECODE_WARPS = 4
"""Warps of a tile decode program: 32 x DECODE_WARPS = 128 lanes, the smallest decode_chunk."""
DECODE_GROUP = 4
"""Ranks whose bounds and first chunk of entries the tile decode loads at once."""
FALLBACK_SPLIT = 16
"""Programs per rank of the decode's atomic fallback (at most; each loops over every
FALLBACK_SPLIT-th block of its rank, and stops at once for a checked rank)."""
HIGH_BUCKETS, LOW_BUCKETS = 1 << 15, 1 << 16
"""Radix select histograms: key bits 30..16 (the top level), then bits 15..0 within its bucket."""
SCAN_CHUNK = 1 << 12
"""Buckets per chunk of the top-k radix scans (``gradcomp.kernels.topk.SCAN_CONFIG``, the same
interpreted): every chunk's sum, then the boundary's chunk read again."""
TOPK_RUN = 2048
"""Elements of x per run: the candidate pass records, per run, where its candidates start in the
buffer and how many there are (every TOPK_TILES block is a multiple)."""
TOPK_GROUP, TOPK_LANES = 16, 32
"""Runs per program of the select kernels, and (on GPUs) entries of each run per step."""
MAX_SAMPLE = 4096
"""The most elements the kernels' sampled threshold is drawn from (one program holds them)."""


def decode_chunk(n: int, k: int) -> int:
    """Entries per step of the tile decode: the power of two just above the entries of one rank
    a tile holds on average (k * DECODE_TILE / n) plus a quarter and 16, so that one step usually
    covers them, from 32 x DECODE_WARPS (no lane held twice) to 256 (the four ranks' first
    chunks held at once stay in registers: no spills on sm_80 with triton 3.6 or 3.9; denser
    tiles take more steps)."""
    mean = cdiv(k * DECODE_TILE, max(n, 1))
    return min(256, max(32 * DECODE_WARPS, 1 << (mean + mean // 4 + 16 - 1).bit_length()))


def candidate_capacity(n: int, k: int) -> int:
    """Candidate buffer size: twice k plus slack (a sampled threshold overshoots k by ~5-15%)."""
    return min(n, 2 * k + MIN_CAPACITY)


def ef_topk_bytes(n: int, k: int, candidates: int, x_itemsize: int, has_residual: bool,
                  block: int, sample: int, in_bucket: int | None = None) -> int:
    """Declared global-memory bytes of :func:`.topk.ef_topk` (finite input; ``sample`` elements
    sampled, 0 for none) when ``candidates`` elements pass the sampled threshold. The select
    kernels read the candidates when k <= candidates <= :func:`candidate_capacity`, else c itself
    (the residual: 4, or x: itemsize, per element). ``in_bucket``: the keys they read whose top
    15 bits are the boundary bucket's (default candidates // 16, the estimate of bench_gpu and
    the analyser: a smooth gradient's top 1% spreads over some 20 buckets).

    Sample: zero the top histogram's two parts (2 x 2^15 buckets, 4 each) and the 8-int counter
    (32); read x and the residual at the sample's distinct positions; write the threshold (4).
    Candidate pass: read x; with error feedback read the residual and write c into it; per
    program of ``block`` elements the threshold (4) and one atomic (8); per candidate (every
    element that passes) one atomic into the top histogram (8), and per stored one (at most the
    capacity) c and its index (8); per run of TOPK_RUN elements its first slot and count (8).
    Rest of the top histogram (one program per TOPK_GROUP runs): the count (4); only where the
    candidates missed the top k, the threshold (4), c per element and an atomic per key below
    the threshold (8). Per select kernel over the runs (low histogram, count, write: one
    program per TOPK_GROUP runs) the count (4), per run its first slot and count (8, read
    whatever the count), and per candidate its c (4), or c per element where they missed. High
    scan: read the two parts (8 per bucket) and the boundary's chunk of SCAN_CHUNK again, write B
    and its count (8), zero the 2^16 low buckets. Low histogram: B per program (4), an atomic
    per key in B (8). Low scan: read B and its count (8), the 2^16 buckets and the boundary's
    chunk again, write T and G (8). Count: T per program (4); write per
    run its tally (8) and per program the sum (8). Tally scan: read and write each program's
    sum (16). Write: T, G and the program's prefix per program (16), each run's tally (8), per
    candidate also its index (4); per sent entry the value (itemsize) and index (4), and with
    error feedback the residual (4: the sent value is rounded in registers, not read back).
    """
    runs = cdiv(n, TOPK_RUN)
    programs = cdiv(runs, TOPK_GROUP)
    stored = min(candidates, candidate_capacity(n, k))
    missed = not k <= candidates <= candidate_capacity(n, k)
    in_bucket = candidates // 16 if in_bucket is None else in_bucket
    source = 4 if has_residual else x_itemsize
    sampled = 8 * HIGH_BUCKETS + 32 + sample * (x_itemsize + (4 if has_residual else 0)) + 4
    stream = (n * (x_itemsize + (8 if has_residual else 0)) + 12 * cdiv(n, block) + 8 * candidates
              + 8 * stored + 8 * runs)
    rest = 4 * programs + ((4 * programs + n * source + 8 * (n - candidates)) if missed else 0)
    # one select kernel's reads of its runs: the count, the run table, the candidates' keys or c
    over = 4 * programs + 8 * runs + (n * source if missed else 4 * candidates)
    high_scan = 8 * HIGH_BUCKETS + 8 * SCAN_CHUNK + 8 + 4 * LOW_BUCKETS
    low = over + 4 * programs + 8 * in_bucket
    low_scan = 8 + 4 * LOW_BUCKETS + 4 * SCAN_CHUNK + 8
    count = over + 4 * programs + 8 * runs + 8 * programs
    tally_scan = 16 * programs
    write = (over + 16 * programs + 8 * runs + (0 if missed else 4 * candidates)
             + k * (x_itemsize + 4) + (4 * k if has_residual else 0))
    return sampled + stream + rest + high_scan + low + low_scan + count + tally_scan + write


def scatter_add_sum_bytes(n: int, k: int, world: int, value_itemsize: int,
                          out_itemsize: int, addend_itemsize: int = 0, bad_ranks: int = 0) -> int:
    """Declared global-memory bytes of :func:`.topk.scatter_add_sum` for ``world`` payloads of k
    entries, all but ``bad_ranks`` of them with strictly increasing indices in [0, n) (those
    ranks' indices in [0, n) but unsorted or repeated: the atomic fallback adds them).

    The per-rank flags zeroed (4 each). Check (one program per ``TOPK_TILES[0]`` block of k + 1
    per rank): read every index (4) and, for every block but a rank's first, the index before
    it (4); write the tiles + 1 = cdiv(n, DECODE_TILE) + 1 tile bounds of a sorted rank (4);
    for a failed rank, one atomic add to its flag (8) per block, taking every block to fail and
    write no bounds (a failed rank's passing blocks would write some). Tile decode: write the fp32 start (and read the addend once:
    ``addend_itemsize``, 0 for none); per tile and rank the flag and the two bounds (12), and
    for a sorted rank per entry the index (4) and value read and one fp32 read-modify-write of
    the output (8). Fallback (min(FALLBACK_SPLIT, cdiv(k, ``TOPK_TILES[0]``)) programs per
    rank): every program reads its rank's flag (4); a failed rank's programs read its values
    and indices and add each by an fp32 atomic read-modify-write (8). A final cast when the
    output is not fp32."""
    block = TOPK_TILES[0][0]
    tiles = cdiv(n, DECODE_TILE)
    blocks = cdiv(k, block)
    entry = value_itemsize + 4 + 8
    good = world - bad_ranks
    check = (world * (4 * k + 4 * (cdiv(k + 1, block) - 1)) + 4 * good * (tiles + 1)
             + 8 * bad_ranks * cdiv(k + 1, block))
    decode = n * (addend_itemsize + 4) + 12 * world * tiles + good * k * entry
    fallback = 4 * world * min(FALLBACK_SPLIT, blocks) + bad_ranks * k * entry
    cast = n * (4 + out_itemsize) if out_itemsize != 4 else 0
    return 4 * world + check + decode + fallback + cast


# ---- powersgd -------------------------------------------------------------------------------

MATMUL_TILES = ((64, 64, 4),)
"""(BLOCK_N, BLOCK_M, num_warps) of the GPU config of the PowerSGD matmul kernels
(``gradcomp.kernels.powersgd.MATMUL_CONFIGS``): one, as the run tables are made for one tile."""
RUN_FIELDS = 11
"""int64 fields of one run in the matmul kernels' run table (gradcomp.kernels.powersgd._run)."""
TABLE_BYTES = 4 + 8 * RUN_FIELDS
"""What each program of a matmul kernel reads of the tables: its run (int32) and that run's
fields."""
TARGET_PROGRAMS = 4 * 132
"""``ef_matmul`` splits a matrix's columns until it has this many programs (4 per SM of a 132-SM
H100), as long as every split keeps MIN_SPLIT_COLUMNS columns."""
MIN_SPLIT_COLUMNS = 512
"""Columns of one ``ef_matmul`` split at least (8 GPU tiles of BLOCK_M = 64): each split costs
one fp32 atomic add to P per row, 8 r bytes per row, so splits add at most 8 r / 512 = r / 64
bytes per element (1/3% of the 24 at rank 4)."""


def matmul_splits(n: int, m: int, block_n: int) -> int:
    """Column splits of one [n, m] matrix in ``ef_matmul``: enough for TARGET_PROGRAMS programs
    (row blocks x splits), each split at least MIN_SPLIT_COLUMNS wide; 1 <= splits <=
    TARGET_PROGRAMS.
    Independent of the batch, so each matrix's declared bytes are its own."""
    row_blocks = cdiv(n, block_n)
    return max(1, min(m // MIN_SPLIT_COLUMNS, cdiv(TARGET_PROGRAMS, row_blocks)))


def run_programs(kind: str, k: int, n: int, m: int, block_n: int, block_m: int) -> tuple[int, int, int]:
    """(programs, splits, split length) of a run of k [n, m] matrices in the ``kind`` matmul
    kernel ("ef_matmul": row blocks x column splits; "transpose_matmul": column blocks x row
    splits; "residual_update": row blocks x column blocks, splits 1). Split lengths are
    multiples of 16, so that a split's first column keeps the alignment of the row."""
    if kind == "ef_matmul":
        splits = matmul_splits(n, m, block_n)
        return k * cdiv(n, block_n) * splits, splits, 16 * cdiv(m, 16 * splits)
    if kind == "transpose_matmul":
        splits = matmul_splits(m, n, block_m)
        return k * cdiv(m, block_m) * splits, splits, 16 * cdiv(n, 16 * splits)
    if kind == "residual_update":
        return k * cdiv(n, block_n) * cdiv(m, block_m), 1, m
    raise ValueError(f"no PowerSGD matmul kernel {kind!r}")


def ef_matmul_bytes(n: int, m: int, rank: int, x_itemsize: int, has_residual: bool,
                    block_n: int, splits: int) -> int:
    """Declared global-memory bytes of :func:`.powersgd.ef_matmul` per matrix of the batch: read
    x (and read + write the residual), re-read Q's rows of the split once per row block, one
    fp32 atomic add to P per split, each program's tables."""
    return (n * m * (x_itemsize + (8 if has_residual else 0))
            + cdiv(n, block_n) * m * rank * 4 + 8 * n * rank * splits
            + cdiv(n, block_n) * splits * TABLE_BYTES)


def transpose_matmul_bytes(n: int, m: int, rank: int, x_itemsize: int, block_m: int,
                           splits: int) -> int:
    """Declared global-memory bytes of :func:`.powersgd.transpose_matmul` per matrix of the batch:
    read M, re-read P's rows of the split once per column block, one fp32 atomic add to Q per
    split, each program's tables."""
    return (n * m * x_itemsize + cdiv(m, block_m) * n * rank * 4 + 8 * m * rank * splits
            + cdiv(m, block_m) * splits * TABLE_BYTES)


def orthonormalize_bytes(shapes: list[tuple[int, int]]) -> int:
    """Declared global-memory bytes of :func:`.powersgd.orthonormalize_batched_`: per matrix
    [n, r], for column i, read columns <= i twice (coefficients, then re-orthogonalize; write
    column i back when i > 0), read columns >= i and write column i (normalize), read column i
    and the later columns and write the later ones (update): 4 n (3 r (r + 1) / 2 + r^2 + 2 r -
    2) in all, plus 16 bytes of offset, rows and cols per matrix."""
    return sum(4 * n * (3 * r * (r + 1) // 2 + r * r + 2 * r - 2) + 16 for n, r in shapes)


def residual_update_bytes(n: int, m: int, rank: int, block_n: int, block_m: int,
                          out_itemsize: int = 0, has_residual: bool = True) -> int:
    """Declared global-memory bytes of :func:`.powersgd.residual_update` per matrix of the batch:
    read and write M (``has_residual``), write the decode P Q^T (``out_itemsize`` per element;
    0: no decode), re-read P once per column block and Q once per row block, each program's
    tables."""
    tiles = cdiv(n, block_n) * cdiv(m, block_m)
    return (n * m * ((8 if has_residual else 0) + out_itemsize) + cdiv(m, block_m) * n * rank * 4
            + cdiv(n, block_n) * m * rank * 4 + tiles * TABLE_BYTES)


def power_step_bytes(n: int, m: int, rank: int, x_itemsize: int, has_residual: bool,
                     block_n: int, block_m: int) -> int:
    """Declared global-memory bytes of one PowerSGD power step on the kernels, per matrix, as
    gradcomp.methods.powersgd runs it on CUDA, for tiles (block_n, block_m): the four kernels
    (P = M Q, Gram-Schmidt, Q = M^T P, residual) and zero-filling P and Q. Excludes the fp32 copy
    of x that the no-residual path makes for a non-fp32 x, and the O(m r) work on the warm-start
    Q."""
    splits = matmul_splits(n, m, block_n)
    total = ef_matmul_bytes(n, m, rank, x_itemsize, has_residual, block_n, splits)
    total += orthonormalize_bytes([(n, rank)]) + 4 * n * rank
    total += transpose_matmul_bytes(n, m, rank, 4, block_m, matmul_splits(m, n, block_m)) + 4 * m * rank
    if has_residual:
        total += residual_update_bytes(n, m, rank, block_n, block_m)
    return total
