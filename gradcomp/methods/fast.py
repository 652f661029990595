"""The fast CPU path: a method's math, written once in torch, compiled for big CPU tensors.

Eager torch runs a chain of ops, each a full pass over memory (an eager int8 encode is ~7 passes).
``torch.compile`` fuses the same function into one C++/OpenMP loop nest, so the math that defines
a method is also its fast path. The functions this module compiles write their results into
output tensors they are given (``out.copy_(math(...))``): the compiled loop stores straight into a
payload part, a decompress target or a residual, with no temporary and no extra pass.

Policy (ski rental, one rule: :func:`compiles_now`): a function runs eagerly, and is compiled
once the eager calls it could have run compiled (CPU tensors of at least
``GRADCOMP_CPU_COMPILE_MIN`` elements, default 1,000,000; compiled code wins from ~100k elements)
have taken as long as a compilation costs: ``GRADCOMP_CPU_COMPILE_AFTER_S`` seconds when set (0:
compile at the first such call), else the mean compile time measured in this process, or
:data:`EXPECTED_COMPILE_S` before the first. A short process (a script, a test, a first try)
never waits on the compiler; a training run pays it after a few seconds of eager work (in all,
at most twice what the better of compiling at once and never compiling costs, when the compile
time is estimated right) and runs compiled from then on. Smaller tensors and
every non-CPU tensor run eager; ``GRADCOMP_CPU_COMPILE=0`` turns compilation off. Compiled and
eager decodes give the same bits (one rounding per element), so ranks that switch at different
steps still decode every payload alike.

Full rows [m, w] are dynamic in m, so one compiled graph serves every size (one more for full
rows followed by a short last row); the width (a block or chunk) stays static and is
constant-folded. Every tensor reaches the compiled function at storage offset 0
(:func:`own_storage`), so a view's place in its buffer (a bucket, an all-gather's payloads, a row
after the full rows) never compiles again. Compiling a function costs 0.2-0.4 s with a warm
inductor cache and 1-4 s with an empty one, the first of a process more (~7 s warm, ~18 s cold:
torch's compiler starts), on 2 cores, once per process; the first compilation logs one warning
on the ``gradcomp`` logger that says so, and each its time at INFO.
"""
from __future__ import annotations

import functools
import logging
import os
import time

import torch

DEFAULT_COMPILE_MIN = 1_000_000
EXPECTED_COMPILE_S = 6.0
"""Seconds one function's compilation is expected to cost before any is measured in the process:
about the mean over the README's first block's five functions with an empty inductor cache on 2
cores (5.3 s; 1.6 s with a warm cache)."""
_OFF = ("0", "false", "no", "off")
log = logging.getLogger("gradcomp")
_announced = False  # whether the first compilation has been logged in this process
_compile_seconds: list[float] = []  # what each compilation cost in this process (wall seconds)


def compile_min_numel() -> int | None:
    """Elements from which CPU calls may run compiled, or None when compilation is turned off."""
    if os.environ.get("GRADCOMP_CPU_COMPILE", "1").strip().lower() in _OFF:
        return None
    raw = os.environ.get("GRADCOMP_CPU_COMPILE_MIN", "").strip()
    if not raw:
        return DEFAULT_COMPILE_MIN
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"GRADCOMP_CPU_COMPILE_MIN must be an integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"GRADCOMP_CPU_COMPILE_MIN must be >= 0, got {value}")
    return value


def compile_after_s() -> float:
    """Eager seconds after which a function compiles (see the module policy):
    ``GRADCOMP_CPU_COMPILE_AFTER_S`` when set, else the mean measured compile time of this
    process, else :data:`EXPECTED_COMPILE_S`."""
    raw = os.environ.get("GRADCOMP_CPU_COMPILE_AFTER_S", "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"GRADCOMP_CPU_COMPILE_AFTER_S must be a number of seconds, got {raw!r}") from None
        if not value >= 0:
            raise ValueError(f"GRADCOMP_CPU_COMPILE_AFTER_S must be >= 0, got {raw!r}")
        return value
    return sum(_compile_seconds) / len(_compile_seconds) if _compile_seconds else EXPECTED_COMPILE_S


def eligible(pieces) -> bool:
    """Whether a call on ``pieces`` (tuples of arguments) could run compiled: compilation on,
    every tensor on the CPU, and one argument of at least ``compile_min_numel()`` elements (an
    argument's size summed over the pieces: the rows of one tensor add up)."""
    threshold = compile_min_numel()
    if threshold is None:
        return False
    sizes = {}
    for args in pieces:
        for position, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                if a.device.type != "cpu":
                    return False
                sizes[position] = sizes.get(position, 0) + a.numel()
    return bool(sizes) and max(sizes.values()) >= threshold


def compiles_now(eager_seconds: float) -> bool:
    """The rule: a function whose eligible calls have run ``eager_seconds`` eagerly compiles now
    (and runs compiled from then on) once that reaches :func:`compile_after_s`: the renting has
    cost what buying costs."""
    return eager_seconds >= compile_after_s()


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor ``t`` as a tensor of its own: no view, storage offset 0, the same
    memory (a slice of its storage, no copy); ``t`` itself when it already is one. Dynamo guards
    a view's storage offset (its value 0 or 1, equalities between offsets) and its base, so the
    same shapes as views at other offsets, or as views and then not, compile again; given tensors
    of their own, a graph depends on shapes only. Views of one buffer that do not overlap (full
    rows and the short row) become tensors over separate storages, which they are; arguments
    that overlap must be one tensor object (kept as one by ``cpu_fast``) or only be read."""
    if t._base is None and t.storage_offset() == 0:
        return t
    if not t.is_contiguous():
        raise ValueError(f"cpu_fast: tensors must be contiguous, got strides {t.stride()} for shape "
                         f"{list(t.shape)}")
    start = t.storage_offset() * t.element_size()
    memory = t.untyped_storage()[start:start + t.numel() * t.element_size()]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(memory, 0, t.shape, t.stride())


def _vector_width() -> dict:
    """Inductor's vector width named for the ATen CPU capability in use (AVX-512: 512 bits, AVX2:
    256), the width it picks anyway: named, it enters the key of inductor's on-disk graph cache.
    Unnamed, a graph cached by a process of one capability (ATEN_CPU_CAPABILITY) was served to
    one of the other, whose compiler built its loops for the other width: wrong values (torch
    2.13; ``tests/test_core_compiled.py``)."""
    bits = {"AVX512": 512, "AVX2": 256}.get(torch.backends.cpu.get_cpu_capability())
    return {} if bits is None else {"cpp.simdlen": bits}


def _announce_compilation(name: str, eager_seconds: float) -> None:
    """Log, once per process, that the first compiled call is compiling (seconds, no output)."""
    global _announced
    if not _announced:
        _announced = True
        log.warning("gradcomp: compiling the CPU fast path with torch.compile (%s, after %.1f s of eager "
                    "calls on tensors of >= %d elements): seconds per function, once per process; "
                    "GRADCOMP_CPU_COMPILE_AFTER_S sets when, GRADCOMP_CPU_COMPILE=0 turns it off",
                    name, eager_seconds, compile_min_numel())


def cpu_fast(fn=None, *, options: dict | None = None):
    """Decorate a tensor function: eager, then compiled for big CPU tensors once that pays (the
    module policy).

    ``fn`` takes tensors (or None) and plain Python constants; non-tensor arguments are baked into
    the compiled graph (a new value compiles again). ``wrapper(*args)`` runs ``fn`` once;
    ``wrapper.each(pieces)`` runs it on each tuple of arguments in ``pieces`` (e.g. the full rows
    and the short last row of :func:`row_pieces`) in one compiled call: a compiled call costs
    ~50-60 us of dynamo and AOT wrappers, and a second call for a short row added ~45 us where
    the short row inside the same call adds ~25 us. The size rule looks at all pieces together.
    Rows [m, w] are dynamic in m; a short last row [1, w] is dynamic in w. Tensors are passed at
    storage offset 0 (:func:`own_storage`): one graph per shape class, whatever the views'
    offsets. ``wrapper.eager`` is the undecorated ``fn``; ``wrapper.compiled_calls`` counts the
    calls that took the compiled path, ``wrapper.eager_seconds`` the seconds of eligible calls
    run eagerly before it compiled. ``options``: inductor settings for this function's
    compilation (``@cpu_fast(options={...})``).
    """
    if fn is None:
        return functools.partial(cpu_fast, options=options)
    compiled = None

    def run_each(pieces):
        for args in pieces:
            fn(*args)

    # dynamo keeps its compiled graphs (and their recompile limit) per code object: one each
    run_each.__code__ = run_each.__code__.replace(co_name=f"{fn.__name__}_each")

    def each(pieces) -> None:
        nonlocal compiled
        pieces = list(pieces)
        if not eligible(pieces):
            run_each(pieces)
            return
        if compiled is None and not compiles_now(wrapper.eager_seconds):
            start = time.perf_counter()
            run_each(pieces)
            wrapper.eager_seconds += time.perf_counter() - start
            return
        first, start = compiled is None, time.perf_counter()
        if first:
            _announce_compilation(fn.__name__, wrapper.eager_seconds)
            compiled = torch.compile(run_each, dynamic=None, options={**_vector_width(), **(options or {})})
        moved = {}  # id -> the tensor at offset 0: a tensor passed twice stays one tensor
        for a in (a for args in pieces for a in args if isinstance(a, torch.Tensor)):
            moved.setdefault(id(a), own_storage(a))
        pieces = [tuple(moved[id(a)] if isinstance(a, torch.Tensor) else a for a in args)
                  for args in pieces]
        for t in (a for args in pieces for a in args if isinstance(a, torch.Tensor)):
            if t.dim() >= 2 and t.shape[0] == 1:
                torch._dynamo.maybe_mark_dynamic(t, 1)
            elif t.dim():
                torch._dynamo.maybe_mark_dynamic(t, 0)
        wrapper.compiled_calls += 1
        with torch.no_grad():  # one grad mode: dynamo guards on it (the functions only write outputs)
            compiled(pieces)
        if first:  # the first compiled call is the compilation (torch._dynamo's import too; its run
                   # is milliseconds)
            _compile_seconds.append(time.perf_counter() - start)
            log.info("gradcomp: compiled %s in %.1f s", fn.__name__, _compile_seconds[-1])

    @functools.wraps(fn)
    def wrapper(*args) -> None:
        each([args])

    wrapper.each = each
    wrapper.eager = fn
    wrapper.compiled_calls = 0
    wrapper.eager_seconds = 0.0
    return wrapper


def row_pieces(rows: int, *tensors_and_widths):
    """Cut 1-D tensors into full rows and a short last row, in step.

    Each argument is (flat tensor or None, width): the tensor's first ``rows * width`` elements
    viewed [rows, width], and the rest viewed [1, rest]. Yields the tuple of heads, then the tuple
    of tails, skipping a piece that the first tensor does not have (None stays None). Methods
    that work per block or chunk compute the full rows as one 2-D tensor, so the compiled loops
    need no masks, and the short last row as a second piece (in the same compiled call).
    """
    first, width = tensors_and_widths[0]
    if rows:
        yield tuple(None if flat is None else flat[:rows * width].view(rows, width)
                    for flat, width in tensors_and_widths)
    if first.numel() > rows * width:
        yield tuple(None if flat is None else flat[rows * width:].view(1, -1)
                    for flat, width in tensors_and_widths)
