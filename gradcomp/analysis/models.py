"""Model presets built from shape rules (no weights): every parameter's name, shape and the forward
FLOPs of the layer it belongs to, in registration order (DDP buckets them in reverse).

A preset's FLOPs are counted from first principles: a matmul with a weight of n elements costs
2 n FLOPs per token (per output position for a convolution); attention adds 4 * seq * d per token
and layer (QK^T and AV, no causal discount); a tied LM head costs 2 * vocab * d per token.
Backward is taken as twice the forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Parameter:
    """One trainable tensor: its name, shape and its layer's forward FLOPs per step (0 if none)."""

    name: str
    shape: tuple[int, ...]
    flops: float = 0.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the cost model sees it.

    parameters: in registration order (``model.parameters()``).
    batch: what one step processes per rank, for the record (e.g. "8 x 1024 tokens").
    forward_flops: forward FLOPs of one step per rank; 0 when unknown (an nn.Module: measure it).
    """

    name: str
    parameters: tuple[Parameter, ...]
    batch: str = ""

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.parameters)

    @property
    def forward_flops(self) -> float:
        return sum(p.flops for p in self.parameters)


def _matmul(name: str, shape: tuple[int, ...], tokens: int, extra: float = 0.0) -> Parameter:
    return Parameter(name, shape, 2.0 * math.prod(shape) * tokens + extra)


def resnet50(batch: int = 64, image: int = 224) -> ModelSpec:
    """torchvision's ResNet-50 (v1.5: stride in the 3x3 conv), ``batch`` images of ``image`` px."""
    params: list[Parameter] = []

    def conv(name, cout, cin, k, out_hw):
        params.append(Parameter(f"{name}.weight", (cout, cin, k, k), 2.0 * cout * cin * k * k * out_hw ** 2 * batch))

    def norm(name, c):
        params.extend([Parameter(f"{name}.weight", (c,)), Parameter(f"{name}.bias", (c,))])

    hw = image // 2
    conv("conv1", 64, 3, 7, hw)
    norm("bn1", 64)
    hw //= 2  # max pool
    cin = 64
    for layer, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), start=1):
        for b in range(blocks):
            stride = 2 if layer > 1 and b == 0 else 1
            out_hw = hw // stride
            prefix = f"layer{layer}.{b}"
            conv(f"{prefix}.conv1", width, cin, 1, hw)
            norm(f"{prefix}.bn1", width)
            conv(f"{prefix}.conv2", width, width, 3, out_hw)
            norm(f"{prefix}.bn2", width)
            conv(f"{prefix}.conv3", 4 * width, width, 1, out_hw)
            norm(f"{prefix}.bn3", 4 * width)
            if b == 0:
                conv(f"{prefix}.downsample.0", 4 * width, cin, 1, out_hw)
                norm(f"{prefix}.downsample.1", 4 * width)
            cin, hw = 4 * width, out_hw
    params.append(_matmul("fc.weight", (1000, 2048), batch))
    params.append(Parameter("fc.bias", (1000,)))
    return ModelSpec("resnet50", tuple(params), f"{batch} images of {image}x{image}")


def vgg16(batch: int = 32, image: int = 224) -> ModelSpec:
    """torchvision's VGG-16 (13 3 x 3 convolutions with biases, three fully connected layers),
    ``batch`` images of ``image`` px: 138.36M parameters."""
    params: list[Parameter] = []
    hw, cin = image, 3
    for stage, (convs, width) in enumerate(zip((2, 2, 3, 3, 3), (64, 128, 256, 512, 512))):
        for c in range(convs):
            name = f"features.{stage}.{c}"
            params.append(Parameter(f"{name}.weight", (width, cin, 3, 3), 2.0 * width * cin * 9 * hw ** 2 * batch))
            params.append(Parameter(f"{name}.bias", (width,)))
            cin = width
        hw //= 2  # max pool
    for i, (out, inp) in enumerate(((4096, 512 * 7 * 7), (4096, 4096), (1000, 4096))):
        params.append(_matmul(f"classifier.{i}.weight", (out, inp), batch))
        params.append(Parameter(f"classifier.{i}.bias", (out,)))
    return ModelSpec("vgg16", tuple(params), f"{batch} images of {image}x{image}")


def resnet18_cifar(batch: int = 32, classes: int = 100) -> ModelSpec:
    """ResNet-18 for 32 x 32 CIFAR images (a 3 x 3 stem, no max pool; basic blocks of 64-512
    channels, 1 x 1 projection shortcuts), ``classes`` outputs: 11.22M parameters at 100."""
    params: list[Parameter] = []

    def conv(name, cout, cin, k, out_hw):
        params.append(Parameter(f"{name}.weight", (cout, cin, k, k), 2.0 * cout * cin * k * k * out_hw ** 2 * batch))

    def norm(name, c):
        params.extend([Parameter(f"{name}.weight", (c,)), Parameter(f"{name}.bias", (c,))])

    hw, cin = 32, 64
    conv("conv1", 64, 3, 3, hw)
    norm("bn1", 64)
    for layer, width in enumerate((64, 128, 256, 512), start=1):
        for b in range(2):
            stride = 2 if layer > 1 and b == 0 else 1
            out_hw = hw // stride
            prefix = f"layer{layer}.{b}"
            conv(f"{prefix}.conv1", width, cin, 3, out_hw)
            norm(f"{prefix}.bn1", width)
            conv(f"{prefix}.conv2", width, width, 3, out_hw)
            norm(f"{prefix}.bn2", width)
            if stride != 1 or cin != width:
                conv(f"{prefix}.shortcut.0", width, cin, 1, out_hw)
                norm(f"{prefix}.shortcut.1", width)
            cin, hw = width, out_hw
    params.append(_matmul("linear.weight", (classes, 512), batch))
    params.append(Parameter("linear.bias", (classes,)))
    return ModelSpec("resnet18-cifar", tuple(params), f"{batch} images of 32x32")


def gpt2(d: int, layers: int, name: str, batch: int = 8, seq: int = 1024, vocab: int = 50257) -> ModelSpec:
    """Hugging Face GPT2Model layout (Conv1D weights are [in, out]; LM head tied to wte)."""
    tokens = batch * seq
    params = [Parameter("wte.weight", (vocab, d), 2.0 * vocab * d * tokens),
              Parameter("wpe.weight", (1024, d))]
    for i in range(layers):
        h = f"h.{i}"
        params += [
            Parameter(f"{h}.ln_1.weight", (d,)), Parameter(f"{h}.ln_1.bias", (d,)),
            _matmul(f"{h}.attn.c_attn.weight", (d, 3 * d), tokens, extra=4.0 * seq * d * tokens),
            Parameter(f"{h}.attn.c_attn.bias", (3 * d,)),
            _matmul(f"{h}.attn.c_proj.weight", (d, d), tokens), Parameter(f"{h}.attn.c_proj.bias", (d,)),
            Parameter(f"{h}.ln_2.weight", (d,)), Parameter(f"{h}.ln_2.bias", (d,)),
            _matmul(f"{h}.mlp.c_fc.weight", (d, 4 * d), tokens), Parameter(f"{h}.mlp.c_fc.bias", (4 * d,)),
            _matmul(f"{h}.mlp.c_proj.weight", (4 * d, d), tokens), Parameter(f"{h}.mlp.c_proj.bias", (d,)),
        ]
    params += [Parameter("ln_f.weight", (d,)), Parameter("ln_f.bias", (d,))]
    return ModelSpec(name, tuple(params), f"{batch} x {seq} tokens")


def bert_large(batch: int = 8, seq: int = 512) -> ModelSpec:
    """Hugging Face BertModel, bert-large-uncased (24 layers, d 1024, 16 heads), with the pooler."""
    d, ffn, vocab, tokens = 1024, 4096, 30522, batch * seq
    params = [Parameter("embeddings.word_embeddings.weight", (vocab, d)),
              Parameter("embeddings.position_embeddings.weight", (512, d)),
              Parameter("embeddings.token_type_embeddings.weight", (2, d)),
              Parameter("embeddings.LayerNorm.weight", (d,)), Parameter("embeddings.LayerNorm.bias", (d,))]
    for i in range(24):
        a = f"encoder.layer.{i}.attention"
        for proj in ("query", "key", "value"):
            extra = 4.0 * seq * d * tokens if proj == "query" else 0.0
            params += [_matmul(f"{a}.self.{proj}.weight", (d, d), tokens, extra),
                       Parameter(f"{a}.self.{proj}.bias", (d,))]
        o = f"encoder.layer.{i}"
        params += [
            _matmul(f"{a}.output.dense.weight", (d, d), tokens), Parameter(f"{a}.output.dense.bias", (d,)),
            Parameter(f"{a}.output.LayerNorm.weight", (d,)), Parameter(f"{a}.output.LayerNorm.bias", (d,)),
            _matmul(f"{o}.intermediate.dense.weight", (ffn, d), tokens),
            Parameter(f"{o}.intermediate.dense.bias", (ffn,)),
            _matmul(f"{o}.output.dense.weight", (d, ffn), tokens), Parameter(f"{o}.output.dense.bias", (d,)),
            Parameter(f"{o}.output.LayerNorm.weight", (d,)), Parameter(f"{o}.output.LayerNorm.bias", (d,)),
        ]
    params += [_matmul("pooler.dense.weight", (d, d), batch), Parameter("pooler.dense.bias", (d,))]
    return ModelSpec("bert-large", tuple(params), f"{batch} x {seq} tokens")


def llama_7b(batch: int = 1, seq: int = 4096) -> ModelSpec:
    """A LLaMA-7B-like decoder: 32 layers, d 4096, SwiGLU 11008, RMSNorm, untied LM head."""
    d, ffn, vocab, tokens = 4096, 11008, 32000, batch * seq
    params = [Parameter("embed_tokens.weight", (vocab, d))]
    for i in range(32):
        a, m = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        params += [_matmul(f"{a}.q_proj.weight", (d, d), tokens, extra=4.0 * seq * d * tokens),
                   _matmul(f"{a}.k_proj.weight", (d, d), tokens),
                   _matmul(f"{a}.v_proj.weight", (d, d), tokens),
                   _matmul(f"{a}.o_proj.weight", (d, d), tokens),
                   _matmul(f"{m}.gate_proj.weight", (ffn, d), tokens),
                   _matmul(f"{m}.up_proj.weight", (ffn, d), tokens),
                   _matmul(f"{m}.down_proj.weight", (d, ffn), tokens),
                   Parameter(f"layers.{i}.input_layernorm.weight", (d,)),
                   Parameter(f"layers.{i}.post_attention_layernorm.weight", (d,))]
    params += [Parameter("norm.weight", (d,)), _matmul("lm_head.weight", (vocab, d), tokens)]
    return ModelSpec("llama-7b", tuple(params), f"{batch} x {seq} tokens")


MODELS = {
    "resnet50": resnet50,
    "resnet18-cifar": resnet18_cifar,
    "vgg16": vgg16,
    "bert-large": bert_large,
    "gpt2-124m": lambda: gpt2(768, 12, "gpt2-124m"),
    "gpt2-355m": lambda: gpt2(1024, 24, "gpt2-355m"),
    "gpt2-1.5b": lambda: gpt2(1600, 48, "gpt2-1.5b"),
    "llama-7b": llama_7b,
}


def model(name: str) -> ModelSpec:
    """The preset model called ``name`` (ValueError listing the presets otherwise)."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[key]()


def from_module(module: torch.nn.Module, name: str | None = None) -> ModelSpec:
    """The trainable parameters of ``module`` (FLOPs unknown: give a measured compute time)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    params = tuple(Parameter(n, tuple(p.shape)) for n, p in module.named_parameters() if p.requires_grad)
    if not params:
        raise ValueError(f"{type(module).__name__} has no trainable parameters")
    return ModelSpec(name or type(module).__name__, params)
