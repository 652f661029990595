"""The contract every compression method fulfils, and the checks all of them share."""
from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from ..checks import check_number
from ..payload import Payload, wire_layout
from .fast import cpu_fast

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SEED_STEP_STRIDE = 1_000_003
"""A stochastic method's seed at its t-th compress of a tensor: ``seed + SEED_STEP_STRIDE * t``."""
SEED_RANK_STRIDE = 1_000_033
"""The fronts give rank r a method's ``seed`` option plus ``SEED_RANK_STRIDE * r`` (see
:func:`gradcomp.methods.on_rank`), so that ranks draw independent random numbers."""
BACKENDS = ("auto", "torch", "triton")


def check_tensor(x) -> None:
    """Raise a TypeError naming the problem unless ``x`` is a floating-point torch.Tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"gradcomp compresses floating-point tensors (float32, float16, bfloat16, float64); "
            f"got dtype {x.dtype}"
        )


def backend() -> str:
    """The backend forced by ``GRADCOMP_BACKEND`` (``torch`` or ``triton``), else ``auto``."""
    value = os.environ.get("GRADCOMP_BACKEND", "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"GRADCOMP_BACKEND must be one of {BACKENDS}, got {value!r}")
    return value


@contextlib.contextmanager
def forced_backend(name: str):
    """``GRADCOMP_BACKEND=name`` inside the block, restored after (tests and benchmarks compare
    the two paths with it)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    saved = os.environ.get("GRADCOMP_BACKEND")
    os.environ["GRADCOMP_BACKEND"] = name
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("GRADCOMP_BACKEND", None)
        else:
            os.environ["GRADCOMP_BACKEND"] = saved


@functools.cache
def triton_import_error() -> ImportError | None:
    """None where triton imports, else why not: triton ships for Linux only (torch depends on it
    only there), so on macOS and Windows every method runs its torch path (:func:`use_triton`)
    and the kernel families are never imported (:func:`kernel_family`). Asked on first need, not
    at import: importing triton costs ~0.15 s that CPU work and the analyser never use. Also
    readable as the module attribute ``TRITON_IMPORT_ERROR``."""
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return err
    return None


def __getattr__(name: str):
    if name == "TRITON_IMPORT_ERROR":
        return triton_import_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _KernelFamily:
    """A kernel family's module, ``gradcomp.kernels.<name>``, imported at its first attribute read
    (with triton): every read goes to the module itself (a test's monkeypatch included)."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str):
        self._name, self._module = name, None

    def __getattr__(self, attr: str):
        if self._module is None:
            self._module = importlib.import_module(f"..kernels.{self._name}", __package__)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<kernel family gradcomp.kernels.{self._name}, {'imported' if self._module else 'not imported yet'}>"


def kernel_family(name: str):
    """The Triton launchers of a kernel family, ``gradcomp.kernels.<name>``, imported at their
    first use: a method reads them only where :func:`use_triton` is True, so where triton is not
    importable they never are (reading one there raises the ImportError). Declared bytes need no
    triton (``gradcomp.kernels.declared``)."""
    return _KernelFamily(name)


def use_triton(x: torch.Tensor) -> bool:
    """True when ``x`` goes to the Triton kernels: CUDA tensors where triton is installed, or
    GRADCOMP_BACKEND=triton (an ImportError naming the package where it is not)."""
    chosen = backend()
    if chosen == "torch" or (chosen == "auto" and not x.is_cuda):
        return False
    error = triton_import_error()
    if error is None:
        return True
    if chosen == "triton":
        raise ImportError(
            f"GRADCOMP_BACKEND=triton needs the triton package, which cannot be imported here "
            f"({error}). Triton runs on Linux (pip install 'triton>=3.6'); "
            "elsewhere unset GRADCOMP_BACKEND or set it to torch: every method has a torch path",
            name="triton") from error
    return False


def divided(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor rounded correctly (one IEEE division per element) on every device, as the
    kernels divide (``tl.math.div_rn``), the divisor rounded to t's dtype first (as a kernel's
    fp32 argument). Eager, the divisor is a 0-dim tensor on t's device: torch on CUDA computes
    ``t / python_number`` as ``t * (1 / number)``, which differs in the last bit for some
    quotients. Inside the CPU fast path's compiled code (:mod:`.fast`), inductor divides by the
    number itself, correctly rounded (tests/test_core_compiled.py compares it with eager bit for
    bit); a 0-dim tensor built inside the int8 encode's compiled graph corrupted the heap
    ("free(): invalid next size", torch 2.13 CPU)."""
    if torch.compiler.is_compiling():
        return t / divisor
    return t / torch.full((), divisor, dtype=t.dtype, device=t.device)


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor on ``t``'s device: whether ``t``'s sum is finite, which it is not whenever
    an element is NaN or inf (one read of t, no host sync; a caller that branches on the host
    reads it with ``bool()``). A sum of finite values that overflows also reads as not finite:
    callers take the safe branch then (PowerSGD keeps the old Q; an optimizer skips the step)."""
    return torch.isfinite(t.sum())


@cpu_fast
def finite_residual(corrected: torch.Tensor, decoded: torch.Tensor, residual: torch.Tensor) -> None:
    """residual <- corrected - decoded where that is finite, else 0 (in place, fp32).

    A non-finite gradient must reach the optimizer (the payload carries it) but must never be
    carried into the next step by the error-feedback memory. ``decoded`` may be ``residual``.
    """
    diff = corrected.reshape(residual.shape) - decoded.reshape(residual.shape).float()
    residual.copy_(torch.where(torch.isfinite(diff), diff, 0.0))


@dataclass(frozen=True)
class Method:
    """A compressor: ``compress`` a tensor into a :class:`Payload` and ``decompress`` it back.

    Subclasses are frozen dataclasses whose fields are the method's options; ``__post_init__``
    validates them. Class attributes say what every front needs to know:

    schemes: the names of the ``gradcomp.schemes.SCHEMES`` its payloads support (``allreduce``
        sums the parts on the wire; ``allgather`` gathers every rank's payload and decodes-and-sums
        them; ``twophase`` all-to-alls p chunk payloads, sums and re-compresses one chunk per
        rank, all-gathers; ``lowrank`` is PowerSGD's all-reduce of P, then of Q); the first is
        the DDP hook's default.
    per_tensor: compressed tensor by tensor with its own shape (PowerSGD's matrices), not as the
        flat bucket.
    error_feedback_default: whether the hooks keep a residual unless told otherwise.
    prescales: ``_compress`` takes ``compress``'s ``scale`` and folds it into its own pass (the
        kernels multiply right after the load); otherwise ``compress`` multiplies the input
        first, one more pass over it (see :meth:`compress`).
    granule: elements coded together (a block or chunk); a two-phase chunk is a multiple of it,
        so that p chunk payloads side by side are one payload of their concatenation.
    indexed: its payloads carry element indices (top-k), which a decode checks against the
        tensor's size (see :meth:`decode_sum`'s ``dropped``).
    decode_group: rows :meth:`decode_sum` adds up as one group (sign: 4, its kernel looks each
        element's group sum up in a table); 1: plain row order.
    """

    name: ClassVar[str]
    schemes: ClassVar[tuple[str, ...]] = ("allgather",)
    per_tensor: ClassVar[bool] = False
    indexed: ClassVar[bool] = False
    error_feedback_default: ClassVar[bool] = True
    prescales: ClassVar[bool] = False
    decode_group: ClassVar[int] = 1

    @property
    def summable(self) -> bool:
        """Whether payloads of several ranks may be summed part by part on the wire."""
        return "allreduce" in self.schemes

    @property
    def granule(self) -> int:
        return 1

    def compress(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 state: dict | None = None, scale: float = 1.0) -> Payload:
        """Compress ``scale * x`` (+ ``residual`` if given: error feedback).

        residual: contiguous fp32 tensor with x's number of elements, updated in place to what was
            owed but not sent: (scale * x + residual) - decoded, zero where that is not finite,
            where decoded is the payload decoded in fp32 (before any cast to x's dtype).
        state: the method's per-tensor memory kept by ErrorFeedback (PowerSGD's warm-start Q,
            a step counter for stochastic rounding); None for a stateless call.
        scale: a finite positive number (the fronts pass 1 / world size: the sum over ranks of
            the payloads is then the mean). x is converted to fp32, multiplied by scale rounded to
            fp32 and the product rounded to fp32, then the residual is added: two roundings,
            what ``x.float() * scale`` followed by compressing it computes, on every device and
            in the kernels, for a method that ``prescales`` (in its own pass). For the others
            this multiplies first, in x's dtype (torch's ``x * scale``, a new tensor: the same
            product for fp32 x, rounded once more to a 16-bit x's dtype); scale 1 costs nothing.
        """
        check_tensor(x)
        if residual is not None and (
                not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32
                or residual.numel() != x.numel() or residual.device != x.device
                or not residual.is_contiguous()):
            got = (f"{residual.dtype}[{residual.numel()}] on {residual.device}"
                   if isinstance(residual, torch.Tensor) else type(residual).__name__)
            raise ValueError(f"residual must be a contiguous float32 tensor with {x.numel()} "
                             f"elements on {x.device}, got {got}")
        check_number(f"{self.name}.compress", "scale", scale, 0, low_open=True, finite=True)
        state = state if state is not None else {}
        if self.prescales:
            return self._compress(x, residual, state, float(scale))
        # x's dtype kept (a payload may carry values in it: top-k); for fp32 x the same product
        return self._compress(x if scale == 1 else x * float(scale), residual, state)

    def decompress(self, payload: Payload, out: torch.Tensor | None = None,
                   dropped: torch.Tensor | None = None) -> torch.Tensor:
        """The dense tensor of ``payload.shape`` and ``payload.dtype``.

        out: optional contiguous floating-point tensor with ``payload.numel`` elements to write the
            result into (e.g. a DDP bucket); it is returned. Its dtype may differ from the
            payload's (the fp32 decode is cast on store).
        dropped: as in :meth:`decode_sum`, an int64 tensor [1] (or None: entries outside the
            tensor raise).
        """
        if isinstance(payload, Payload) and payload.rows is not None:
            raise ValueError(f"decompress takes one payload; this one stacks {payload.rows} rows "
                             "(use decode_sum)")
        return self.decode_sum(payload.as_rows() if isinstance(payload, Payload) else payload, out,
                               dropped=dropped)

    def decode_sum(self, payloads: Payload, out: torch.Tensor | None = None,
                   addend: torch.Tensor | None = None, addend_scale: float = 1.0,
                   dropped: torch.Tensor | None = None) -> torch.Tensor:
        """``addend_scale * addend`` (when given) plus the sum of the decoded rows of a stacked
        payload (parts [p, ...]: ``Payload.stack`` or an all-gather's ``Payload.unflatten``),
        shaped and typed like ``decompress``'s result or written into ``out`` (as in decompress).
        On CUDA (or GRADCOMP_BACKEND=triton) one fused kernel launch reads every row (and the
        addend) and writes ``out`` once.

        Accumulated in fp32 in this order: acc = fp32(addend) * fp32(addend_scale) (the product
        rounded to fp32; the addend as it is for scale 1), then acc += the sum of each group of
        ``decode_group`` rows (row 0 to g - 1, row g to 2g - 1, ...; a group's decoded rows
        summed in row order; ``decode_group`` 1: acc += row 0, row 1, ...); without an addend acc
        starts at the first group's sum. Cast to out's dtype on store. With 0 rows:
        ``addend_scale * addend``, or zeros.

        addend: None, or a contiguous floating-point tensor (any float dtype) with
            ``payloads.numel`` elements on the payloads' device: e.g. FSDP's own row of the
            reduce-scatter input, which never crosses the wire. It may be ``out`` itself.
        addend_scale: a finite positive number (FSDP passes 1 / world size for an average).
        dropped: for an ``indexed`` method (top-k), None or an int64 tensor [rows] on the payloads'
            device. Payload bytes may come from another process: an entry whose index lies
            outside [0, numel) is never read or written through; it is dropped (not decoded)
            and counted into ``dropped[row]`` on the device, with no host synchronisation (the
            fronts keep this counter in their statistics). With ``dropped`` None, such entries
            raise a ValueError naming the row and the part after the decode (reading the count:
            a host synchronisation on CUDA).

        Every part's dtype and size are checked against the method's layout (:meth:`parts_layout`)
        before anything is read: a part of the wrong length or dtype, or rows that disagree,
        raise a ValueError naming the part. Non-finite values (scales, top-k values) are decoded
        as they are: they give non-finite sums, as an uncompressed exchange of them would.
        """
        if not isinstance(payloads, Payload):
            raise TypeError(f"expected a gradcomp.Payload, got {type(payloads).__name__}")
        if payloads.method != self.name:
            raise ValueError(f"a {payloads.method!r} payload cannot be decoded by method {self.name!r}")
        if payloads.options != self.options():
            raise ValueError(f"{self.name}: payload was made with options {payloads.options}, "
                             f"this method has {self.options()}")
        if payloads.rows is None:
            raise ValueError("decode_sum takes a stacked payload (Payload.stack or as_rows())")
        self.check_parts(payloads)
        check_number(f"{self.name}.decode_sum", "addend_scale", addend_scale, 0, low_open=True,
                     finite=True)
        if addend is not None:
            if (not isinstance(addend, torch.Tensor) or addend.dtype not in FLOAT_DTYPES
                    or addend.numel() != payloads.numel or addend.device != payloads.device
                    or not addend.is_contiguous()):
                got = (f"{addend.dtype}{list(addend.shape)} on {addend.device}"
                       f"{'' if addend.is_contiguous() else ' (not contiguous)'}"
                       if isinstance(addend, torch.Tensor) else type(addend).__name__)
                raise ValueError(f"{self.name}.decode_sum: addend must be a contiguous "
                                 f"floating-point tensor with {payloads.numel} elements on "
                                 f"{payloads.device}, got {got}")
            addend = addend.view(-1)
        if out is None:
            out = torch.empty(payloads.shape, dtype=payloads.dtype, device=payloads.device)
        else:
            check_tensor(out)
            if out.numel() != payloads.numel or not out.is_contiguous() or out.device != payloads.device:
                raise ValueError(f"out must be a contiguous tensor with {payloads.numel} elements on "
                                 f"{payloads.device}, got {list(out.shape)} on {out.device}")
        flat = out.view(-1)
        scale = float(addend_scale)
        counted = {}
        if self.indexed:
            if dropped is not None and (not isinstance(dropped, torch.Tensor) or dropped.dtype != torch.int64
                                        or tuple(dropped.shape) != (payloads.rows,)
                                        or dropped.device != payloads.device):
                got = (f"{dropped.dtype}{list(dropped.shape)} on {dropped.device}"
                       if isinstance(dropped, torch.Tensor) else type(dropped).__name__)
                raise ValueError(f"{self.name}.decode_sum: dropped must be an int64 tensor "
                                 f"[{payloads.rows}] on {payloads.device}, got {got}")
            counted["dropped"] = (dropped if dropped is not None else
                                  torch.zeros(payloads.rows, dtype=torch.int64, device=payloads.device))
        if payloads.rows == 0:
            if addend is None:
                flat.zero_()
            else:
                scaled_addend_into(addend, scale, flat)
        elif not (use_triton(flat) and self._kernel_decode_sum(payloads, flat, addend, scale, **counted)):
            self._torch_decode_sum(payloads, flat, addend, scale, **counted)
        if counted and dropped is None:
            _refuse_dropped(self.name, payloads.numel, counted["dropped"])
        return out

    def parts_layout(self, shape: tuple, dtype: torch.dtype) -> dict | None:
        """{part name: (dtype, shape)} of one payload of a tensor of ``shape`` and ``dtype``: what
        a decode reads. None: not declared (a plug-in method; only the parts' rows are checked)."""
        return None

    def check_parts(self, payloads: Payload) -> None:
        """Raise ValueError naming the part unless every part of the stacked ``payloads`` holds
        ``rows`` rows of the dtype and size :meth:`parts_layout` declares (host metadata only:
        nothing is read from the device)."""
        rows = payloads.rows
        if not isinstance(rows, int) or rows < 0:
            raise ValueError(f"{self.name} payload: rows must be an integer >= 0, got {rows!r}")
        if payloads.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{self.name} payload: dtype must be a floating-point dtype, got {payloads.dtype}")
        for name, part in payloads.parts.items():
            if not isinstance(part, torch.Tensor) or part.dim() < 1 or part.shape[0] != rows:
                got = (f"{part.dtype}{list(part.shape)}" if isinstance(part, torch.Tensor)
                       else type(part).__name__)
                raise ValueError(f"{self.name} payload: part {name!r} must have {rows} rows (one "
                                 f"per payload), got {got}")
            if part.device != payloads.device:
                raise ValueError(f"{self.name} payload: part {name!r} is on {part.device}, the "
                                 f"others on {payloads.device}")
        layout = self.parts_layout(tuple(payloads.shape), payloads.dtype)
        if layout is None:
            return
        if list(payloads.parts) != list(layout):
            raise ValueError(f"{self.name} payload: parts {list(payloads.parts)}, expected "
                             f"{list(layout)}")
        for name, (dtype, shape) in layout.items():
            part = payloads.parts[name]
            row_shape = tuple(part.shape[1:])
            fits = part.dtype == dtype and (
                row_shape == tuple(shape) if len(shape) > 1 else math.prod(row_shape) == math.prod(shape))
            if not fits:
                raise ValueError(f"{self.name} payload of {payloads.numel} elements: part {name!r} is "
                                 f"{part.dtype}{list(row_shape)} per row, expected {dtype}{list(shape)}")

    def wire_bytes(self, numel: int, shape: tuple | None = None, dtype=torch.float32) -> int:
        """Bytes a payload of a tensor with ``numel`` elements (and ``shape``) puts in a gathered
        or all-to-all buffer: its parts in the wire layout, padding included
        (``compress(x).nbytes``; from :meth:`parts_layout`)."""
        return wire_layout(self._layout_sizes(numel, shape, dtype))[1]

    def parts_bytes(self, numel: int, shape: tuple | None = None, dtype=torch.float32) -> int:
        """Bytes of such a payload's parts alone, no padding: what an all-reduce of the parts as
        they lie sends (``compress(x).parts_nbytes``; from :meth:`parts_layout`, or a plug-in's
        own :meth:`wire_bytes` when it declares no layout)."""
        if self._layout(numel, shape, dtype) is None:
            return self.wire_bytes(numel, shape, dtype)
        return sum(self._layout_sizes(numel, shape, dtype))

    def _layout(self, numel: int, shape: tuple | None, dtype) -> dict | None:
        """:meth:`parts_layout` of a tensor of ``numel`` elements (of ``shape`` when given)."""
        return self.parts_layout(tuple(shape) if shape is not None else (numel,), dtype)

    def _layout_sizes(self, numel: int, shape: tuple | None, dtype) -> list[int]:
        """Bytes of each part :meth:`parts_layout` declares for a tensor of ``numel`` elements."""
        layout = self._layout(numel, shape, dtype)
        if layout is None:
            raise NotImplementedError(f"{self.name}: declare parts_layout (or override wire_bytes) "
                                      "to give the payload's bytes")
        return [math.prod(part_shape) * torch.empty((), dtype=part_dtype).element_size()
                for part_dtype, part_shape in layout.values()]

    def declared_bytes(self, shape: tuple, world: int = 1,
                       error_feedback: bool = True) -> tuple[int, int]:
        """Global-memory bytes of (compress, decode-and-sum of ``world`` payloads) for an fp32
        tensor of ``shape`` on the CUDA path: what the analyser's preset devices charge.

        This default is the least any implementation moves: read x, read and write the residual,
        write the payload; read ``world`` payloads and write the fp32 result. Methods with
        kernels return their kernels' declared bytes.
        """
        n = math.prod(shape)
        wire = self.wire_bytes(n, tuple(shape))
        return 4 * n + (8 * n if error_feedback else 0) + wire, world * wire + 4 * n

    def options(self) -> dict:
        """The method's options as a dict (what ``gradcomp.compress(x, name, **options)`` takes)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _payload(self, x: torch.Tensor, parts: dict) -> Payload:
        return Payload(self.name, x.shape, x.dtype, parts, self.options())

    def _feed_back(self, corrected: torch.Tensor, payload: Payload,
                   residual: torch.Tensor | None) -> Payload:
        """Error feedback after an encode: residual <- corrected - fp32 decode (finite only).

        The payload is decoded straight into the residual's memory, then subtracted in place:
        no dense temporary. Returns ``payload``.
        """
        if residual is not None:
            decoded = residual.view(-1)
            self._decompress_into(payload, decoded)
            finite_residual(corrected, decoded, decoded)
        return payload

    def _compress(self, x, residual, state, scale: float = 1.0) -> Payload:
        """The method's compress of ``scale * x`` (+ residual), arguments checked; ``scale``
        is passed (a float) only to a method that ``prescales``."""
        raise NotImplementedError

    def _decompress_into(self, payload: Payload, out: torch.Tensor) -> None:
        """Torch path: write one payload's decoded values into ``out`` (1-D, contiguous,
        ``payload.numel`` elements, any floating dtype)."""
        raise NotImplementedError

    def _torch_decode_sum(self, payloads: Payload, out: torch.Tensor,
                          addend: torch.Tensor | None = None, addend_scale: float = 1.0) -> None:
        """Torch path of :meth:`decode_sum`: acc = addend * addend_scale (or the first group's
        sum), then each group of ``decode_group`` rows decoded and summed in row order, added in
        group order (fp32). ``addend``: None or a flat contiguous tensor of ``out``'s numel
        (checked by decode_sum); ``payloads.rows`` >= 1. An ``indexed`` method's override also
        takes ``dropped`` (an int64 counter [rows], always given)."""
        if payloads.rows == 1 and addend is None:
            self._decompress_into(payloads.row(0), out)
            return
        total = out if out.dtype == torch.float32 else torch.empty(out.shape, device=out.device)
        if addend is not None:  # before any row is decoded into total: the addend may be out itself
            scaled_addend_into(addend, addend_scale, total)
        group = torch.empty_like(total)
        decoded = torch.empty_like(total) if self.decode_group > 1 else None
        for first in range(0, payloads.rows, self.decode_group):
            target = total if first == 0 and addend is None else group
            self._decompress_into(payloads.row(first), target)
            for i in range(first + 1, min(first + self.decode_group, payloads.rows)):
                self._decompress_into(payloads.row(i), decoded)
                target.add_(decoded)
            if target is group:
                total.add_(group)
        if total is not out:
            out.copy_(total)

    def _kernel_decode_sum(self, payloads: Payload, out: torch.Tensor,
                           addend: torch.Tensor | None = None, addend_scale: float = 1.0) -> bool:
        """Triton path of :meth:`decode_sum` (one launch, the addend loaded as the accumulator's
        start); False where the method has none for these options or this addend (the torch path
        runs instead)."""
        return False


def _refuse_dropped(method: str, numel: int, dropped: torch.Tensor) -> None:
    """Raise ValueError naming the rows whose entries :meth:`Method.decode_sum` dropped."""
    counts = dropped.tolist()
    if any(counts):
        bad = ", ".join(f"row {row}: {count}" for row, count in enumerate(counts) if count)
        raise ValueError(f"{method} payload: part 'indices' holds entries outside [0, {numel}) "
                         f"({bad}); they were not decoded. Bytes from another process are "
                         "corrupt or from another model: pass dropped= to count them instead")


def scaled_addend_into(addend: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """out (fp32, or any float dtype: cast on store) <- fp32(addend) * fp32(scale), the product
    rounded to fp32 once, as the decode kernels load an addend (``common.load_scaled_f32``); scale
    1 copies the addend as it is (no multiply: a NaN keeps its sign bit). ``addend`` may be
    ``out``. One pass for an fp32 addend into an fp32 out."""
    if scale == 1:
        if addend.data_ptr() != out.data_ptr() or addend.dtype != out.dtype:
            out.copy_(addend)
        return out
    if addend.dtype == torch.float32 and out.dtype == torch.float32:
        return torch.mul(addend, scale, out=out)  # the scalar is rounded to fp32, as the kernels'
    if out.dtype == torch.float32:
        return out.copy_(addend).mul_(scale)
    return out.copy_(addend.float() * scale)


def corrected_fp32(x: torch.Tensor, residual: torch.Tensor | None,
                   scale: float = 1.0) -> torch.Tensor:
    """``scale * x`` flattened to fp32, plus the residual when error feedback is on (a new
    tensor). torch rounds ``scale`` to fp32 (as a kernel's fp32 argument), then the product."""
    flat = x.reshape(-1).float()
    if scale != 1:
        flat = flat * scale
    return flat if residual is None else flat + residual.reshape(-1)
