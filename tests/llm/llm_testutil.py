"""Tiny random Llama-family checkpoints, a BPE tokenizer trained on the spot, random prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 320
_CORPUS = [
    "def hello(name):\n    return 'hello ' + name\n",
    "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n",
    "the quick brown fox jumps over the lazy dog",
    "for i in range(10):\n    print(i * i)\n",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
]
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=2, initializer_range=0.1)
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    "llama_tied_mha": dict(model_type="llama", tie_word_embeddings=True, num_key_value_heads=4),
    "llama_linear": dict(model_type="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama3": dict(model_type="llama", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=1),
}


def train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    # Prepend BOS like Llama tokenizers do, so an empty prompt encodes to [BOS].
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(out / "tokenizer.json"))


def make_checkpoint(out: Path, variant: str, seed: int = 0, **overrides: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw = {**BASE, **VARIANTS[variant], **overrides}
    mt = kw.pop("model_type")
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
                          "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[mt]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).eval()
    if mt == "qwen2":  # random biases so the bias path is really exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    train_tokenizer(out)
    return out


def random_prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def make_draft_checkpoint(target: Path, out: Path, noise: float, seed: int = 1) -> Path:
    """A draft for ``target``: its weights plus Gaussian noise (``noise`` x each tensor's std), same tokenizer.

    noise=0 drafts exactly what the target would (every draft accepted); larger noise, less agreement.
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    weights = load_file(str(target / "model.safetensors"))
    noisy = {k: (v + noise * v.float().std() * torch.randn(v.shape, generator=g)).to(v.dtype)
             if v.ndim > 1 else v.clone() for k, v in weights.items()}
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((target / "config.json").read_text())
    cfg["dspark_draft_for"] = target.name
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "generation_config.json"):
        if (target / f).exists():
            shutil.copy(target / f, out / f)
    return out


def make_small_vocab_checkpoint(out: Path, vocab: int = 8, layers: int = 2, seed: int = 0) -> Path:
    """A tokenizer-less model over ``vocab`` tokens whose next-token distributions are far from uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=0, eos_token_id=1, initializer_range=0.5)
    LlamaForCausalLM(cfg).eval().save_pretrained(out, safe_serialization=True)
    return out
