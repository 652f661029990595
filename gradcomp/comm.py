"""Communication schemes for compressed tensors; nothing here knows about DDP or any method by
name (a method's ``schemes`` say which of these its payloads allow).

Every function issues its collective at once, from the caller's thread, and returns a
``torch.futures.Future`` whose callbacks only decode. A collective whose input depends on an
earlier one's result (the second phase of :func:`two_phase_allreduce`) is not launched from a
callback: that races the caller's next collective and ranks disagree on the order (torch 2.13's
PowerSGD hook crashes Gloo that way). It is queued in a :class:`Deferred` and launched by
``Deferred.flush()``, which the caller runs from its own thread at points every rank reaches in
the same order.

Schemes and their cost per rank, for p ranks and a payload of m bytes (M uncompressed):
- :func:`allreduce_sum` / :func:`allreduce_payload`: ring all-reduce, 2 (p-1)/p x (bytes) sent;
  only for summable payloads (scheme ``allreduce``) and plain tensors.
- :func:`allgather_payloads`: every rank receives (p-1) m: grows with p (``allgather``);
  :func:`decode_sum` then decodes the p payloads in one pass.
- :func:`two_phase_allreduce`: all-to-all of p chunk payloads, each rank sums its chunk and
  re-compresses it, all-gather: 2 (p-1)/p m, flat in p (``twophase``).
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist
from torch.futures import Future

from .methods import get_method
from .payload import Payload

# torch >= 2.13 names them all_gather_single and reduce_scatter_single; all_gather_into_tensor
# and reduce_scatter_tensor are the older spellings
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- timing: device time where the work runs ---------------------------------------------------

def times_with_cuda_events(device) -> bool:
    """Whether work on ``device`` (a torch.device, its name, or None for the host) is timed with
    CUDA events: on CUDA the host returns from a kernel launch or a collective (NCCL: its
    Future completes at enqueue) long before the device finishes, so host clocks would time the
    launches, not the work."""
    return device is not None and torch.device(device).type == "cuda"


def mark(device=None):
    """A point in time on ``device``'s timeline: a CUDA event recorded on the current stream
    when :func:`times_with_cuda_events` (no host synchronisation), else
    ``time.perf_counter()`` seconds (a float)."""
    if times_with_cuda_events(device):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed_s(start, end) -> float:
    """Seconds from ``start`` to ``end``, two :func:`mark` results of one kind. Reading a CUDA
    interval waits for its end event: call it where a host synchronisation is allowed (when
    statistics are read, once per auto evaluation), never per bucket."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def seconds_of(fn, device=None) -> float:
    """Seconds ``fn()`` takes on ``device``: between two :func:`mark` points around it (CUDA:
    the device's time for the work ``fn`` enqueued on the current stream; waits for it)."""
    start = mark(device)
    fn()
    return elapsed_s(start, mark(device))


def _first_value(fut: Future) -> torch.Tensor:
    return fut.value()[0]


def allreduce_sum(tensor: torch.Tensor, group=None) -> Future:
    """Sum ``tensor`` over the group in place; a Future of that tensor."""
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(_first_value)


def allreduce_payload(payload: Payload, group=None) -> Future:
    """Sum a summable payload (one part, e.g. fp16 ``values``) over the group; Future[Payload]."""
    if not get_method(payload.method, **payload.options).summable:
        raise ValueError(f"{payload.method} payloads cannot be summed on the wire; use "
                         "allgather_payloads or two_phase_allreduce")
    if len(payload.parts) != 1:
        raise ValueError(f"allreduce_payload needs a one-part payload, got parts {list(payload.parts)}")
    (name, part), = payload.parts.items()
    return allreduce_sum(part, group).then(
        lambda fut: dataclasses.replace(payload, parts={name: fut.value()}))


def allgather_payloads(payload: Payload, group=None) -> Future:
    """Every rank's payload of the same tensor (same layout: same method, options and size);
    Future[Payload] of p stacked rows in rank order (views of the gathered buffer). One
    all-gather of ``payload.nbytes`` per rank."""
    world = dist.get_world_size(group)
    flat = payload.flatten()
    gathered = torch.empty(world, flat.numel(), dtype=torch.uint8, device=flat.device)
    work = all_gather_into(gathered.view(-1), flat, group=group, async_op=True)

    def arrived(fut: Future) -> Payload:
        fut.wait()  # re-raises a failed collective's error: never decode an unfilled receive buffer
        return payload.unflatten(gathered)
    return work.get_future().then(arrived)


def decode_sum(payloads: Payload | list[Payload], out: torch.Tensor | None = None) -> torch.Tensor:
    """The sum of the decoded payloads (stacked rows, or a list of one layout), fp32 unless
    ``out`` is given: the payloads' method decodes them all in one pass (one kernel on CUDA)."""
    if isinstance(payloads, list):
        payloads = Payload.stack(payloads)
    if out is None:
        out = torch.empty(payloads.shape, dtype=torch.float32, device=payloads.device)
    return get_method(payloads.method, **payloads.options).decode_sum(payloads, out)


class Deferred:
    """Follow-up collectives queued in order and launched from the caller's thread.

    ``then(future, launch)`` returns a Future that completes with the result of ``launch(value)``
    (itself a Future), where ``value`` is ``future``'s result; ``launch`` runs at the next
    ``flush()``, which waits for ``future`` first. Every rank must flush at the same points.
    """

    def __init__(self):
        self._queue: deque = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def then(self, future: Future, launch: Callable[[object], Future]) -> Future:
        result = Future()
        self._queue.append((future, launch, result))
        return result

    def flush(self) -> None:
        while self._queue:
            future, launch, result = self._queue.popleft()
            try:
                launched = launch(future.wait())
            except Exception as exc:  # the error belongs to whoever waits on the result
                result.set_exception(exc)
                continue
            launched.add_done_callback(lambda fut, result=result: _forward(fut, result))


def _forward(source: Future, target: Future) -> None:
    try:
        target.set_result(source.value())
    except Exception as exc:
        target.set_exception(exc)


def chunk_bounds(numel: int, world: int, granule: int = 1) -> list[tuple[int, int]]:
    """[start, end) of p equal chunks covering ``numel`` padded up: each chunk a multiple of
    ``granule`` elements (a method's block or chunk), so that the p chunk payloads side by side
    are the payload of the whole padded tensor."""
    size = granule * -(-numel // (world * granule))
    return [(r * size, (r + 1) * size) for r in range(world)]


def two_phase_allreduce(chunks: Payload, recompress: Callable[[torch.Tensor], Payload],
                        deferred: Deferred, group=None) -> Future:
    """Compressed all-reduce in two phases; Future[Payload]: the p summed chunks, stacked rows.

    chunks: this rank's payloads of p equal-size chunks as stacked rows (row r goes to rank r).
    Phase 1 (launched now): all-to-all; this rank decodes and sums the p payloads of its chunk
    (fp32, one pass) and calls ``recompress(sum)`` (the caller's second error feedback, 1/p of
    the size). Phase 2 (launched by ``deferred.flush()``): all-gather of the re-compressed chunks.
    """
    world = dist.get_world_size(group)
    if chunks.rows != world:
        raise ValueError(f"two_phase_allreduce needs {world} stacked chunk payloads (one per rank), "
                         f"got {chunks.rows}")
    send = chunks.flatten()
    received = torch.empty_like(send)
    work = dist.all_to_all_single(received.view(-1), send.view(-1), group=group, async_op=True)
    template = chunks.row(0)

    def reduce_my_chunk(fut):
        fut.wait()
        return recompress(decode_sum(template.unflatten(received)))

    gather = lambda summed: allgather_payloads(summed, group)  # noqa: E731
    return deferred.then(work.get_future().then(reduce_my_chunk), gather)
