"""Offline datasets for the convergence experiments, and their deterministic per-step batches.

Images: CIFAR-10 from a local folder in its python-batch format, or scikit-learn's bundled
handwritten digits (8x8, upsampled). Text: bytes of the Python standard library's ``.py`` files
(a corpus present on every machine) or of any local file. Nothing is downloaded.

Batches are pure functions of (seed, epoch or step, rank): a resumed run sees exactly the batches
an uninterrupted one would, with no iterator state to checkpoint.
"""
from __future__ import annotations

import os
import pickle
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CIFAR_SIDE = 32


@dataclass(frozen=True)
class ImageData:
    """Normalised float32 images [N, C, H, W] with int64 labels [N], split into train and test."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    augment: str  # while training: "none", "crop-flip" (pad 4, CIFAR) or "distort" (random affine, digits)
    background: float = 0.0  # the normalised value of a blank pixel (what a distortion fills in)


@dataclass(frozen=True)
class TextData:
    """Byte tokens (uint8 [N]) split into a training and a held-out part."""

    train: torch.Tensor
    heldout: torch.Tensor


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    try:
        data, labels = batch[b"data"], batch[b"labels"]
    except (KeyError, TypeError):
        raise ValueError(f"{path} is not a CIFAR-10 python batch (a dict with b'data' and b'labels')") from None
    data = np.asarray(data, dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3 * CIFAR_SIDE * CIFAR_SIDE or len(labels) != len(data):
        raise ValueError(f"{path}: expected data uint8 [N, 3072] and N labels, got "
                         f"{list(data.shape)} and {len(labels)} labels")
    return data, np.asarray(labels, dtype=np.int64)


def load_cifar10(folder: str | Path) -> ImageData:
    """CIFAR-10 from ``folder`` (or its ``cifar-10-batches-py`` subfolder): data_batch_* + test_batch."""
    folder = Path(folder)
    if (folder / "cifar-10-batches-py").is_dir():
        folder = folder / "cifar-10-batches-py"
    train_files = sorted(folder.glob("data_batch_*"), key=lambda p: p.name)
    if not train_files or not (folder / "test_batch").is_file():
        raise FileNotFoundError(f"{folder} holds no CIFAR-10 python batches (data_batch_1.. and "
                                "test_batch); download and unpack cifar-10-python.tar.gz there first")
    train = [_read_cifar_batch(p) for p in train_files]
    test = _read_cifar_batch(folder / "test_batch")

    def to_tensors(data: np.ndarray, labels: np.ndarray):
        images = torch.from_numpy(data).view(-1, 3, CIFAR_SIDE, CIFAR_SIDE).float() / 255.0
        mean, std = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
        return (images - mean) / std, torch.from_numpy(labels)

    train_x, train_y = to_tensors(np.concatenate([d for d, _ in train]), np.concatenate([l for _, l in train]))
    test_x, test_y = to_tensors(*test)
    return ImageData(train_x, train_y, test_x, test_y, num_classes=10, augment="crop-flip")


def load_digits(side: int = 16, test_fraction: float = 0.2, split_seed: int = 0,
                distort_copies: int = 0) -> ImageData:
    """scikit-learn's 1797 handwritten digits (8x8, 1 channel) upsampled bilinearly to side x side.

    The split is a seeded permutation (``split_seed``), the same for every training seed; images
    are scaled to [0, 1] and normalised by the training set's mean and std. With
    ``distort_copies`` = C > 0, training batches are randomly distorted (``distort``) at every step
    and the held-out set is C fixed distortions of each held-out digit (359 x C images): accuracy
    in steps of 1 / (359 C) (the held-out loss still differs between runs by several per cent:
    docs/convergence.md).
    """
    from sklearn.datasets import load_digits as sklearn_digits

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    if side < 8:
        raise ValueError(f"side must be >= 8 (the digits are 8x8), got {side}")
    if distort_copies < 0:
        raise ValueError(f"distort_copies must be >= 0, got {distort_copies}")
    bunch = sklearn_digits()
    images = torch.from_numpy(bunch.images).float().unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(side, side), mode="bilinear", align_corners=False)
    labels = torch.from_numpy(bunch.target).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    n_test = int(round(len(labels) * test_fraction))
    test_idx, train_idx = order[:n_test], order[n_test:]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    background = float(-mean / std)
    test_x, test_y = images[test_idx], labels[test_idx]
    if distort_copies:
        copies = test_x.repeat(distort_copies, 1, 1, 1)
        test_x = distort(copies, batch_generator(split_seed, DISTORT_HELDOUT_STREAM), background)
        test_y = test_y.repeat(distort_copies)
    return ImageData(images[train_idx], labels[train_idx], test_x, test_y, num_classes=10,
                     augment="distort" if distort_copies else "none", background=background)


DISTORT_HELDOUT_STREAM = 2**31 - 1  # the held-out distortions' generator counter (no training step uses it)


def distort(images: torch.Tensor, generator: torch.Generator, background: float,
            degrees: float = 15.0, scale: float = 0.1, shift: float = 0.15) -> torch.Tensor:
    """Random affine distortions of images [B, C, H, W]: rotation within +-``degrees``, zoom within
    1 +- ``scale``, translation within +-``shift`` of the half-side; uncovered pixels ``background``."""
    batch = images.shape[0]
    draws = torch.rand(batch, 4, generator=generator) * 2 - 1  # angle, zoom, dx, dy in [-1, 1)
    angle = draws[:, 0] * torch.pi * degrees / 180
    zoom = 1 + scale * draws[:, 1]
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    theta = torch.stack([torch.stack([cos, -sin, shift * draws[:, 2]], 1),
                         torch.stack([sin, cos, shift * draws[:, 3]], 1)], 1)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images - background, grid, align_corners=False) + background


def stdlib_python_files() -> list[Path]:
    """The standard library's .py files (site-packages excluded), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: int) -> bytes:
    """The first ``max_bytes`` bytes of the stdlib's .py files, concatenated in sorted-path order."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    chunks, total = [], 0
    for path in stdlib_python_files():
        chunk = path.read_bytes()[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    return b"".join(chunks)


def read_text(path: str | Path, max_bytes: int | None = None) -> bytes:
    """The first ``max_bytes`` bytes (all when None) of a local file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text corpus {path} does not exist")
    with open(path, "rb") as f:
        return f.read() if max_bytes is None else f.read(max_bytes)


def split_text(corpus: bytes, context: int, heldout_fraction: float = 0.1) -> TextData:
    """The last ``heldout_fraction`` of the bytes is held out; both parts must exceed ``context``."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must lie in (0, 1), got {heldout_fraction}")
    tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    cut = int(len(tokens) * (1.0 - heldout_fraction))
    train, heldout = tokens[:cut], tokens[cut:]
    if min(len(train), len(heldout)) <= context:
        raise ValueError(f"corpus of {len(tokens)} bytes is too small: both splits need more than "
                         f"context={context} bytes (train {len(train)}, held-out {len(heldout)})")
    return TextData(train, heldout)


def batch_generator(seed: int, *counters: int) -> torch.Generator:
    """A torch.Generator seeded from (seed, *counters) without collisions between tuples."""
    state = np.random.SeedSequence([seed, *counters]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def steps_per_epoch(n_train: int, batch_size: int, world_size: int) -> int:
    """Full global batches (batch_size per rank) in one pass over n_train examples."""
    steps = n_train // (batch_size * world_size)
    if steps < 1:
        raise ValueError(f"{n_train} training examples do not fill one global batch of "
                         f"{batch_size} x {world_size} ranks")
    return steps


def image_batch(data: ImageData, seed: int, epoch: int, step_in_epoch: int, rank: int,
                world_size: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of a seeded per-epoch permutation (like DistributedSampler), augmented."""
    order = torch.randperm(len(data.train_y), generator=batch_generator(seed, epoch))
    start = (step_in_epoch * world_size + rank) * batch_size
    idx = order[start: start + batch_size]
    images, labels = data.train_x[idx], data.train_y[idx]
    if data.augment == "crop-flip":
        images = crop_and_flip(images, batch_generator(seed, epoch, step_in_epoch, rank))
    elif data.augment == "distort":
        images = distort(images, batch_generator(seed, epoch, step_in_epoch, rank), data.background)
    return images, labels


def crop_and_flip(images: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crops of the zero-padded images [B, C, H, W] and random horizontal flips."""
    batch, _, height, width = images.shape
    padded = F.pad(images, (pad, pad, pad, pad))
    offsets = torch.randint(0, 2 * pad + 1, (batch, 2), generator=generator)
    flips = torch.rand(batch, generator=generator) < 0.5
    out = torch.stack([padded[i, :, dy: dy + height, dx: dx + width]
                       for i, (dy, dx) in enumerate(offsets.tolist())])
    return torch.where(flips.view(-1, 1, 1, 1), out.flip(-1), out)


def text_batch(tokens: torch.Tensor, context: int, batch_size: int,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs [B, context] and next-byte targets [B, context], int64."""
    starts = torch.randint(0, len(tokens) - context, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s: s + context + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def heldout_windows(tokens: torch.Tensor, context: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` evenly spaced windows of the held-out bytes: the fixed evaluation set."""
    starts = torch.linspace(0, len(tokens) - context - 1, count).long()
    windows = torch.stack([tokens[s: s + context + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
