"""Counting the global-memory bytes an operation moves, without a GPU.

Two counters, both active inside :func:`count_bytes`:
- Triton kernels run by the interpreter (TRITON_INTERPRET=1): every load, store and atomic of
  the interpreter's builder is counted as (distinct addresses touched by that instruction,
  masked lanes excluded) x element size, because lanes of one instruction reading the same
  address coalesce into one memory transaction on a GPU; an atomic read-modify-write counts
  twice per active lane (atomics on one address are serialized, not merged).
- torch operators (a TorchDispatchMode): each aten operator reads its tensor operands once and
  writes its results once (views move nothing; a gather or scatter moves the elements it
  selects, not the whole tensor it indexes). This is how a chain of separate torch ops is costed,
  and it is a lower bound for them (a sort or a reduction may make more than one pass).
Torch operators that the interpreter itself runs while launching a kernel are not counted; the
callbacks of Futures chained inside the block are counted on whichever thread runs them.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_SELECTING = {_aten.index.Tensor, _aten.index_select.default, _aten.gather.default,
              _aten.take.default}
_WRITING_AT = {_aten.index_put_.default, _aten.index_put.default, _aten.scatter_.src,
               _aten.index_copy_.default}
_ADDING_AT = {_aten.index_add_.default, _aten.index_add.default, _aten.scatter_add_.default,
              _aten.scatter_add.default}
_WRITE_ONLY = {_aten.zero_.default, _aten.fill_.Scalar, _aten.zeros_like.default,
               _aten.ones_like.default, _aten.full_like.default}
_FREE = {_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
         _aten.new_empty.default, _aten.new_empty_strided.default, _aten.lift_fresh.default,
         _aten.detach.default, _aten.alias.default,
         _aten._unsafe_view.default}  # a view (reshape's second half after a clone) not tagged as one


@dataclass
class Traffic:
    """Bytes moved: by interpreted Triton kernels, by torch operators; and how many of each ran."""

    kernel_bytes: int = 0
    torch_bytes: int = 0
    launches: list[tuple[str, int]] = field(default_factory=list)
    """(kernel name, bytes) per interpreted kernel launch, in order."""
    torch_ops: list[tuple[str, int]] = field(default_factory=list)
    """(aten operator, bytes) in the order they ran."""

    @property
    def total(self) -> int:
        return self.kernel_bytes + self.torch_bytes


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _flat_tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _flat_tensors(v)


def torch_op_bytes(func, args, kwargs, result) -> int:
    """Bytes one aten operator moves: its operands read once, its results written once."""
    if func in _FREE or func.is_view or func.namespace == "c10d":
        return 0
    outs = list(_flat_tensors(result if isinstance(result, (list, tuple)) else [result]))
    written = sum(_tensor_bytes(t) for t in outs)
    if func in _WRITE_ONLY:
        return written
    if func in _SELECTING:
        indices = sum(_tensor_bytes(t) for t in _flat_tensors(args[1:]))
        return indices + 2 * written
    if func in _WRITING_AT or func in _ADDING_AT:  # (self, ..., indices, ..., values)
        operands = list(_flat_tensors(args[1:]))
        values = _tensor_bytes(operands[-1])
        indices = sum(_tensor_bytes(t) for t in operands[:-1])
        accumulate = func in _ADDING_AT or bool(
            kwargs.get("accumulate", args[3] if len(args) > 3 else False))
        return indices + values * (3 if accumulate else 2)  # read values (and self there), write
    out_ids = {id(t) for t in _flat_tensors(kwargs.values())}
    read = sum(_tensor_bytes(t) for t in _flat_tensors(list(args) + list(kwargs.values()))
               if id(t) not in out_ids)
    return read + written


_thread = threading.local()
"""Per thread: ``counting`` (a torch counter is active here), ``launching`` (inside a kernel
launch: the interpreter's own torch operators are not the operation's)."""


class _TorchCounter(TorchDispatchMode):
    def __init__(self, traffic: Traffic, lock: threading.Lock):
        super().__init__()
        self.traffic, self.lock = traffic, lock

    def __enter__(self):
        _thread.counting = True
        return super().__enter__()

    def __exit__(self, *exc):
        _thread.counting = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not getattr(_thread, "launching", 0):
            moved = torch_op_bytes(func, args, kwargs, result)
            if moved:
                with self.lock:
                    self.traffic.torch_bytes += moved
                    self.traffic.torch_ops.append((str(func.overloadpacket.__name__), moved))
        return result


def _distinct_bytes(ptrs, mask) -> int:
    addresses = ptrs.data if mask is None else ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]
    element = ptrs.get_element_ty().primitive_bitwidth // 8
    return int(np.unique(addresses).size) * element


def _lane_bytes(ptrs, mask) -> int:
    lanes = ptrs.data.size if mask is None else int(np.count_nonzero(
        np.broadcast_to(mask.data, ptrs.data.shape)))
    return lanes * (ptrs.get_element_ty().primitive_bitwidth // 8)


@contextlib.contextmanager
def count_bytes(torch_ops: bool = True):
    """Count global-memory bytes inside the block (yields a :class:`Traffic`).

    Kernels must run under TRITON_INTERPRET=1; ``torch_ops`` also counts torch operators.
    """
    from triton.runtime import interpreter

    traffic = Traffic()
    builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    saved = {name: getattr(builder, name) for name in
             ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")}
    saved_call = executor.__call__
    saved_then = torch._C.Future.then
    lock = threading.Lock()
    counter = _TorchCounter(traffic, lock) if torch_ops else None

    def counted_then(self, callback):
        """A Future's callback counts too, on whichever thread completes the Future (a
        collective's callback runs on the process group's thread, outside this mode)."""
        def counted_callback(fut):
            if getattr(_thread, "counting", False):
                return callback(fut)
            with _TorchCounter(traffic, lock):
                return callback(fut)
        return saved_then(self, counted_callback)

    def masked_load(self, ptrs, mask, other, *args):
        traffic.kernel_bytes += _distinct_bytes(ptrs, mask)
        return saved["create_masked_load"](self, ptrs, mask, other, *args)

    def masked_store(self, ptrs, value, mask, *args):
        traffic.kernel_bytes += _distinct_bytes(ptrs, mask)
        return saved["create_masked_store"](self, ptrs, value, mask, *args)

    def atomic_rmw(self, op, ptr, val, mask, *args):
        traffic.kernel_bytes += 2 * _lane_bytes(ptr, mask)
        return saved["create_atomic_rmw"](self, op, ptr, val, mask, *args)

    def atomic_cas(self, ptr, cmp, val, *args):
        traffic.kernel_bytes += 2 * _lane_bytes(ptr, None)
        return saved["create_atomic_cas"](self, ptr, cmp, val, *args)

    def launch(self, *args, **kwargs):
        before = traffic.kernel_bytes
        _thread.launching = getattr(_thread, "launching", 0) + 1
        try:
            return saved_call(self, *args, **kwargs)
        finally:
            _thread.launching -= 1
            traffic.launches.append((self.fn.__name__, traffic.kernel_bytes - before))

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    executor.__call__ = launch
    if counter is not None:
        torch._C.Future.then = counted_then
    try:
        with counter if counter is not None else contextlib.nullcontext():
            yield traffic
    finally:
        for name, fn in saved.items():
            setattr(builder, name, fn)
        executor.__call__ = saved_call
        torch._C.Future.then = saved_then
