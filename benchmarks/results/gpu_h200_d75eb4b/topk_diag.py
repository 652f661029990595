"""GPU diagnosis of the top-k decode-sum mismatch (test_decode_sum_of_three_ranks[topk-ratio0.05])."""
import sys, itertools
sys.path.insert(0, "tests")
import torch, triton
DEV = "cuda" if torch.cuda.is_available() else "cpu"
import gradcomp
from kernel_utils import gradient, rank_payloads
from gradcomp.kernels import topk
from gradcomp.kernels.common import jit_function, size_class, kernel_view, EXACT
from gradcomp.kernels.declared import DECODE_TILE, decode_chunk

def report(tag, got, expected):
    bad = (got - expected).abs() > 1e-5 * expected.abs().max()
    print(f"{tag}: {int(bad.sum())} mismatches", flush=True)
    return bad

for ratio, world in ((0.05, 3), (0.05, 1), (0.01, 3), (0.05, 2)):
    n = (1 << 20) + 3
    method = gradcomp.get_method("topk", ratio=ratio)
    grads = [gradient(n, 40 + w).to(DEV) for w in range(world)]
    _, expected, parts = rank_payloads(method, grads)
    values, indices = parts["values"], parts["indices"].int()
    k = values.shape[1]
    asc = bool((indices[:, 1:] > indices[:, :-1]).all())
    got = topk.scatter_add_sum(values, indices, n)
    bad = report(f"ratio {ratio} world {world} k {k} ascending {asc} chunk {decode_chunk(n, k)}", got, expected)
    if ratio == 0.05 and world == 3:
        pos = bad.nonzero().flatten()[:12].tolist()
        for p in pos:
            contrib = [(w, values[w][indices[w] == p].tolist()) for w in range(world)]
            print(f"  pos {p} tile {p // DECODE_TILE} got {got[p].item():.5f} expected {expected[p].item():.5f} {contrib}")
        tiles_bad = sorted(set((bad.nonzero().flatten() // DECODE_TILE).tolist()))
        print("  bad tiles", tiles_bad[:40], "of", triton.cdiv(n, DECODE_TILE))
        per_tile = [[int(((indices[w] >= t * DECODE_TILE) & (indices[w] < (t + 1) * DECODE_TILE)).sum()) for w in range(world)] for t in tiles_bad[:8]]
        print("  entries per rank in the bad tiles", per_tile)
        tiles = triton.cdiv(n, DECODE_TILE)
        flags = torch.zeros(world, dtype=torch.int32, device=DEV)
        bounds = torch.empty(world, tiles + 1, dtype=torch.int32, device=DEV)
        topk.topk_check_kernel[topk.scatter_add_grid(k + 1, world)](indices, flags, bounds, n, k, size_class(k), tiles, indices.stride(0), TILE=DECODE_TILE, **EXACT)
        ref = torch.stack([torch.searchsorted(indices[w].long(), torch.arange(tiles + 1, device=DEV) * DECODE_TILE) for w in range(world)]).int()
        ref[:, -1] = k
        print("  flags", flags.tolist(), "bounds equal searchsorted:", bool(torch.equal(bounds, ref)),
              "differ at", (bounds != ref).nonzero()[:10].tolist())
        kernel = jit_function(topk.topk_decode_tile_kernel)
        for warps, stages in itertools.product((4, 8), (1, 2, 3)):
            out = torch.empty(n, device=DEV)
            kernel[(tiles,)](values, indices, ref, flags, out, out, n, size_class(n), world, tiles,
                             values.stride(0), indices.stride(0), 1.0, HAS_ADDEND=False, ADDEND_BF16=False,
                             V_BF16=False, PART=topk.DECODE_PART, CHUNK=decode_chunk(n, k), BLOCK=DECODE_TILE,
                             num_warps=warps, num_stages=stages, **EXACT)
            report(f"  tile kernel alone, warps {warps} stages {stages}", out, expected)
        for chunk in (256, 512, 2048):
            out = torch.empty(n, device=DEV)
            kernel[(tiles,)](values, indices, ref, flags, out, out, n, size_class(n), world, tiles,
                             values.stride(0), indices.stride(0), 1.0, HAS_ADDEND=False, ADDEND_BF16=False,
                             V_BF16=False, PART=topk.DECODE_PART, CHUNK=chunk, BLOCK=DECODE_TILE,
                             num_warps=4, num_stages=1, **EXACT)
            report(f"  tile kernel alone, CHUNK {chunk}, 4 warps, 1 stage", out, expected)
