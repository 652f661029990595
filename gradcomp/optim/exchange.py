"""What the exchange-owning optimizers share: DDP's all-reduce switched off, flat parameter
views, one compressed mean over ranks per step, statistics, checkpointing.

DDP must not all-reduce the gradients these optimizers exchange themselves (that would send
every gradient twice and compress averaged instead of local values). :func:`local_gradients`
registers a no-op comm hook on the DDP model: backward then leaves each rank's own gradient in
``.grad``. The optimizers check it at construction and raise ``DDPStillReducesError`` otherwise.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..feedback import ErrorFeedback
from ..hooks.stats import HookStats
from ..methods import get_method
from ..schemes import FLAT_SCHEMES, SCHEMES

FP32_BYTES = 4


class DDPStillReducesError(RuntimeError):
    """An exchange-owning optimizer was given a DDP model that still all-reduces gradients."""


def local_gradients_hook(state, bucket):
    """DDP comm hook that communicates nothing: the bucket keeps this rank's own gradients."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def local_gradients(model) -> None:
    """Turn DDP's gradient all-reduce off for ``model`` (a DistributedDataParallel): registers
    :func:`local_gradients_hook`. Call it once, before the first backward; DDP accepts one comm
    hook per model, so a model with another hook raises DDP's own error."""
    if not hasattr(model, "register_comm_hook"):
        raise TypeError(f"local_gradients expects a DistributedDataParallel model, got {type(model).__name__}")
    model.register_comm_hook(None, local_gradients_hook)


def check_local(model) -> None:
    """Raise DDPStillReducesError unless ``model`` is a plain module or a DDP model whose comm
    hook is :func:`local_gradients_hook`."""
    if model is None or not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be the torch.nn.Module being trained (plain or DDP), got "
                        f"{type(model).__name__}")
    hooks = getattr(model, "_comm_hooks", None)
    if hooks is None:  # not DDP: nothing all-reduces behind the optimizer's back
        return
    if not any(hook is local_gradients_hook for hook, _ in hooks):
        raise DDPStillReducesError(
            "this optimizer exchanges (compressed) gradients itself, but the DDP model still "
            "all-reduces them; call gradcomp.optim.local_gradients(model) right after wrapping "
            "the model in DistributedDataParallel (and register no other comm hook)")


class FlatParameters:
    """The optimizer's parameters as one flat fp32 vector, in param-group order: each group is one
    contiguous range [start, end) (its ``ranges``), each parameter one slice of it."""

    def __init__(self, param_groups: list[dict]):
        self.params, self.ranges, offset = [], [], 0
        for group in param_groups:
            start = offset
            for p in group["params"]:
                self.params.append((p, offset))
                offset += p.numel()
            self.ranges.append((start, offset))
        self.numel = offset
        first = self.params[0][0] if self.params else None
        self.device = first.device if first is not None else torch.device("cpu")

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=torch.float32, device=self.device)

    def gradients(self) -> torch.Tensor:
        """The local gradients as a new flat fp32 vector (zeros where ``.grad`` is None)."""
        flat = self.zeros()
        for p, offset in self.params:
            if p.grad is not None:
                flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        return flat

    def values(self) -> torch.Tensor:
        """The parameters' values as a new flat fp32 vector."""
        flat = self.zeros()
        for p, offset in self.params:
            flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
        return flat

    def assign(self, values: torch.Tensor) -> None:
        """Set the parameters to the flat vector ``values``."""
        with torch.no_grad():
            for p, offset in self.params:
                p.copy_(values[offset:offset + p.numel()].view_as(p))

    def advance(self, vector: torch.Tensor, update: torch.Tensor | None, param_groups: list[dict],
                decay_key: str) -> None:
        """The step of :meth:`apply` on a flat vector in place: vector <- vector (1 - lr wd) -
        lr update per group (the same fp32 operations, so the same values); update None: decay only."""
        for group, (start, end) in zip(param_groups, self.ranges):
            lr, wd = group["lr"], group.get(decay_key, 0.0)
            piece = vector[start:end]
            if wd:
                piece.mul_(1.0 - lr * wd)
            if update is not None:
                piece.add_(update[start:end], alpha=-lr)

    def apply(self, update: torch.Tensor, param_groups: list[dict], decay_key: str | None) -> None:
        """p <- p (1 - lr wd) - lr update[p's slice] per group (``decay_key`` None: no decay)."""
        index = 0
        for group, (start, end) in zip(param_groups, self.ranges):
            lr, wd = group["lr"], group.get(decay_key, 0.0) if decay_key else 0.0
            for p in group["params"]:
                p_offset = self.params[index][1]
                index += 1
                with torch.no_grad():
                    if wd:
                        p.mul_(1.0 - lr * wd)
                    p.add_(update[p_offset:p_offset + p.numel()].view_as(p).to(p.dtype), alpha=-lr)


class Exchange:
    """Means over ranks of flat fp32 vectors, sent with a gradcomp method and counted.

    ``mean(x, method, scheme, name)``: method None sends fp32 (all-reduce); a method's
    ``allreduce`` scheme all-reduces its summable payload, ``allgather`` gathers every rank's
    payload and decodes-and-sums them, ``twophase`` is the compressed all-reduce of
    :func:`gradcomp.comm.two_phase_allreduce` with a worker residual (``name``) and a server
    residual (``name + "/server"``). Error feedback (residuals in ``feedback``) is on for every
    method but fp32. Every rank sends x times 1/world size, so that the sum is the mean: fp32 is
    divided by the world size, a method compresses ``x`` with ``scale`` 1/world size
    (``Method.compress``: x multiplied by the fp32 reciprocal, the same as the division for a
    world size that is a power of 2). Wire bytes are counted as the DDP hooks count them
    (stats.wire_bytes).
    """

    def __init__(self, group=None):
        self.group = group
        self.feedback = ErrorFeedback()
        self.stats = HookStats()
        self.last_payload = None  # this rank's payload of the last allreduce/allgather exchange

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def mean(self, x: torch.Tensor, method=None, scheme: str = "", name: str = "",
             error_feedback: bool = True) -> torch.Tensor:
        """The mean over ranks of ``x`` (flat fp32, not modified) as decoded on every rank
        (identical on all ranks); non-finite inputs decode non-finite (see docs/design.md)."""
        world = self.world_size
        if method is None:
            scaled = x / world  # as DDP's reducer: the sum of the scaled values is the mean
            self.stats.add(wire_bytes=scaled.numel() * FP32_BYTES)
            if not dist.is_initialized():
                return scaled
            with self.stats.timed("comm_s", x.device):
                return comm.allreduce_sum(scaled, self.group).wait()
        if isinstance(method, str):
            method = get_method(method)
        scheme = scheme or method.schemes[0]
        if scheme not in method.schemes:
            raise ValueError(f"{method.name} has no scheme {scheme!r}; it offers {method.schemes}")
        if not dist.is_initialized():
            return self._one_process(x, method, scheme, name, error_feedback)
        exchange, deferred = SCHEMES[scheme], comm.Deferred()
        if exchange.per_tensor:
            raise ValueError(f"scheme {scheme!r} is not served by gradcomp.optim ({', '.join(FLAT_SCHEMES)})")
        # the chunk sums of twophase are already means: re-compressed unscaled
        sent = exchange.send(x, method, lambda t: self._compress(t, method, name, error_feedback,
                                                                 1.0 / world), world)
        if sent.rows is None:  # one payload (not two-phase chunks)
            self.last_payload = sent
        future = exchange.launch(
            sent, method, lambda chunk_sum: self._compress(chunk_sum, method, name + "/server", error_feedback),
            self.group, deferred)
        with self.stats.timed("comm_s", x.device):  # twophase: includes the server's decode and re-compress
            deferred.flush()
            arrived = future.wait()
        with self.stats.timed("decompress_s", x.device):
            summed = exchange.decode(method, arrived, torch.empty_like(x), self.stats)
        self.stats.add(wire_bytes=exchange.sent_bytes(sent))
        return summed

    def _compress(self, x, method, name, error_feedback, scale=1.0):
        with self.stats.timed("compress_s", x.device):
            if not error_feedback:
                return method.compress(x, scale=scale)
            residual, state = self.feedback.get(name, x.numel(), (), x.device)
            return method.compress(x, residual, state, scale)

    def _one_process(self, x, method, scheme, name, error_feedback):
        """Without a process group: the same payloads, residuals and bytes as one rank (two-phase:
        its one chunk summed alone and re-compressed)."""
        exchange = SCHEMES[scheme]
        sent = exchange.send(x, method, lambda t: self._compress(t, method, name, error_feedback), 1)
        self.stats.add(wire_bytes=exchange.sent_bytes(sent))
        if sent.rows is None:  # one payload (not two-phase chunks)
            self.last_payload = sent
            return method.decompress(sent, torch.empty_like(x))
        summed = self._compress(method.decompress(sent.joined()), method, name + "/server", error_feedback)
        return exchange.decode(method, summed.as_rows(1), torch.empty_like(x))

    def count_step(self, numel: int) -> None:
        """Count one optimizer step over ``numel`` fp32 gradient elements (raw bytes)."""
        self.stats.add(raw_bytes=numel * FP32_BYTES)
        self.stats.steps += 1
        self.stats.buckets += 1

    def state_dict(self) -> dict:
        return {"feedback": self.feedback.state_dict(), "stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.feedback.load_state_dict(state["feedback"])
        self.stats.load_state_dict(state["stats"])


def broadcast_parameters(params, group=None) -> None:
    """Rank 0's parameter values on every rank (DDP does this at wrap time; plain modules need it)."""
    if not dist.is_initialized():
        return
    source = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, source, group=group)

