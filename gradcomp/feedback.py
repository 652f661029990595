"""Error feedback: what compression dropped is remembered per tensor and sent on later steps."""
from __future__ import annotations

import copy

import torch

from .checks import is_integer, is_number
from .methods import Method, check_tensor, get_method
from .payload import Payload


class ErrorFeedback:
    """gradcomp's one error-feedback store: fp32 residuals keyed by name (a parameter's name, a
    DDP bucket, an FSDP group), each with its method's state (PowerSGD's warm-start Q, the
    stochastic-rounding step).

    ``compress(name, g, method)`` compresses g + residual[name] and keeps the new residual: what
    was owed but not sent. Over any number of steps, the sum of the decompressed payloads plus the
    final residual equals the sum of the inputs (up to float rounding), except that a non-finite
    element is sent, never remembered. Residuals are fp32 with the gradient's shape.

    ``get(name, numel, layout)`` serves the fronts whose tensors are concatenations of parameters
    (DDP buckets): the flat residual is laid out as ``layout``, ((parameter key, numel), ...).
    When a name comes back with another layout (DDP rebuilds its buckets after the first step; a
    resumed run starts from the initial layout), every stored residual that shares a parameter
    with the new layout is split into per-parameter pieces and the new residual is assembled from
    them: what was owed to each parameter is kept, never lost or counted twice. Elements past the
    layout (padding) start at zero.

    ``slot(name, shape)`` serves the fronts that compress tensors of one shape per name (FSDP: a
    p x S reduce-scatter input per size S): the residual with that shape and the state, or the
    state alone for a front without error feedback whose method still keeps one.
    """

    def __init__(self):
        self._entries: dict[str, dict] = {}
        self._pieces: dict[str, torch.Tensor] = {}

    def compress(self, name: str, g: torch.Tensor, method: str | Method, **options) -> Payload:
        """Compress ``g`` plus the residual kept under ``name``; update that residual in place."""
        check_tensor(g)
        m = get_method(method, **options)
        created = name not in self._entries
        residual, state = self.slot(name, tuple(g.shape), g.device)
        entry = self._entries[name]
        if created:
            entry["method"] = m.name
        elif entry["method"] not in (None, m.name):
            raise ValueError(f"error feedback {name!r}: residual was built by {entry['method']!r}, "
                             f"now compressed with {m.name!r}; call reset({name!r}) first")
        return m.compress(g, residual, state)

    def slot(self, name: str, shape: tuple, device="cpu", residual: bool = True):
        """(fp32 residual of ``shape``, or None when not ``residual``; method state dict) kept
        under ``name``, created (zeros, an empty state) on first use. A name kept with another
        shape, on another device or with(out) a residual raises ValueError."""
        shape = tuple(int(n) for n in shape)
        entry = self._entries.get(name)
        if entry is None:
            entry = self._new_entry(name, shape, (), device, residual)
        elif (entry["residual"] is None) == residual:
            raise ValueError(f"error feedback {name!r}: kept {'without' if residual else 'with'} "
                             f"a residual, now asked {'with' if residual else 'without'} one")
        elif entry["shape"] != shape or (residual and entry["residual"].device != torch.device(device)):
            where = f" on {entry['residual'].device}" if residual else ""
            raise ValueError(f"error feedback {name!r}: residual is {list(entry['shape'])}{where}, "
                             f"gradient is {list(shape)}{f' on {device}' if residual else ''}")
        return (entry["residual"].view(shape) if residual else None), entry["state"]

    def get(self, name: str, numel: int, layout: tuple = (), device="cpu"):
        """(flat fp32 residual of ``numel`` elements laid out as ``layout``, method state dict)
        to pass to ``Method.compress``; created or re-assembled as the class doc says."""
        entry = self._entries.get(name)
        if entry is not None and entry["residual"] is None:
            raise ValueError(f"error feedback {name!r}: kept without a residual (slot)")
        if entry is None or entry["residual"].numel() != numel or entry["layout"] != tuple(layout):
            entry = self._rebuild(name, numel, tuple(layout), device)
        return entry["residual"], entry["state"]

    def parameter_sizes(self) -> dict[str, int]:
        """Parameter key -> number of elements, for every parameter a residual is kept for in a
        layout (DDP buckets) or as a piece waiting for its parameter."""
        sizes = {key: size for e in self._entries.values() for key, size in e["layout"]}
        sizes.update((key, piece.numel()) for key, piece in self._pieces.items())
        return sizes

    def residual(self, name: str) -> torch.Tensor:
        """The residual kept under ``name`` (fp32, the gradient's shape)."""
        entry = self._entries.get(name)
        if entry is None or entry["residual"] is None:
            raise KeyError(f"no residual named {name!r}; known: "
                           f"{sorted(n for n, e in self._entries.items() if e['residual'] is not None)}")
        return entry["residual"].view(entry["shape"])

    def names(self) -> list[str]:
        return list(self._entries)

    def reset(self, name: str | None = None) -> None:
        """Forget one name's residual and state, or all of them."""
        if name is None:
            self._entries.clear()
            self._pieces.clear()
        else:
            self._entries.pop(name, None)

    def _new_entry(self, name, shape, layout, device, residual: bool = True) -> dict:
        numel = int(torch.Size(shape).numel())
        entry = {"residual": torch.zeros(numel, dtype=torch.float32, device=device) if residual else None,
                 "shape": shape, "layout": layout, "state": {}, "method": None}
        self._entries[name] = entry
        return entry

    def _rebuild(self, name, numel, layout, device) -> dict:
        sizes = dict(layout)
        owed = {key: old for e in self._entries.values() for key, old in e["layout"] if key in sizes}
        owed.update((key, piece.numel()) for key, piece in self._pieces.items() if key in sizes)
        resized = [f"{key!r} is owed {old} elements, has {sizes[key]}"
                   for key, old in owed.items() if old != sizes[key]]
        if resized:  # checked before anything moves: the store stays as it was
            raise ValueError(f"error feedback {name!r}: parameters changed size ({'; '.join(resized)}); a "
                             "resized parameter's residual cannot carry over: call reset() first")
        keys = {key for key, _ in layout}
        for other in [n for n, e in self._entries.items()
                      if n == name or keys & {key for key, _ in e["layout"]}]:
            self._split(other)
        entry = self._new_entry(name, (numel,), layout, device)
        offset = 0
        for key, size in layout:
            piece = self._pieces.pop(key, None)
            if piece is not None and offset + size <= numel:
                entry["residual"][offset:offset + size] = piece.to(device)
            offset += size
        return entry

    def _split(self, name) -> None:
        entry = self._entries.pop(name)
        offset = 0
        for key, size in entry["layout"]:
            self._pieces[key] = entry["residual"][offset:offset + size].clone()
            offset += size

    def state_dict(self) -> dict:
        """Residuals (None for a state kept alone) with their shapes, layouts, method names and
        method states, and the pieces waiting for their parameters: tensors (copies) and plain
        Python values."""
        return {"entries": {n: {"residual": None if e["residual"] is None else e["residual"].clone(),
                                "shape": list(e["shape"]), "layout": [list(x) for x in e["layout"]],
                                "method": e["method"], "state": copy.deepcopy(e["state"])}
                            for n, e in self._entries.items()},
                "pieces": {k: v.clone() for k, v in self._pieces.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; pieces keyed by another process's object ids (``#<id>``:
        parameters the saving process could not name) are dropped."""
        missing = {"entries", "pieces"} - set(state)
        if missing:
            raise ValueError(f"ErrorFeedback state is missing {sorted(missing)}")
        entries = {n: {"residual": None if e["residual"] is None else e["residual"].clone().float().reshape(-1),
                       "shape": tuple(e["shape"]),
                       "layout": tuple((k, int(size)) for k, size in e["layout"]),
                       "method": e["method"], "state": copy.deepcopy(e["state"])}
                   for n, e in state["entries"].items()}
        self._pieces = {k: v.clone().float() for k, v in state["pieces"].items() if not k.startswith("#")}
        self._entries = entries

# ---- moving-average error feedback (LoCo) --------------------------------------------------------
# Plain error feedback keeps e <- h - Q(h) with h = g + e. LoCo (Xie et al., 2024; DeepSpeed's
# ``all_to_all_loco_quant_reduce``) keeps a moving average of the compression errors instead:
#     h = g + e,   send Q(h),   e <- beta e + (1 - beta) (h - Q(h))
# (beta 0.8 by default, DeepSpeed's ``err_beta``), and zeroes e every ``reset_every`` steps.
# Non-finite values follow gradcomp's rule: sent, never remembered (e is 0 there).

LOCO_BETA = 0.8
LOCO_RESET_EVERY = 1024


def check_loco(beta, reset_every) -> None:
    """Raise a ValueError naming the problem unless beta is in [0, 1) and reset_every is a
    positive integer or None."""
    if not is_number(beta) or not 0.0 <= beta < 1.0:
        raise ValueError(f"moving-average error feedback: beta must lie in [0, 1), got {beta!r}")
    if reset_every is not None and (not is_integer(reset_every) or reset_every < 1):
        raise ValueError(f"moving-average error feedback: reset_every must be a positive integer "
                         f"or None, got {reset_every!r}")


def moving_average_compress(method: str | Method, x: torch.Tensor, residual: torch.Tensor,
                            state: dict, beta: float = LOCO_BETA,
                            reset_every: int | None = LOCO_RESET_EVERY, scale: float = 1.0) -> Payload:
    """Compress ``scale * x`` plus the moving-average error ``residual`` (contiguous fp32, x's
    numel, updated in place as the module doc says) with ``method``; ``state`` is the method's
    state dict (as ``ErrorFeedback.get`` returns it), which also keeps this function's step
    counter under ``"loco_step"``. Returns the payload, exactly as ``Method.compress`` (``scale``
    as there) would."""
    check_loco(beta, reset_every)
    step = state.get("loco_step", 0)
    state["loco_step"] = step + 1
    if reset_every is not None and step and step % reset_every == 0:
        residual.zero_()
    previous = residual.clone()
    payload = get_method(method).compress(x, residual, state, scale)  # residual <- h - Q(h), finite only
    residual.mul_(1.0 - beta).add_(previous, alpha=beta)
    return payload
