"""DDP hooks for the element-wise compressors: allreduce (baseline), fp16, bf16, int8, sign, topk.

Each hook follows PyTorch's contract ``hook(state, bucket) -> Future[Tensor]``: the Future holds
the average over ranks of ``bucket.buffer()`` (same size and dtype). Like DDP's own reducer, a
hook first multiplies the bucket by 1/world_size in place, so every scheme's sum is the average
and fp16 sums cannot overflow. Collectives are issued from the hook's thread; callbacks only
decode.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..methods import get_method
from .base import HookState, resumable

SCHEMES = ("allgather", "twophase")


class AllreduceState(HookState):
    """State for :func:`allreduce_hook`: statistics and the first-step check, no options."""

    def __init__(self, process_group=None):
        super().__init__(process_group)


class CompressedState(HookState):
    """State of a hook that compresses with one gradcomp method (``method_name``).

    error_feedback: keep what compression dropped per bucket and send it at later steps.
    method_options: the method's options (validated by ``gradcomp.get_method``).
    A ``seed`` option is offset by the rank so that ranks draw independent random numbers.
    """

    method_name: str = ""
    default_error_feedback = True

    def __init__(self, process_group=None, *, error_feedback: bool | None = None, **method_options):
        if error_feedback is None:
            error_feedback = self.default_error_feedback
        if not isinstance(error_feedback, bool):
            raise ValueError(f"{type(self).__name__}: error_feedback must be True or False, got {error_feedback!r}")
        get_method(self.method_name, **method_options)  # raises a ValueError naming a bad option
        super().__init__(process_group, method=self.method_name, error_feedback=error_feedback,
                         **method_options)
        self._method = None

    @property
    def error_feedback(self) -> bool:
        return self.options["error_feedback"]

    def method(self):
        """The Method this rank compresses with (its seed offset by the rank)."""
        if self._method is None:
            options = {k: v for k, v in self.options.items() if k not in ("method", "error_feedback", "scheme")}
            if "seed" in get_method(self.method_name).options():
                options["seed"] = options.get("seed", 0) + 1_000_033 * self.rank
            self._method = get_method(self.method_name, **options)
        return self._method

    def __getstate__(self):
        out = super().__getstate__()
        out["_method"] = None
        return out


class FP16State(CompressedState):
    """fp16_hook state; error feedback off by default (torch's fp16_compress_hook has none)."""

    method_name = "fp16"
    default_error_feedback = False

    def __init__(self, process_group=None, *, error_feedback: bool = False):
        super().__init__(process_group, error_feedback=error_feedback)


class BF16State(FP16State):
    """bf16_hook state; error feedback off by default."""

    method_name = "bf16"


class _SchemeState(CompressedState):
    def __init__(self, process_group=None, *, scheme: str = "allgather", error_feedback: bool = True,
                 **method_options):
        if scheme not in SCHEMES:
            raise ValueError(f"{type(self).__name__}: scheme must be one of {SCHEMES}, got {scheme!r}")
        super().__init__(process_group, error_feedback=error_feedback, **method_options)
        self.options["scheme"] = scheme


class Int8State(_SchemeState):
    """int8_hook state: scheme "allgather" | "twophase", error_feedback, block, stochastic, seed."""

    method_name = "int8"


class SignState(_SchemeState):
    """sign_hook state: scheme "allgather" | "twophase", error_feedback, chunk."""

    method_name = "sign"


class TopKState(CompressedState):
    """topk_hook state: ratio (fraction of elements sent), error_feedback, selector, sample, seed."""

    method_name = "topk"

    def __init__(self, process_group=None, ratio: float = 0.01, *, error_feedback: bool = True, **method_options):
        super().__init__(process_group, error_feedback=error_feedback, ratio=ratio, **method_options)


# ---- the shared frame of every hook -----------------------------------------------------------

def _begin(state, bucket, hook_name: str, state_type=HookState, allow_none: bool = False):
    """Check the state, run its per-bucket bookkeeping, scale the bucket by 1/world_size in place
    (DDP's reducer does the same); returns (group, bucket buffer)."""
    if state is None and allow_none:
        group = None
    elif isinstance(state, state_type):
        state.begin_bucket(bucket, hook_name)
        group = state.group
    else:
        expected = state_type.__name__ + (" or None" if allow_none else "")
        raise TypeError(f"{hook_name}: state must be a {expected}, got {type(state).__name__}")
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size(group))
    return group, buffer


def _end(state, bucket, future, decode, wire_bytes: int, launched: float):
    """Chain ``decode`` (timed) onto ``future``, record statistics, close the bucket."""
    if state is None:
        return future.then(decode)
    state.stats.add(wire_bytes=wire_bytes)

    def timed_decode(fut):
        start = time.perf_counter()
        state.stats.add(comm_s=start - launched)
        try:
            return decode(fut)
        finally:
            state.stats.add(decompress_s=time.perf_counter() - start)

    state.end_bucket(bucket)
    return future.then(timed_decode)


def _compress(state, bucket, buffer, method):
    if state is None or not state.options.get("error_feedback", False):
        return method.compress(buffer)
    return state.compress(f"bucket{bucket.index()}", buffer, method, True, state.bucket_layout(bucket))


# ---- hooks -------------------------------------------------------------------------------------

@resumable
def allreduce_hook(state, bucket):
    """Plain all-reduce average (no compression) through the same machinery: the baseline.
    Gives exactly DDP's default gradients. ``state``: None or a HookState (statistics)."""
    group, buffer = _begin(state, bucket, "allreduce_hook", allow_none=True)
    launched = time.perf_counter()
    future = comm.allreduce_sum(buffer, group)
    return _end(state, bucket, future, lambda fut: fut.value(), buffer.numel() * buffer.element_size(), launched)


def _cast_hook(state, bucket, method_name: str, hook_name: str):
    group, buffer = _begin(state, bucket, hook_name, allow_none=True)
    method = get_method(method_name)
    start = time.perf_counter()
    payload = _compress(state, bucket, buffer, method)
    if state is not None:
        state.stats.add(compress_s=time.perf_counter() - start)
    launched = time.perf_counter()
    future = comm.allreduce_payload(payload, group)
    return _end(state, bucket, future, lambda fut: method.decompress(fut.value()), payload.nbytes, launched)


@resumable
def fp16_hook(state, bucket):
    """fp16 all-reduce (divide by world size, cast, sum, cast back), as torch's
    fp16_compress_hook. ``state``: None, a HookState, or FP16State(error_feedback=True)."""
    return _cast_hook(state, bucket, "fp16", "fp16_hook")


@resumable
def bf16_hook(state, bucket):
    """bf16 all-reduce; unlike torch 2.13's bf16_compress_hook it also runs on Gloo.
    ``state``: None, a HookState, or BF16State(error_feedback=True)."""
    return _cast_hook(state, bucket, "bf16", "bf16_hook")


def _gather_hook(state, bucket, hook_name: str, state_type):
    """All-gather every rank's payload, decode and sum (int8, sign, topk)."""
    group, buffer = _begin(state, bucket, hook_name, state_type)
    with state.stats.timed("compress_s"):
        payload = _compress(state, bucket, buffer, state.method())
    launched = time.perf_counter()
    future = comm.allgather_payloads(payload, group)

    def decode(fut):
        return comm.decode_sum(fut.value()).to(buffer.dtype)

    return _end(state, bucket, future, decode, payload.nbytes, launched)


def _twophase_hook(state, bucket, hook_name: str):
    """All-to-all of p chunk payloads, sum and re-compress one chunk per rank, all-gather."""
    group, buffer = _begin(state, bucket, hook_name, _SchemeState)
    method, world, numel = state.method(), state.world_size, buffer.numel()
    bounds = comm.chunk_bounds(numel, world)
    padded_numel = bounds[-1][1]
    padded = F.pad(buffer, (0, padded_numel - numel)) if padded_numel > numel else buffer
    name = f"bucket{bucket.index()}"
    with state.stats.timed("compress_s"):
        chunks = state.compress_chunks(name, padded, method, bounds, state.error_feedback,
                                       state.bucket_layout(bucket))

    def recompress(chunk_sum):
        with state.stats.timed("compress_s"):
            return state.compress(name + "/server", chunk_sum, method, state.error_feedback)

    launched = time.perf_counter()
    future = comm.two_phase_allreduce(chunks, recompress, state.deferred, group)

    def decode(fut):
        parts = [method.decompress(p).reshape(-1) for p in fut.value()]
        return torch.cat(parts)[:numel].to(buffer.dtype)

    # phase 1 sends every chunk payload; phase 2 one re-compressed chunk (the same layout)
    wire_bytes = sum(c.nbytes for c in chunks) + chunks[0].nbytes
    return _end(state, bucket, future, decode, wire_bytes, launched)


def _scheme_hook(state, bucket, hook_name: str, state_type):
    if isinstance(state, state_type) and state.options["scheme"] == "twophase":
        return _twophase_hook(state, bucket, hook_name)
    return _gather_hook(state, bucket, hook_name, state_type)


@resumable
def int8_hook(state, bucket):
    """int8 block quantization (``Int8State``), by all-gather or two-phase all-reduce."""
    return _scheme_hook(state, bucket, "int8_hook", Int8State)


@resumable
def sign_hook(state, bucket):
    """1-bit scaled sign with error feedback (``SignState``), by all-gather or two-phase."""
    return _scheme_hook(state, bucket, "sign_hook", SignState)


@resumable
def topk_hook(state, bucket):
    """Top-k values and indices (``TopKState``), all-gathered, summed by scatter-add."""
    return _gather_hook(state, bucket, "topk_hook", TopKState)


HOOKS = {
    "allreduce": (allreduce_hook, AllreduceState),
    "fp16": (fp16_hook, FP16State),
    "bf16": (bf16_hook, BF16State),
    "int8": (int8_hook, Int8State),
    "sign": (sign_hook, SignState),
    "topk": (topk_hook, TopKState),
}
