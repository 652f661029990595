"""The one option check of gradcomp: every method, hook, optimizer and the analyser validate
their numeric options here (a leaf: imports nothing of gradcomp). A bool is never a number."""
from __future__ import annotations

import math


def is_integer(value) -> bool:
    """Whether ``value`` is an int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value, finite: bool = False) -> bool:
    """Whether ``value`` is an int or a float (not a bool), finite when ``finite``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (
        not finite or math.isfinite(value))


def check_number(owner: str, name: str, value, low: float, high: float = math.inf,
                 low_open: bool = False, high_open: bool = False, integer: bool = False,
                 finite: bool = False) -> None:
    """Raise a ValueError naming ``owner``'s option ``name`` unless low <= value <= high (strict
    where ``*_open``) and ``value`` is an int (``integer``) or a number (finite with ``finite``).
    The message: ``"owner: name must be an integer >= 1, got 0"`` (``in [0, 1)`` when bounded
    above; no ``owner:`` when ``owner`` is empty)."""
    ok = is_integer(value) if integer else is_number(value, finite)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        kind = "an integer" if integer else "a finite number" if finite else "a number"
        if math.isinf(high):
            bound = f"{'>' if low_open else '>='} {low:g}"
        else:
            bound = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{owner + ': ' if owner else ''}{name} must be {kind} {bound}, got {value!r}")
