"""When the exchange-owning optimizers exchange, and how much: pure step arithmetic (no torch),
shared by the optimizers (gradcomp.optim) and the analyser that prices their runs
(gradcomp.analysis.optim), so that the analyser needs no optimizer."""
from __future__ import annotations

FULL, COMPRESSED, LOCAL = "full", "compressed", "local"
"""ZeroOneAdam's phases: exchange the gradient (warm-up, variance refresh), the compressed
momentum, or nothing."""


def dgc_density(step: int, density: float, warmup_steps: int, initial_density: float) -> float:
    """Fraction of the elements DGC sends at ``step`` (0-based): ``initial_density`` falling
    geometrically to ``density`` over ``warmup_steps`` steps, then ``density``."""
    if step >= warmup_steps:
        return density
    return initial_density * (density / initial_density) ** (step / warmup_steps)


def fragments_due(step: int, sync_every: int, fragments: int = 1) -> list[int]:
    """The fragments whose outer step follows inner step ``step`` (0-based): fragment f after
    every step t with (t + 1 + f * sync_every // fragments) % sync_every == 0 (one fragment:
    after every H-th step). With fragments <= sync_every at most one per step."""
    return [f for f in range(fragments) if (step + 1 + f * sync_every // fragments) % sync_every == 0]


def fragment_bounds(numel: int, fragments: int) -> list[tuple[int, int]]:
    """[start, end) of each of ``fragments`` near-equal ranges of a flat vector of ``numel``."""
    return [(numel * f // fragments, numel * (f + 1) // fragments) for f in range(fragments)]


def sync_interval(step: int, warmup_steps: int, sync_every: int, sync_growth: int = 0) -> int:
    """Steps per momentum exchange at ``step``: ``sync_every``, or with ``sync_growth`` G
    (0/1 Adam's growing local-step interval) 1 after warm-up, doubling every G steps up to
    ``sync_every``."""
    if not sync_growth:
        return sync_every
    return min(sync_every, 2 ** (max(step - warmup_steps, 0) // sync_growth))


def exchange_schedule(steps: int, warmup_steps: int, var_refresh_interval: int = 0,
                      var_freeze_step: int | None = None, sync_every: int = 1,
                      sync_growth: int = 0) -> list[str]:
    """What ZeroOneAdam exchanges at each of ``steps`` steps without skipped steps: ``full``
    (the gradient: warm-up or variance refresh), ``compressed`` (the momentum) or ``local``
    (nothing). The optimizer follows the same rule step by step (see gradcomp.optim.zeroone)."""
    phases, next_refresh, interval, since_sync = [], warmup_steps + var_refresh_interval, var_refresh_interval, 0
    for t in range(steps):
        sync_every_now = sync_interval(t, warmup_steps, sync_every, sync_growth)
        refresh = bool(var_refresh_interval) and t == next_refresh and (
            var_freeze_step is None or t < var_freeze_step)
        if t < warmup_steps or refresh:
            phases.append(FULL)
            since_sync = 0
            if refresh:
                interval *= 2
                next_refresh = t + interval
        elif since_sync + 1 >= sync_every_now:
            phases.append(COMPRESSED)
            since_sync = 0
        else:
            phases.append(LOCAL)
            since_sync += 1
    return phases
