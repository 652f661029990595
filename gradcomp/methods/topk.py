"""topk: keep the k = max(1, floor(ratio * n + 1/2)) largest magnitudes as values plus int32 indices.

Both selectors send the exact top k: torch.topk's magnitudes over |v| (NaN counts as the largest
magnitude, so it is always sent), up to which of the elements tied at the k-th magnitude go.
They differ in how the candidates are found:
- ``exact``: on the torch path (CPU) ``torch.topk`` over |v|. On the kernels (CUDA) a threshold
  from a seeded sample (:func:`kernel_sample` elements, seed ``seed`` every step), the one
  candidate pass, and a radix select over the candidates (over c itself where the sample missed:
  fewer than k pass, or more than 2k + 4096), all on the device, nothing read back to the host
  (gradcomp.kernels.topk); ties at the k-th magnitude go to the lowest indices.
- ``threshold``: a magnitude threshold of the top ``ratio`` estimated from a seeded random
  sample, aimed a few standard errors low so that at least k elements pass it; the candidates
  that pass are kept in one pass over memory and the exact top k taken among them (typically
  5-15% more candidates than k). On the torch path: ``sample`` elements drawn by a
  torch.Generator seeded with ``seed`` + a stride per step, the candidates found on the host
  (fewer than k pass: ``torch.topk`` over all). On the kernels: the exact selector's kernels,
  seeded per step; only the sample differs from the torch path's (other positions, at most
  gradcomp.kernels.declared.MAX_SAMPLE of them), which moves the threshold, never the set.

Values keep the input's dtype. Wire bytes: k * (itemsize + 4). The indices strictly ascend (the
torch path sorts the k chosen, the kernels write them in index order): the kernels' decode-sum
relies on it for its fast path (each program owns an output tile and adds every rank's entries
for it, rank by rank, without atomics: deterministic); a payload whose indices do not strictly
ascend within the tensor (corrupt or hostile) is still decoded, that rank by fp32 atomics, with
entries outside the tensor dropped and counted. Decompress scatters values into zeros; summing
several ranks' payloads is a scatter-add in row order (see ``scatter_add_into``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import check_number, is_number
from ..kernels import declared
from .base import (SEED_STEP_STRIDE, Method, corrected_fp32, kernel_family, scaled_addend_into,
                   use_triton)
from .bits import pack_bit31, set_bit_positions
from .fast import cpu_fast, row_pieces

kernels = kernel_family("topk")
"""The family's Triton launchers (gradcomp.kernels.topk), imported at their first use; read only
where :func:`~.base.use_triton` is True (never without triton)."""

SELECTORS = ("exact", "threshold")


def topk_count(ratio: float, numel: int) -> int:
    """k for a tensor of ``numel`` elements: max(1, floor(ratio * numel + 1/2)) (half rounds up), at most numel."""
    return min(numel, max(1, int(ratio * numel + 0.5))) if numel else 0


CANDIDATE_OVERSHOOT = 1.10
"""Candidates a sampled threshold passes, over k (typically 1.05-1.15): the analyser's estimate."""
GPU_BLOCK = max(block for block, _ in declared.TOPK_TILES)
"""Elements per program of the candidate kernel on GPUs (its atomics are counted per program)."""
CANDIDATE_ROW = 1024
"""Elements per row of the compiled candidate pass (a multiple of 8: rows start on a byte)."""


@cpu_fast
def _at_least_bits_into(words: torch.Tensor, threshold_bits: torch.Tensor, bits: torch.Tensor) -> None:
    """words int32 [m, w] (an fp32 tensor's int32 view, taken outside: a bitcast inside the
    compiled loop does not vectorize), threshold_bits int32 0-d (of a threshold >= +0.0) -> bits
    int8 [m, ceil(w / 8)] (bits.pack_bit31 layout): set where |v| >= threshold or v is NaN.

    For non-negative floats the int32 bit pattern orders like the value (and every NaN lies above
    inf), so |v| >= t  <=>  (t_bits - 1 - |v|_bits) < 0: its sign bit, packed without a compare.
    """
    magnitude_bits = words & 0x7FFFFFFF
    bits.copy_(pack_bit31(threshold_bits - 1 - magnitude_bits))


def magnitude_at_least(c: torch.Tensor, threshold: float) -> torch.Tensor:
    """int64 indices of the elements of fp32 ``c`` with |c| >= threshold, or NaN (a NaN must
    always be sent), in the order of :func:`set_bit_positions`. A NaN threshold is taken as inf."""
    threshold = math.inf if math.isnan(threshold) else max(threshold, 0.0) + 0.0  # no -0.0
    n = c.numel()
    bits = torch.empty(-(-n // 8), dtype=torch.uint8, device=c.device)
    # a 0-d tensor, not an int: the compiled loop would otherwise be specialized on its value
    threshold_bits = torch.tensor(threshold, dtype=torch.float32, device=c.device).view(torch.int32)
    _at_least_bits_into.each(
        (words, threshold_bits, bit_rows) for words, bit_rows in row_pieces(
            n // CANDIDATE_ROW, (c.reshape(-1).view(torch.int32), CANDIDATE_ROW),
            (bits.view(torch.int8), CANDIDATE_ROW // 8)))
    return set_bit_positions(bits, n, CANDIDATE_ROW)


def select_exact(c: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 indices, values) of the k largest |c| (NaN first)."""
    indices = torch.topk(c.abs(), k, sorted=False).indices
    return indices, c[indices]


def sample_rank(n: int, k: int, sample: int) -> int:
    """The rank (1-based, ascending) of the threshold among ``sample`` sampled magnitudes: aimed
    3 standard errors of a binomial proportion low, so that at least k of n elements reach it
    with high probability; 0 where sampling does not pay (no sample, n <= 4 sample or
    k > n / 4): the exact top-k over all then."""
    if not sample or n <= 4 * sample or k * 4 > n:
        return 0
    fraction = k / n
    aim = min(1.0, fraction + 3.0 * math.sqrt(fraction * (1 - fraction) / sample) + 1.0 / sample)
    return max(1, sample - math.ceil(aim * sample))


def sampled_threshold(values_at, n: int, k: int, sample: int, seed: int, device) -> torch.Tensor | None:
    """The torch path's threshold: the :func:`sample_rank`-th smallest |values_at(positions)|
    at ``sample`` positions drawn by a torch.Generator seeded with ``seed``, a 0-d fp32 tensor
    on ``device``; None where sampling does not pay."""
    rank = sample_rank(n, k, sample)
    if not rank:
        return None
    gen = torch.Generator(device=device).manual_seed(seed)
    probe = values_at(torch.randint(n, (sample,), generator=gen, device=device)).abs()
    return torch.kthvalue(probe, rank).values


MIN_EXACT_SAMPLE = 256
"""The fewest elements the kernels' sampled threshold is drawn from."""


def exact_sample_size(n: int, k: int, most: int) -> int:
    """Elements to sample for a threshold on the kernel path: the fewest (at least
    :data:`MIN_EXACT_SAMPLE`, at most ``most``) for which the candidates stay within the buffer
    (2k + 4096 slots) with the sampled quantile three standard errors above its aim, itself
    three above k (:func:`sample_rank`): with
    u = 1/sqrt(sample) and f = k / n, n (6 sqrt(f (1 - f)) u + u^2) <= k + 4096. A miss costs
    the select kernels' passes over c, never exactness."""
    if not n or not k:
        return MIN_EXACT_SAMPLE
    f = k / n
    spread = 6.0 * math.sqrt(f * (1 - f))
    room = (k + declared.MIN_CAPACITY) / n
    u = (-spread + math.sqrt(spread * spread + 4.0 * room)) / 2.0
    return max(MIN_EXACT_SAMPLE, min(most, math.ceil(1.0 / (u * u))))


def kernel_sample(n: int, k: int, most: int) -> int:
    """Elements the kernels sample for their threshold (both selectors):
    :func:`exact_sample_size` with at most ``most`` (the method's ``sample``) and
    declared.MAX_SAMPLE; 0 where sampling does not pay (:func:`sample_rank`)."""
    sample = exact_sample_size(n, k, min(most, declared.MAX_SAMPLE))
    return sample if sample_rank(n, k, sample) else 0


def select_threshold(c: torch.Tensor, k: int, sample: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 indices, values) of the k largest |c|, found through a sampled threshold (see the
    module doc): the exact top k among the candidates, ~10% more than k."""
    threshold = sampled_threshold(lambda i: c[i], c.numel(), k, sample, seed, c.device)
    if threshold is None:
        return select_exact(c, k)
    candidates = magnitude_at_least(c, float(threshold))  # the torch path: the host decides
    if candidates.numel() < k:
        return select_exact(c, k)
    values = c[candidates]  # one gather from the full tensor; the rest works on candidates
    if candidates.numel() == k:
        return candidates, values
    keep = torch.topk(values.abs(), k, sorted=False).indices
    return candidates[keep], values[keep]


def scatter_add_into(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """out[indices] += values (fp32 accumulation); the decompress of one or many top-k payloads."""
    return out.index_add_(0, indices.long(), values.to(out.dtype))


@dataclass(frozen=True)
class TopK(Method):
    """Top-k sparsification: ratio of the elements kept, 4-byte index + the value each."""

    name = "topk"
    prescales = True
    indexed = True
    ratio: float = 0.01
    selector: str = "exact"
    sample: int = 65536
    seed: int = 0

    def __post_init__(self):
        if not is_number(self.ratio) or not 0 < self.ratio <= 1:
            raise ValueError(f"topk: ratio must be in (0, 1], got {self.ratio!r}")
        if self.selector not in SELECTORS:
            raise ValueError(f"topk: selector must be one of {SELECTORS}, got {self.selector!r}")
        check_number("topk", "sample", self.sample, 64, integer=True)
        check_number("topk", "seed", self.seed, 0, integer=True)

    def k(self, numel: int) -> int:
        return topk_count(self.ratio, numel)

    def parts_layout(self, shape, dtype):
        k = self.k(math.prod(shape))
        return {"values": (dtype, (k,)), "indices": (torch.int32, (k,))}

    def declared_bytes(self, shape, world=1, error_feedback=True):
        n = math.prod(shape)
        k = self.k(n)
        sample = kernel_sample(n, k, self.sample)  # none: no finite candidate, c is read
        candidates = int(k * CANDIDATE_OVERSHOOT) if sample else 0
        return (declared.ef_topk_bytes(n, k, candidates, 4, error_feedback, GPU_BLOCK, sample),
                declared.scatter_add_sum_bytes(n, k, world, 4, 4))

    def _compress(self, x, residual, state, scale=1.0):
        k = self.k(x.numel())
        seed = None
        if self.selector == "threshold" and k:
            step = state.get("step", 0)
            state["step"] = step + 1
            seed = self.seed + SEED_STEP_STRIDE * step
        if use_triton(x):
            n = x.numel()
            sample = kernel_sample(n, k, self.sample)
            values, indices = kernels.ef_topk(x.reshape(-1), residual, k, scale, sample,
                                              sample_rank(n, k, sample),
                                              self.seed if seed is None else seed)
            return self._payload(x, {"values": values, "indices": indices})
        c = corrected_fp32(x, residual, scale)
        indices, values = (select_exact(c, k) if seed is None
                           else select_threshold(c, k, self.sample, seed))
        indices, order = indices.sort()  # the payload's indices ascend (the kernels' decode)
        values = values[order]
        payload = self._payload(x, {"values": values.to(x.dtype), "indices": indices.to(torch.int32)})
        return self._feed_back(c, payload, residual)

    def _decompress_into(self, payload, out):  # this process's own payload (error feedback)
        self._torch_decode_sum(payload.as_rows(), out, dropped=None)

    def _torch_decode_sum(self, payloads, out, addend=None, addend_scale=1.0, *, dropped):
        """out = addend_scale * addend (or 0), then one scatter-add of every row's values in
        row order (fp32 accumulation), entries outside [0, numel) dropped and counted per row
        into ``dropped`` (None: this process's own payload, not counted)."""
        total = out if out.dtype == torch.float32 else torch.empty(out.shape, device=out.device)
        if addend is None:
            total.zero_()
        else:
            scaled_addend_into(addend, addend_scale, total)
        rows = payloads.rows
        indices = payloads.parts["indices"].reshape(rows, -1)
        values = payloads.parts["values"].reshape(rows, -1)
        inside = (indices >= 0) & (indices < payloads.numel)
        if dropped is not None:
            dropped.add_(inside.logical_not().sum(dim=1))
        if inside.all():
            indices, values = indices.reshape(-1), values.reshape(-1)
        else:  # row-major: the kept entries stay in row order
            indices, values = indices[inside], values[inside]
        scatter_add_into(total, indices, values)
        if total is not out:
            out.copy_(total)

    def _kernel_decode_sum(self, payloads, out, addend=None, addend_scale=1.0, *, dropped):
        """The scaled addend (or zeros) as the start, then one scatter-add of every row (entries
        outside the tensor masked and counted on the device)."""
        p, rows = payloads.parts, payloads.rows
        kernels.scatter_add_sum(p["values"].reshape(rows, -1),
                                p["indices"].reshape(rows, -1), payloads.numel,
                                out.dtype, out, addend, addend_scale, dropped=dropped)
        return True
