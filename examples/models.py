"""The models the convergence experiments train: CIFAR-style ResNets and a small causal transformer.

ResNet-20 (He et al., 2016, section 4.2): 3 stages of 3 basic blocks, 16/32/64 channels, 1x1-conv
projection shortcuts where the shape changes; about 272K parameters for 3-channel input.
ResNet-18: the CIFAR variant of the ImageNet network (3x3 stem, no max-pool), about 11.2M.
GPT: a nanoGPT-like decoder (pre-norm blocks, GELU MLP of width 4d, learned positions, untied
output head); byte-level with the defaults of ``GPTConfig`` it has 875,264 parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (a 1x1 projection when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet of basic blocks: images [B, C, H, W] -> logits [B, num_classes]."""

    def __init__(self, widths: tuple[int, ...], blocks_per_stage: tuple[int, ...],
                 num_classes: int = 10, in_channels: int = 3):
        super().__init__()
        if len(widths) != len(blocks_per_stage):
            raise ValueError(f"widths {widths} and blocks_per_stage {blocks_per_stage} differ in length")
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages, channels = [], widths[0]
        for stage, (width, blocks) in enumerate(zip(widths, blocks_per_stage)):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                stages.append(BasicBlock(channels, width, stride))
                channels = width
        self.blocks = nn.Sequential(*stages)
        self.head = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(features, 1).flatten(1))


def resnet20(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    return ResNet((16, 32, 64), (3, 3, 3), num_classes, in_channels)


def resnet18(num_classes: int = 10, in_channels: int = 3) -> ResNet:
    return ResNet((64, 128, 256, 512), (2, 2, 2, 2), num_classes, in_channels)


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the transformer; the defaults are the byte-level model of the experiments."""

    vocab_size: int = 256
    context: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128

    def __post_init__(self):
        for name in ("vocab_size", "context", "n_layer", "n_head", "d_model"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, channels))


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(),
                                 nn.Linear(4 * config.d_model, config.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Causal language model: token ids [B, T] (T <= context) -> logits [B, T, vocab_size]."""

    def __init__(self, config: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.Sequential(*(TransformerBlock(config) for _ in range(config.n_layer)))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[1] > self.config.context:
            raise ValueError(f"expected token ids [batch, time <= {self.config.context}], "
                             f"got shape {list(tokens.shape)}")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        return self.head(self.ln_final(self.blocks(x)))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
