"""The check that every rank is configured alike, shared by the fronts (the DDP hooks, FSDP, the
optimizers): ranks configured differently would issue mismatched collectives and hang, so each
front compares its configuration across ranks before its first collective and every rank raises
:class:`ConfigMismatchError` naming what differs.
"""
from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from .comm import all_gather_into
from .payload import WIRE_ALIGN


class ConfigMismatchError(ValueError):
    """Ranks configured a gradcomp front differently (hook, method or options)."""


def fingerprint(config: dict) -> int:
    """A 63-bit hash of a JSON-able config dict, the same on every rank for equal configs."""
    text = json.dumps(config, sort_keys=True, default=repr)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def describe_differences(configs: list[dict]) -> str:
    """One line per key where some rank's config differs from rank 0's, naming both values."""
    lines = []
    reference = configs[0]
    for rank, config in enumerate(configs[1:], start=1):
        for key in sorted(set(reference) | set(config)):
            if reference.get(key, "<unset>") != config.get(key, "<unset>"):
                lines.append(f"  {key}: rank 0 has {reference.get(key, '<unset>')!r}, "
                             f"rank {rank} has {config.get(key, '<unset>')!r}")
    return "\n".join(lines)


def check_consistent(config: dict, group, device: torch.device, what: str, remedy: str = "") -> None:
    """All ranks of ``group`` (None: the default group) compare fingerprints of ``config``.

    One all-gather of an int64 per rank, on ``device`` (the data's: NCCL takes only tensors on
    the group's GPU), and one host read of the result. On a mismatch, seen identically by every
    rank so none hangs, a second all-gather of the configs, and every rank raises
    ConfigMismatchError: "``what`` is configured differently across ranks (``remedy``):" and
    one line per differing key and rank. The wire layout (``wire_align``: gradcomp.payload's
    part alignment) is compared with ``config``: a peer running a version whose payload rows are
    laid out otherwise is refused before any payload crosses.
    """
    config = {**config, "wire_align": WIRE_ALIGN}
    world_size = dist.get_world_size(group)
    mine = torch.tensor([fingerprint(config)], dtype=torch.int64, device=device)
    gathered = torch.empty(world_size, dtype=torch.int64, device=device)
    all_gather_into(gathered, mine, group=group)
    if bool((gathered == gathered[0]).all()):
        return
    configs: list = [None] * world_size
    dist.all_gather_object(configs, config, group=group)
    advice = f" ({remedy})" if remedy else ""
    raise ConfigMismatchError(f"{what} is configured differently across ranks{advice}:\n"
                              + describe_differences(configs))
