"""Error feedback: what compression dropped is remembered per tensor and sent on later steps."""
from __future__ import annotations

import torch

from .methods import Method, check_tensor, get_method
from .payload import Payload


class ErrorFeedback:
    """Residual memory keyed by name (e.g. a parameter's name or a DDP bucket index).

    ``compress(name, g, method)`` compresses g + residual[name] and keeps the new residual:
    what was owed but not sent. Over any number of steps, the sum of the decompressed payloads plus
    the final residual equals the sum of the inputs (up to float rounding), except that a
    non-finite element is sent, never remembered. Residuals are fp32 with the gradient's shape;
    each name also keeps its method's state (PowerSGD's warm-start Q, the stochastic-rounding step).
    """

    def __init__(self):
        self._residuals: dict[str, torch.Tensor] = {}
        self._states: dict[str, dict] = {}
        self._methods: dict[str, str] = {}

    def compress(self, name: str, g: torch.Tensor, method: str | Method, **options) -> Payload:
        """Compress ``g`` plus the residual kept under ``name``; update that residual in place."""
        check_tensor(g)
        m = get_method(method, **options)
        residual = self._residuals.get(name)
        if residual is None:
            residual = torch.zeros(g.shape, dtype=torch.float32, device=g.device)
            self._residuals[name], self._states[name], self._methods[name] = residual, {}, m.name
        elif residual.shape != g.shape or residual.device != g.device:
            raise ValueError(f"error feedback {name!r}: residual is {list(residual.shape)} on "
                             f"{residual.device}, gradient is {list(g.shape)} on {g.device}")
        elif self._methods[name] != m.name:
            raise ValueError(f"error feedback {name!r}: residual was built by {self._methods[name]!r}, "
                             f"now compressed with {m.name!r}; call reset({name!r}) first")
        return m.compress(g, residual, self._states[name])

    def residual(self, name: str) -> torch.Tensor:
        """The residual kept under ``name`` (fp32, the gradient's shape)."""
        if name not in self._residuals:
            raise KeyError(f"no residual named {name!r}; known: {sorted(self._residuals)}")
        return self._residuals[name]

    def names(self) -> list[str]:
        return list(self._residuals)

    def reset(self, name: str | None = None) -> None:
        """Forget one name's residual and state, or all of them."""
        for store in (self._residuals, self._states, self._methods):
            if name is None:
                store.clear()
            else:
                store.pop(name, None)

    def state_dict(self) -> dict:
        """Residuals, method states and method names, as tensors and plain Python values."""
        return {
            "residuals": {k: v.clone() for k, v in self._residuals.items()},
            "states": {k: {sk: (sv.clone() if isinstance(sv, torch.Tensor) else sv)
                           for sk, sv in st.items()} for k, st in self._states.items()},
            "methods": dict(self._methods),
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"residuals", "states", "methods"} - set(state)
        if missing:
            raise ValueError(f"ErrorFeedback state is missing {sorted(missing)}")
        self._residuals = {k: v.clone().float() for k, v in state["residuals"].items()}
        self._states = {k: dict(v) for k, v in state["states"].items()}
        self._methods = dict(state["methods"])
