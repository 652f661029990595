"""Communication schemes for compressed tensors; nothing here knows about DDP.

Every function issues its collective at once, from the caller's thread, and returns a
``torch.futures.Future`` whose callbacks only decode. A collective whose input depends on an
earlier one's result (the second phase of :func:`two_phase_allreduce`) is not launched from a
callback: that races the caller's next collective and ranks disagree on the order (torch 2.13's
PowerSGD hook crashes Gloo that way). It is queued in a :class:`Deferred` and launched by
``Deferred.flush()``, which the caller runs from its own thread at points every rank reaches in
the same order.

Schemes and their cost per rank, for p ranks and a payload of m bytes (M uncompressed):
- :func:`allreduce_sum` / :func:`allreduce_payload`: ring all-reduce, 2 (p-1)/p x (bytes) sent;
  only for summable payloads (fp16, bf16) and plain tensors.
- :func:`allgather_payloads`: every rank receives (p-1) m: grows with p (int8, sign, topk).
- :func:`two_phase_allreduce`: all-to-all of p chunk payloads, each rank sums its chunk and
  re-compresses it, all-gather: 2 (p-1)/p m, flat in p (int8, sign).
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist
from torch.futures import Future

from .methods import get_method
from .methods.topk import scatter_add_into
from .payload import Payload

# torch >= 2.13 names it all_gather_single; all_gather_into_tensor is the older spelling
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
    Future[list[Payload]] in rank order. One all-gather of ``payload.nbytes`` per rank."""
    world = dist.get_world_size(group)
    flat = payload.flatten()
    gathered = torch.empty(world * flat.numel(), dtype=torch.uint8, device=flat.device)
    work = all_gather_into(gathered, flat, group=group, async_op=True)
    return work.get_future().then(
        lambda fut: [payload.unflatten(chunk) for chunk in gathered.view(world, -1)])


def decode_sum(payloads: list[Payload]) -> torch.Tensor:
    """Sum of the decoded payloads as a flat fp32 tensor (top-k: one scatter-add over all)."""
    if payloads[0].method == "topk":
        out = torch.zeros(payloads[0].numel, dtype=torch.float32, device=payloads[0].parts["values"].device)
        indices = torch.cat([p.parts["indices"] for p in payloads])
        values = torch.cat([p.parts["values"] for p in payloads])
        return scatter_add_into(out, indices, values)
    method = get_method(payloads[0].method, **payloads[0].options)
    total = None
    for payload in payloads:
        decoded = method.decompress(dataclasses.replace(payload, dtype=torch.float32)).reshape(-1)
        total = decoded if total is None else total.add_(decoded)
    return total


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


def chunk_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """[start, end) of p equal chunks covering ``numel`` padded up to a multiple of p."""
    size = -(-numel // world)
    return [(r * size, (r + 1) * size) for r in range(world)]


def two_phase_allreduce(chunks: list[Payload], recompress: Callable[[torch.Tensor], Payload],
                        deferred: Deferred, group=None) -> Future:
    """Compressed all-reduce in two phases; Future[list[Payload]]: the summed chunks, in order.

    chunks: this rank's payloads of p equal-size chunks (chunk r goes to rank r).
    Phase 1 (launched now): all-to-all; this rank decodes the p payloads of its chunk, sums them
    (fp32) and calls ``recompress(sum)`` (the caller's second error feedback, 1/p of the size).
    Phase 2 (launched by ``deferred.flush()``): all-gather of the re-compressed chunks.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if len(chunks) != world:
        raise ValueError(f"two_phase_allreduce needs {world} chunks (one per rank), got {len(chunks)}")
    flats = [c.flatten() for c in chunks]
    if len({f.numel() for f in flats}) != 1:
        raise ValueError("two_phase_allreduce needs chunk payloads of equal size")
    send = torch.cat(flats)
    received = torch.empty_like(send)
    work = dist.all_to_all_single(received, send, group=group, async_op=True)
    mine = chunks[rank]

    def reduce_my_chunk(fut):
        fut.wait()
        return recompress(decode_sum([mine.unflatten(b) for b in received.view(world, -1)]))

    gather = lambda summed: allgather_payloads(summed, group)  # noqa: E731
    return deferred.then(work.get_future().then(reduce_my_chunk), gather)

