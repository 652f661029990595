"""What every kernel module shares: launch configuration, dtype plumbing and exact-rounding helpers.

Configs: on a GPU each kernel is wrapped in ``triton.autotune`` over the configs its module ships
(keyed on the problem size). Under ``TRITON_INTERPRET=1`` autotuning with several configs fails,
and programs run one after another, so one fixed CPU config with a large tile is used instead.

Exactness: every launch passes ``enable_fp_fusion=False`` so that ``a * b + c`` is rounded twice,
as torch rounds it (an FMA would differ from the torch reference in the last bit), and fp32
divisions use ``tl.math.div_rn`` (Triton's ``/`` compiles to the approximate ``div.full.f32``).
bf16 tensors are passed to kernels as int16 views and converted with integer bit operations: the
interpreter has no bf16 arithmetic and truncates fp32 -> bf16, compiled code rounds to nearest even.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

GRADIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""Gradient dtypes every launcher accepts (converted to fp32 on load, as torch's ``.float()``)."""

EXACT = {"enable_fp_fusion": False}
"""Launch options of every kernel: no FMA contraction (bit-exact with torch's rounding)."""


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0", "false")


LAUNCH_LOCK = threading.RLock()
"""Held by every kernel launch of this package (:class:`SerializedLaunch`), so that threads
launch one kernel at a time.

Two threads do launch at once: a DDP hook compresses the next bucket on the autograd thread while
a communication future's callback decodes the previous one on the backend's thread. Neither
Triton runtime is thread-safe there. The interpreter patches ``triton.language`` module-wide for
the duration of a launch (``_patch_lang``, undone by ``restore()`` at its end) and keeps the
program id in one global builder, so a launch ending on one thread unpatches ``tl.load`` under
another thread's running kernel ("Did you forget to add @triton.jit?") or moves its program id.
On GPUs ``triton.autotune`` keeps each call's arguments (``nargs``) and its ``restore_value``
copies on the shared Autotuner object, so two first calls benchmarking at once would save and
restore each other's residuals. A launch only enqueues work on a GPU (tens of microseconds of
Python, all under the GIL anyway), so the lock costs an uncontended acquire per launch; it is
held across the benchmark runs only on a kernel's first call per tuning key.
"""


class SerializedLaunch:
    """A kernel launched as ``kernel[grid](*args, **kwargs)`` under :data:`LAUNCH_LOCK`.

    ``kernel`` is the ``triton.autotune`` kernel GPUs run. With ``config`` (the interpreter, where
    autotuning fails) its @triton.jit function ``fn`` is launched with that one config's
    meta-parameters instead; the autotuner stays inspectable (configs, key, restore/reset), so
    tests can run it under the interpreter with their own benchmark loop.
    """

    def __init__(self, kernel, config: triton.Config | None = None):
        self.kernel, self.config = kernel, config
        self.fn = getattr(kernel, "fn", kernel)

    def __getitem__(self, grid):
        kernel = self.fn if self.config is not None else self.kernel
        meta = self.config.kwargs if self.config is not None else {}

        def launch(*args, **kwargs):
            with LAUNCH_LOCK:
                return kernel[grid](*args, **kwargs, **meta)

        return launch


def tuned(configs: list[triton.Config], cpu_config: triton.Config, key: list[str],
          restore: tuple[str, ...] = (), reset: tuple[str, ...] = ()):
    """Decorate a @triton.jit kernel: autotuned over ``configs`` on GPUs, ``cpu_config`` when
    interpreting (several configs fail there: "0 active drivers"); every launch holds
    :data:`LAUNCH_LOCK`. ``restore`` names every output written in place (residuals, in-place
    matrices) and ``reset`` every output that atomics add into (counters, sums), so that
    autotuning's repeated trial launches leave them as a single launch would
    (tests/interpreted/test_autotune.py runs every kernel through autotune's own trial loop).
    ``key`` names size classes (:func:`size_class`) and small bounded arguments, never an exact
    size: every new key value costs a compile and a benchmark of every config.
    """
    def wrap(kernel):
        autotuner = triton.autotune(configs=configs, key=key, restore_value=list(restore),
                                    reset_to_zero=list(reset))(kernel)
        return SerializedLaunch(autotuner, cpu_config if interpreting() else None)

    return wrap


def size_class(n: int) -> int:
    """The autotuning class of a size: the next power of two (sizes within 2x share a config)."""
    return triton.next_power_of_2(max(int(n), 1))


def plane_runs(n: int, width: int, planes: int) -> list[tuple[int, int, int]]:
    """The launches of a :func:`plane_tile` kernel over n elements in runs of ``width``: (first
    run, end run, plane) for the full runs (plane = width / planes) and, when planes > 1, one
    more for a short last run (plane = ceil(rest / planes)). Each launch has one plane size, so
    the compiler can prove the full runs' plane offsets 16-byte aligned and use wide accesses."""
    full, rest = divmod(n, width)
    if planes == 1:
        return [(0, full + (rest > 0), width)]
    runs = [(0, full, width // planes)] if full else []
    return runs + ([(full, full + 1, triton.cdiv(rest, planes))] if rest else [])


def plane_grid(first: int, end: int, width: int):
    """Grid of one :func:`plane_runs` launch: TILE // next_power_of_2(width) whole runs per
    program, at least one."""
    padded = triton.next_power_of_2(width)
    return lambda meta: (triton.cdiv(end - first, max(1, meta["TILE"] // padded)),)


def jit_function(kernel):
    """The @triton.jit function behind a ``tuned`` kernel (for ahead-of-time compilation)."""
    return kernel.fn if isinstance(kernel, SerializedLaunch) else kernel


def kernel_view(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor as the kernel reads it, is_bf16): bf16 tensors travel as int16 bit patterns."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    return t, False


def check_flat(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], device=None,
               rows: bool = False) -> None:
    """Raise TypeError/ValueError unless ``t`` is a contiguous tensor of one of ``dtypes`` (with
    ``rows``: a 2-D tensor whose rows are each contiguous, at any row stride, e.g. one part of the
    payloads of p ranks side by side in a gathered buffer)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if rows:
        if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"{name} must be 2-D with contiguous rows, got shape {list(t.shape)} "
                             f"and strides {t.stride()}")
    elif not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_cuda and not interpreting():
        raise ValueError(f"{name} is on {t.device}: the Triton kernels need CUDA tensors, or "
                         "TRITON_INTERPRET=1 set before triton is imported to run them on the CPU")


def to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without a host sync: on CUDA a pinned copy
    enqueued on the current stream (a pageable copy would wait for the device)."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def decode_target(n: int, dtype: torch.dtype, out: torch.Tensor | None, device) -> torch.Tensor:
    """The flat [n] tensor a decode kernel writes: ``out`` (checked; e.g. a DDP bucket, any
    floating dtype) or a new tensor of ``dtype``."""
    if out is None:
        return torch.empty(n, dtype=dtype, device=device)
    check_flat("out", out, GRADIENT_DTYPES, device)
    if out.numel() != n:
        raise ValueError(f"out must have {n} elements, got {out.numel()}")
    return out.view(-1)


def check_addend(addend: torch.Tensor | None, n: int, device) -> tuple[torch.Tensor | None, bool]:
    """(the addend as a decode-sum kernel reads it, is_bf16): None for no addend, else a
    contiguous floating-point tensor of n elements on ``device`` (checked; bf16 as int16 bits),
    which the kernel loads as its accumulator's start (:func:`load_scaled_f32`)."""
    if addend is None:
        return None, False
    check_flat("addend", addend, GRADIENT_DTYPES, device)
    if addend.numel() != n:
        raise ValueError(f"addend must have {n} elements, got {addend.numel()}")
    return kernel_view(addend.view(-1))


WIDE_LOADS, WIDE_STORES = r"ld\.global\.v4", r"st\.global\.v4"
ASYNC_WIDE_LOADS = r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], (16|0x10)\b"
"""Tiles that feed tl.dot are loaded with 16-byte asynchronous copies into shared memory."""


@dataclass(frozen=True)
class CompileCase:
    """One kernel variant as it ships: what the ahead-of-time compile test builds for sm_80/sm_90.

    signature: argument name -> Triton type ("*fp32", "i32", "constexpr", ...).
    aligned:   pointer and size arguments the JIT would mark 16-divisible for aligned tensors.
    wide:      regexes the PTX must match: the 128-bit memory instructions of the kernel's
               dominant streams (e.g. ``ld.global.v4`` for the gradient and residual).
    """

    name: str
    kernel: object
    signature: dict
    constexprs: dict
    num_warps: int
    aligned: tuple[str, ...] = ()
    wide: tuple[str, ...] = ()
    options: dict = field(default_factory=lambda: dict(EXACT))


# ---- device helpers -------------------------------------------------------------------------

@triton.jit
def bf16_bits_to_f32(bits):
    """int16 bf16 bit patterns -> fp32 (exact)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(v):
    """fp32 -> bf16 bit patterns as int16, rounded to nearest even like torch (NaN -> 0x7FC0)."""
    u = v.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def load_f32(ptr, offs, mask, IS_BF16: tl.constexpr):
    """Elements at ``offs`` as fp32 (0 where masked); bf16 arrives as int16 bits."""
    if IS_BF16:
        return bf16_bits_to_f32(tl.load(ptr + offs, mask=mask, other=0))
    return tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)


@triton.jit
def load_scaled_f32(ptr, offs, mask, prescale, IS_BF16: tl.constexpr):
    """``prescale`` (fp32) times the elements at ``offs`` loaded as fp32 (:func:`load_f32`): one
    rounding of the product, as the torch path's ``x.float() * scale``. A prescale of 1 leaves
    the loaded values as they are (a GPU's multiply would make a NaN's sign bit positive)."""
    v = load_f32(ptr, offs, mask, IS_BF16)
    return tl.where(prescale != 1.0, v * prescale, v)


@triton.jit
def store_f32(ptr, offs, v, mask, IS_BF16: tl.constexpr):
    """Store fp32 ``v`` converted to the pointer's dtype (round to nearest even; bf16 as bits)."""
    if IS_BF16:
        tl.store(ptr + offs, f32_to_bf16_bits(v), mask=mask)
    else:
        tl.store(ptr + offs, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def plane_tile(width, n, first, end, plane, ROWS: tl.constexpr, PLANES: tl.constexpr,
               PLANE_WIDTH: tl.constexpr):
    """This program's ROWS runs of ``width`` elements (of n), counted from run ``first`` (runs at
    or past ``end`` masked), each cut into PLANES planes of ``plane`` consecutive elements: a
    [ROWS, PLANES, PLANE_WIDTH] tile (PLANE_WIDTH >= plane, a power of two), element (p, j) of a
    run being its element p * plane + j: bit p of byte j (sign), nibble p of byte j (int4), or
    simply element j with one plane (int8). Returns (run indices [ROWS], offsets, mask)."""
    rows = first + tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    p = tl.arange(0, PLANES)[None, :, None]
    j = tl.arange(0, PLANE_WIDTH)[None, None, :]
    within = p.to(tl.int64) * plane + j
    length = tl.minimum(n - rows * width, width)[:, None, None]
    mask = (rows[:, None, None] < end) & (j < plane) & (within < length)
    return rows, rows[:, None, None] * width + within, mask


@triton.jit
def is_finite(v):
    return tl.abs(v) < float("inf")


@triton.jit
def round_half_even(t):
    """Round to the nearest integer, ties to even, for |t| < 2**22 (as torch.round).

    Adding and subtracting 1.5 * 2**23 pushes the fraction bits out under round-to-nearest-even;
    libdevice's rint is unavailable in the interpreter. Needs fp fusion off (see EXACT).
    """
    return (t + 12582912.0) - 12582912.0
