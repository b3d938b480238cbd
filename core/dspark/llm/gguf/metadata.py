"""A GGUF file's metadata as a Hugging Face config, read through the ``gguf`` package.

llama.cpp's keys (``{arch}.embedding_length`` ...) become the config.json fields
that families.py normalises, with transformers' conventions
(``integrations/ggml.py``, ``modeling_gguf_pytorch_utils.py``), so that a file
means the same here as under ``from_pretrained(..., gguf_file=...)``. Where
transformers drops something llama.cpp honours (RoPE scaling keys, Llama 3's
``rope_freqs`` factors) we follow llama.cpp or refuse, never run it silently
wrong.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dspark.llm.runner.families import CheckpointError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# The float types a tensor may be stored in, and the config dtype a file of only that type gets.
FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_LLAMA3_FACTORS = (8.0, 16.0, 32.0)  # Llama 3.1 (8) and 3.2 (32); low 1, high 4 and 8192 in both


class GGUFError(CheckpointError):
    """A GGUF file that cannot be loaded; the message names the file and what it holds that is not supported."""


def is_gguf(path: str | Path) -> bool:
    """A path that names a GGUF file (by its suffix: a missing one is then reported as missing, not as a
    checkpoint directory without config.json)."""
    p = Path(path)
    return p.suffix.lower() == ".gguf" and not p.is_dir()


_shared: dict[tuple[str, int, int], Any] = {}
_scopes = 0
_lock = threading.Lock()


@contextlib.contextmanager
def shared_readers() -> Iterator[None]:
    """Within it (an engine's start-up, on any thread), each GGUF file is parsed once: the config, the tokenizer,
    the decoders' bids and the compile share one reader (parsing a file's metadata, its tokenizer's every
    token, takes about a second). Outside, each open parses again and no reader is kept: a kept reader keeps
    its memory map, and every weight page read through it stays in the process's resident memory (hence
    ``open_reader(share=False)`` for a reader whose weights will be read)."""
    global _scopes
    with _lock:
        _scopes += 1
    try:
        yield
    finally:
        with _lock:
            _scopes -= 1
            if not _scopes:
                _shared.clear()


def open_reader(path: Path, *, share: bool = True) -> Any:
    """The file's ``GGUFReader``; within :func:`shared_readers` and with ``share``, the one already parsed."""
    if not path.is_file():
        raise GGUFError(f"{path}: GGUF file does not exist")
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _lock:
        share = share and _scopes > 0
        if share and key in _shared:
            return _shared[key]
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError ... on a damaged file
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    if share:
        with _lock:
            if _scopes:  # (the scope may have ended while the file was parsed)
                reader = _shared.setdefault(key, reader)
    return reader


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every key-value field as a plain Python value (strings, numbers, lists)."""
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # the header (version, counts), not metadata
        value = field.contents()
        out[name] = value.tolist() if isinstance(value, np.ndarray) else value
    return out


def _llama3_factors(theta: float, dim: int, factor: float, low: float, high: float, orig: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as ``rope_freqs`` for a llama3 rope_scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def llama3_rope(factors: np.ndarray, theta: float, head_dim: int, path: Path) -> dict[str, Any]:
    """The llama3 rope_scaling whose factors llama.cpp wrote as ``rope_freqs.weight`` (it keeps only the result)."""
    for factor in _LLAMA3_FACTORS:
        want = _llama3_factors(theta, head_dim, factor, 1.0, 4.0, 8192)
        if want.shape == factors.shape and np.allclose(factors, want, rtol=1e-5, atol=0.0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
    raise GGUFError(f"{path}: tensor rope_freqs.weight holds RoPE frequency factors that match no llama3 scaling "
                    f"(factor {', '.join(map(str, _LLAMA3_FACTORS))} with low 1, high 4, original context 8192); "
                    "other frequency factors are not supported")


def _rope_scaling(md: dict[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(md[f"{arch}.rope.scaling.factor"])}
    raise GGUFError(f"{path}: {arch}.rope.scaling.type {kind!r} is not supported; supported: none, linear")


def to_config(md: dict[str, Any], tensors: dict[str, tuple[str, tuple[int, ...]]], path: Path,
              rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """A config.json dict for the file; ``tensors``: GGUF name -> (ggml type name, numpy shape)."""
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")

    def key(name: str) -> Any:
        full = f"{arch}.{name}"
        if full not in md:
            raise GGUFError(f"{path}: metadata key {full} is missing")
        return md[full]

    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: tensor token_embd.weight is missing")
    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    head_dim = int(md.get(f"{arch}.attention.key_length") or hidden // heads)
    n_rot = md.get(f"{arch}.rope.dimension_count")
    if n_rot is not None and int(n_rot) != head_dim:
        raise GGUFError(f"{path}: {arch}.rope.dimension_count {n_rot} differs from the head size {head_dim}; "
                        "partial rotary embeddings are not supported for GGUF files")
    theta = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    rope = _rope_scaling(md, arch, path)
    if rope_freqs is not None:
        if rope is not None:
            raise GGUFError(f"{path}: both {arch}.rope.scaling.type and rope_freqs.weight are set")
        rope = llama3_rope(rope_freqs, theta, head_dim, path)
    # float16 / bfloat16 only when every matrix is stored so; quantized weights dequantize to float32.
    kinds = {t for name, (t, shape) in tensors.items() if len(shape) == 2}
    dtype = FLOAT_DTYPES[next(iter(kinds))] if len(kinds) == 1 and kinds <= set(FLOAT_DTYPES) else "float32"
    eos = [int(md[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md]
    raw: dict[str, Any] = {
        "model_type": arch, "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                               "qwen3": "Qwen3ForCausalLM"}[arch]],
        "vocab_size": tensors["token_embd.weight"][1][0], "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")), "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(md.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim, "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")),
        "rope_parameters": {"rope_theta": theta, **(rope or {"rope_type": "default"})},
        "rope_theta": theta, "tie_word_embeddings": "output.weight" not in tensors,
        # Qwen2 always has q/k/v biases (families.py); Llama and Qwen3 have them when the file does.
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(eos)) if len(set(eos)) > 1 else (eos[0] if eos else None),
        "torch_dtype": dtype,
    }
    return raw
