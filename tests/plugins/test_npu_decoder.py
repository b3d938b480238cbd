"""The ``npu`` plugin's whole decoder (API 1.6) on ONNX Runtime's CPU EP against the torch reference, no mocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dspark.types import QuantSpec
import torch

import dspark_plugins_npu as npu
from dspark import Device
from dspark.llm.decoding.batch import build_batch
from dspark.llm.decoding.conformance import compare
from dspark.llm.decoding.spec import make_spec
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.runner.model import ModelRunner, SeqChunk
from dspark_plugins_npu import decoder as npu_decoder
from dspark_plugins_npu.providers import CPU_EP

REPO = Path(__file__).resolve().parents[2]
STDLIB = REPO / "core" / "dspark" / "assets" / "models" / "stdlib-llama"
TOL = 1e-3  # float32 both sides; measured ~2e-5 (different summation orders only)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def stdlib() -> ModelRunner:
    return ModelRunner.from_pretrained(str(STDLIB), "float32")


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 with q/k/v biases and q/k norms, head_dim unlike hidden / heads."""
    import transformers

    out = tmp_path_factory.mktemp("qwen3_bias")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True,
                                   max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # noisy norms and biases, so that they really count
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def qwen3(qwen3_path: Path) -> ModelRunner:
    return ModelRunner.from_pretrained(str(qwen3_path), "float32")


def _compile(runner: ModelRunner, path: Path, **kw: object) -> npu_decoder.OrtDecoder:
    return npu_decoder.OrtDecoder(make_spec(runner, path, **kw), CPU_EP)  # type: ignore[arg-type]


def test_stdlib_llama_matches_the_torch_runner(stdlib: ModelRunner) -> None:
    r = compare(_compile(stdlib, STDLIB), stdlib)
    assert r.argmax_flips == 0 and r.max_abs_diff < TOL, r


def test_qwen3_with_biases_and_qk_norm_at_odd_block_size(qwen3: ModelRunner, qwen3_path: Path) -> None:
    spec = make_spec(qwen3, qwen3_path)
    assert {"qkv_bias", "qk_norm"} <= spec.features
    dec = npu_decoder.OrtDecoder(spec, CPU_EP)
    dec.block_size = 5  # any size: blocks split the prompts and the draft mid-way
    r = compare(dec, qwen3, seed=3)
    assert r.argmax_flips == 0 and r.max_abs_diff < TOL, r


def _step_both(runner: ModelRunner, dec: npu_decoder.OrtDecoder, steps: list[list[SeqChunk]],
               exit_layer: int | None = None) -> float:
    """Largest logit difference over the steps, the reference run with the same exit layer."""
    ref = runner.make_cache(32, dec.block_size)
    mine = PagedKVCache(num_layers=runner.cfg.num_hidden_layers, num_pages=32, page_size=dec.block_size,
                        kv_heads=1, head_dim=1, device="meta")
    kv = dec.allocate(32)
    worst = 0.0
    for chunks in steps:
        want = torch.cat([w.reshape(-1, runner.cfg.vocab_size) for w in runner.step(ref, chunks, exit_layer)])
        got = dec.step(kv, build_batch(mine, chunks, exit_layer))
        for ch in chunks:
            mine.set_len(ch.seq_id, mine.seq_lens.get(ch.seq_id, 0) + len(ch.token_ids))
        assert got.shape == tuple(want.shape)
        worst = max(worst, float(np.abs(got - want.numpy()).max()))
    return worst


STEPS = [
    [SeqChunk("a", list(range(10, 23))), SeqChunk("b", list(range(40, 47)))],
    [SeqChunk("a", [5]), SeqChunk("b", [6])],
    [SeqChunk("a", [7, 8, 9, 11], all_logits=True), SeqChunk("b", [12]), SeqChunk("c", [13])],
    [SeqChunk("a", [14]), SeqChunk("b", list(range(50, 60))), SeqChunk("c", [15, 16])],
]


def test_early_exit_matches_the_runner_exit(qwen3: ModelRunner, qwen3_path: Path) -> None:
    dec = _compile(qwen3, qwen3_path)
    # Every step exits at layer 2: only those layers' K/V exist, as in the runner's cache.
    assert _step_both(qwen3, dec, STEPS, exit_layer=2) < TOL
    assert 2 in dec._exits  # built lazily, once


def test_two_ranges_chained_equal_the_whole(qwen3: ModelRunner, qwen3_path: Path) -> None:
    L, k = qwen3.cfg.num_hidden_layers, 1
    whole = _compile(qwen3, qwen3_path)
    lo, hi = _compile(qwen3, qwen3_path, layers=(0, k)), _compile(qwen3, qwen3_path, layers=(k, L))
    caches = [PagedKVCache(num_layers=L, num_pages=32, page_size=16, kv_heads=1, head_dim=1, device="meta")
              for _ in range(2)]
    kvs = [whole.allocate(32), lo.allocate(32), hi.allocate(32)]
    assert kvs[1].k.shape[0] == k and kvs[2].k.shape[0] == L - k
    for chunks in STEPS:
        want = whole.step(kvs[0], build_batch(caches[0], chunks))
        batch = build_batch(caches[1], chunks)
        hidden = lo.step(kvs[1], batch)
        assert hidden.shape == (batch.num_tokens, qwen3.cfg.hidden_size)
        batch.input_ids, batch.hidden = None, hidden
        got = hi.step(kvs[2], batch)
        for c in caches:
            for ch in chunks:
                c.set_len(ch.seq_id, c.seq_lens.get(ch.seq_id, 0) + len(ch.token_ids))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_unsupported_features_and_quantization_are_declined(qwen3: ModelRunner, qwen3_path: Path,
                                                            cpu: Device) -> None:
    spec = make_spec(qwen3, qwen3_path)
    bid = npu_decoder.decoder_bid(spec.__class__(**{**spec.__dict__, "features": spec.features | {"gguf_stored"}}),
                                  cpu)
    assert bid is not None and bid.declined and "gguf_stored" in bid.declined
    int8 = QuantSpec(weight_bits=8, granularity="per_channel")
    quantized = npu_decoder.decoder_bid(spec.__class__(**{**spec.__dict__, "quantization": {"lm_head": int8}}), cpu)
    assert quantized is not None and quantized.declined and "linear.int8" in quantized.declined
    gpu = cpu.model_copy(update={"id": "cuda:0", "properties": {**cpu.properties,
                                                                "execution_provider": "CUDAExecutionProvider"}})
    on_gpu = npu_decoder.decoder_bid(spec, gpu)
    assert on_gpu is not None and on_gpu.declined and CPU_EP in on_gpu.declined
    assert npu_decoder.compile_decoder(spec.__class__(**{**spec.__dict__, "features": frozenset({"gguf_stored"})}),
                                       cpu) is None


@pytest.fixture(scope="module")
def cpu() -> Device:
    found = [d for d in npu.dspark_probe_devices(refresh=False) if isinstance(d, Device) and d.id == "cpu"]
    assert found, "the CPU execution provider is always there"
    return found[0]


def test_hooks_on_the_probed_cpu_device(stdlib: ModelRunner, cpu: Device) -> None:
    spec = make_spec(stdlib, STDLIB)
    bid = npu.dspark_decoder_bid(decoder=spec, device=cpu)
    assert bid is not None and bid.declined is None
    assert bid.runtime == f"onnxruntime/{CPU_EP}" and bid.block_size is None and bid.exit_layers
    c = stdlib.cfg
    assert bid.kv_bytes_per_token == stdlib.kv_bytes_per_token()  # float32 both
    per_layer = 4 * (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                     + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
                     + 2 * c.hidden_size)
    assert bid.weight_bytes == c.num_hidden_layers * per_layer + 4 * (2 * c.vocab_size + 1) * c.hidden_size
    compiled = npu.dspark_compile_decoder(decoder=spec, device=cpu)
    assert compiled is not None and compiled.block_size == 16
    r = compare(compiled, stdlib, prompt_lens=(5, 19), decode_steps=2, draft=3)
    assert r.argmax_flips == 0 and r.max_abs_diff < TOL, r


@pytest.mark.parametrize("variant", ["gemma2", "gemma3", "mistral_sliding", "smollm3", "phi4_mini",
                                     "phi3_longrope"])
def test_every_family_the_definition_expresses_runs_on_onnx_runtime(tmp_path: Path, variant: str) -> None:
    """Gemma 2's soft-caps and Mistral's windows go to GroupQueryAttention's own attributes; Gemma 3's
    local RoPE is a second cos/sin input; the torch runner's greedy tokens through the engine."""
    from dspark.testing import engine_tokens, tiny_checkpoint

    path = tiny_checkpoint(tmp_path / variant, variant)
    ref, _ = engine_tokens(path, "torch")
    got, e = engine_tokens(path, "npu", max_num_batched_tokens=16)
    assert e.stats().decoder == "npu@cpu", e.decoder_choice
    assert got == ref
