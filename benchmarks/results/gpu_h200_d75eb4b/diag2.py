"""GPU diagnosis 2: top-k tile decode variants (start race vs rank race), sign decode vs torch."""
import sys, itertools, time
sys.path.insert(0, "tests")
import torch, triton
import triton.language as tl
import gradcomp
DEV = "cuda" if torch.cuda.is_available() else "cpu"
from kernel_utils import gradient, rank_payloads
from gradcomp.kernels import topk
from gradcomp.kernels.common import size_class, EXACT, load_f32
from gradcomp.kernels.declared import DECODE_TILE, decode_chunk
from gradcomp.methods.base import forced_backend

@triton.jit
def tile_variant(values_ptr, indices_ptr, bounds_ptr, out_ptr, n, world, tiles, values_row, indices_row,
                 WRITE_START: tl.constexpr, ATOMIC: tl.constexpr, PART: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    if WRITE_START:
        for part in tl.static_range(BLOCK // PART):
            offs = tile * BLOCK + part * PART + tl.arange(0, PART)
            tl.store(out_ptr + offs, tl.zeros([PART], dtype=tl.float32), mask=offs < n)
        tl.debug_barrier()
    bounds_row, indices_at, values_at = bounds_ptr + tile, indices_ptr, values_ptr
    for w in range(world):
        lo = tl.load(bounds_row)
        hi = tl.load(bounds_row + 1)
        for first in range(lo, hi, CHUNK):
            j = first + tl.arange(0, CHUNK)
            live = j < hi
            idx = tl.load(indices_at + j, mask=live, other=0)
            v = tl.load(values_at + j, mask=live, other=0.0)
            if ATOMIC:
                tl.atomic_add(out_ptr + idx, v, mask=live, sem="relaxed")
            else:
                total = tl.load(out_ptr + idx, mask=live, other=0.0) + v
                tl.store(out_ptr + idx, total, mask=live)
        tl.debug_barrier()
        bounds_row += tiles + 1
        indices_at += indices_row
        values_at += values_row

GARBAGE = 1000.0
for ratio, world in ((0.05, 3), (0.01, 8)):
    n = (1 << 20) + 3
    method = gradcomp.get_method("topk", ratio=ratio)
    _, expected, parts = rank_payloads(method, [gradient(n, 40 + w).to(DEV) for w in range(world)])
    values, indices = parts["values"].contiguous(), parts["indices"].int().contiguous()
    k = values.shape[1]
    tiles = triton.cdiv(n, DECODE_TILE)
    bounds = torch.stack([torch.searchsorted(indices[w].long(), torch.arange(tiles + 1, device=DEV) * DECODE_TILE) for w in range(world)]).int()
    for write_start, atomic, warps, chunk in itertools.product((True, False), (False, True), (4, 8), (1024, 256)):
        bad_start = bad_other = 0
        for trial in range(3):
            out = torch.full((n,), GARBAGE, device=DEV)
            if not write_start:
                out.zero_()
            tile_variant[(tiles,)](values, indices, bounds, out, n, world, tiles, k, k, WRITE_START=write_start,
                                   ATOMIC=atomic, PART=2048, CHUNK=chunk, BLOCK=DECODE_TILE, num_warps=warps, **EXACT)
            err = (out - expected).abs()
            bad_start += int((err > GARBAGE / 2).sum())
            bad_other += int(((err > 1e-5 * 8) & (err <= GARBAGE / 2)).sum())
        print(f"topk ratio {ratio} world {world}: start {'in kernel' if write_start else 'zeroed before'}, "
              f"{'atomic' if atomic else 'load+store'}, {warps} warps, CHUNK {chunk}: {bad_start} start-missed, {bad_other} other (3 trials)", flush=True)

# sign decode kernel vs torch path, bit for bit, with specials
for world, chunk, n, addend, out_dtype in itertools.product((1, 3, 5, 9), (1024, 64), (1000003,), (None, torch.float32, torch.bfloat16), (torch.float32, torch.bfloat16)):
    method = gradcomp.get_method("sign", chunk=chunk)
    gs = [gradient(n, 60 + w, specials=w == 1).to(DEV) for w in range(world)]
    with forced_backend("torch"):
        stacked = gradcomp.payload.Payload.stack([method.compress(g) for g in gs])
    a = None if addend is None else gradient(n, 7, specials=True).to(DEV).to(addend)
    res = {}
    for path in ("torch", "triton"):
        with forced_backend(path):
            res[path] = method.decode_sum(stacked, torch.empty(n, device=DEV, dtype=out_dtype), addend=a, addend_scale=0.5 if a is not None else 1.0)
    x, y = res["triton"].float(), res["torch"].float()
    nan_diff = int((x.isnan() != y.isnan()).sum())
    val_diff = int(((x != y) & ~x.isnan() & ~y.isnan()).sum())
    if nan_diff or val_diff:
        print(f"sign world {world} chunk {chunk} addend {addend} out {out_dtype}: {nan_diff} NaN-pattern, {val_diff} value mismatches", flush=True)
print("sign decode checks done", flush=True)
