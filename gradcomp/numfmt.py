"""Numbers as a reader reads them: fixed point, never exponent notation (``1.96e+06``)."""
from __future__ import annotations

import math


def plain(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits in fixed point, trailing zeros dropped, as ``:g``
    would print it below its exponent switch: 0.147, 1, 14.7, 1360, 100000, 0.00012."""
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    exponent = math.floor(math.log10(abs(x)))
    decimals = digits - 1 - exponent
    rounded = round(x, decimals)
    if rounded and math.floor(math.log10(abs(rounded))) > exponent:  # 9.996 -> 10.0: one digit fewer
        decimals -= 1
        rounded = round(x, decimals)
    text = f"{rounded:.{max(decimals, 0)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text
