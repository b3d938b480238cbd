"""GGUF files: ``dspark.LLM("x.gguf")``, ``dspark convert`` and ``dspark serve --model x.gguf`` against
transformers loading the same file (``gguf_file=``, which dequantizes every type with the gguf package).

The files are written here from tiny random checkpoints (gguf_testutil.py): Llama, Qwen2 and Qwen3, with
float matrices (F32, F16), each quantized type of the issue (Q8_0, Q4_0, Q4_K, Q6_K), and a Q4_K_M-like mix.
Q8_0 projections must run on the plugins' int8 kernels, every other quantized type dequantized with a logged
reason; the greedy tokens must be transformers' in every case.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dspark.llm import LLM, SamplingParams
from dspark.llm.gguf import GGUFError
from gguf_testutil import make_checkpoint, write_gguf
from structlog.testing import capture_logs

NEW = 8
# Q4_K_M-like: q/k and gate/up Q8_0 but v Q6_K (one fused qkv kernel cannot mix them), down Q6_K.
MIXED = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q8_0",
         "ffn_up": "Q8_0", "ffn_down": "Q6_K", "output": "Q8_0", "token_embd": "Q4_K"}
CASES = [("llama", "F32"), ("llama", "F16"), ("llama", "Q8_0"), ("llama", "Q4_0"), ("llama", "Q4_K"),
         ("llama", "Q6_K"), ("llama_tied", "Q8_0"), ("qwen2", "Q8_0"), ("qwen2", "MIXED"), ("qwen3", "F16"), ("qwen3", "Q4_K")]
ACTION = {"F32": "float", "F16": "float", "Q8_0": "int8", "Q4_0": "dequantized", "Q4_K": "dequantized",
          "Q6_K": "dequantized"}


def _types(kind: str) -> str | Callable[[str], str]:
    return (lambda name: MIXED[name.split(".")[-2]]) if kind == "MIXED" else kind


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_checkpoint(tmp_path_factory.mktemp(f"{arch}-hf"), arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def gguf_file(tmp_path_factory: pytest.TempPathFactory, hf_checkpoint: Callable[[str], Path]) -> Callable[[str, str], Path]:
    files: dict[tuple[str, str], Path] = {}

    def get(arch: str, kind: str) -> Path:
        if (arch, kind) not in files:
            out = tmp_path_factory.mktemp(f"{arch}-{kind}") / f"tiny-{arch}-{kind}.gguf"
            files[arch, kind] = write_gguf(hf_checkpoint(arch), out, _types(kind), chat_template=CHAT_TEMPLATE)
        return files[arch, kind]

    return get


# The npu plugin's int8 kernels on ONNX Runtime's CPU EP quantize activations per block (accuracy_level 4, its
# module notes) even for a float-activation spec; where one wins a projection's bid the tokens drift from
# transformers'. The mapping under test is the weights', so those kernels are left out here.
NO_NPU = {"DSPARK_PLUGINS": "no:npu"}


@cache
def _host() -> Any:
    from dspark.host.plugin_manager import PluginHost
    from dspark.host.settings import PluginSettings

    return PluginHost(PluginSettings(blocked={"npu"})).load()


def _llm(path: Path) -> LLM:
    return LLM(str(path), dtype="float32", plugin_host=_host())


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant>{% endif %}")


@cache
def _hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None  # the full length, like ignore_eos
    return m


@cache
def _hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    m, out = _hf(path), []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


TEXTS = ["def hello(name):", "import os\nprint(", " the quick brown fox"]


def _prompts(path: Path, vocab: int) -> list[list[int]]:
    """The texts through transformers' tokenizer of the file (checked against ours), and random ids."""
    g = torch.Generator().manual_seed(3)
    rand = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 23)]
    return [_hf_tokenizer(path)(t)["input_ids"] for t in TEXTS] + rand


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(("arch", "kind"), CASES)
def test_greedy_matches_transformers_on_the_same_file(gguf_file: Callable[[str, str], Path], arch: str,
                                                      kind: str) -> None:
    path = gguf_file(arch, kind)
    with capture_logs() as logs:
        llm = _llm(path)
    eng = llm.engine
    assert eng.gguf is not None and eng.runner.cfg.model_type == arch.split("_")[0]
    # The tokenizer built from the file's metadata is transformers' (BOS added as the file says).
    assert [eng.tokenizer.encode(t).ids for t in TEXTS] == [_hf_tokenizer(path)(t)["input_ids"] for t in TEXTS]
    prompts = _prompts(path, eng.runner.cfg.vocab_size)
    assert _greedy(llm, prompts) == _hf_greedy(path, prompts)

    decisions = eng.gguf.decisions
    dequantized = {e["ggml_type"]: e for e in logs if e["event"] == "gguf.dequantized"}
    if kind != "MIXED":
        # Q8_0: the projections on int8 kernels; an untied embedding table dequantized for its gather (a tied
        # one is also the head, on an int8 kernel).
        untied = kind == "Q8_0" and not eng.runner.cfg.tie_word_embeddings
        assert decisions[kind].action == ACTION[kind] + ("+dequantized" if untied else "")
        assert decisions["F32"].action == "float"  # norms (and biases) as stored
    if kind in ("Q4_0", "Q4_K", "Q6_K"):  # dequantized, the reason logged as a warning
        assert set(dequantized) == {kind} and dequantized[kind]["reason"].startswith("dequantized to float32")
        assert eng.quant_plan is None and all(lp.precision == "float" for lp in eng.gguf.plan.layers)
    if kind == "Q8_0":  # every projection on the plugins' int8 kernels, groups of 32 as the file's blocks
        if untied:
            assert set(dequantized) == {"Q8_0"} and "model.embed_tokens.weight" in dequantized["Q8_0"]["reason"]
        else:
            assert not dequantized
        linear = [lp for lp in eng.quant_plan.layers if lp.kind == "linear"]
        assert linear and all(lp.precision == "int8" and lp.group_size == 32 for lp in linear)
        assert {c.runs for c in eng.quant_kernels} == {"int8"}, [(c.name, c.reason) for c in eng.quant_kernels]
        assert all(eng.gguf.stored[n].exact_int8 for n, s in eng.gguf.stored.items() if s.ggml_type == "Q8_0")
    if kind == "MIXED":
        plan = {lp.name: lp for lp in eng.gguf.plan.layers}
        assert plan["model.layers.0.mlp.gate_up_proj"].precision == "int8"  # gate and up both Q8_0
        assert plan["lm_head"].precision == "int8"
        qkv = plan["model.layers.0.self_attn.qkv_proj"]
        assert qkv.precision == "float" and "fused" in qkv.reason  # q/k Q8_0 with v Q6_K: one kernel
        assert decisions["Q8_0"].action == "int8+dequantized"
        assert set(dequantized) == {"Q4_K", "Q6_K", "Q8_0"}
        assert {c.name for c in eng.quant_kernels if c.runs == "int8"} == {
            n for n, lp in plan.items() if lp.precision == "int8"}


def test_llama3_rope_from_rope_freqs(hf_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Llama 3.1's RoPE survives only as llama.cpp's rope_freqs factors (transformers' GGUF loader drops them):
    matched back to the llama3 scaling, the tokens are transformers' on the original checkpoint."""
    from transformers import AutoModelForCausalLM

    ckpt = hf_checkpoint("llama3")
    path = write_gguf(ckpt, tmp_path / "llama3.gguf", "F32")
    llm = _llm(path)
    rope = llm.engine.runner.cfg.rope_scaling
    assert rope is not None and rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    m = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, llm.engine.runner.cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 60)]
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                             pad_token_id=0, eos_token_id=None)
        refs.append(out[0, len(p):].tolist())
    assert _greedy(llm, prompts) == refs
    # Tokens alone barely tell the scalings apart at these lengths; the logits do (default RoPE is ~0.1 off).
    from dspark.llm.runner.types import SeqChunk

    runner = llm.engine.runner
    last = runner.step(runner.make_cache(8, 16), [SeqChunk("x", prompts[1])])[0]
    with torch.no_grad():
        ref = m(torch.tensor([prompts[1]])).logits[0, -1]
    assert torch.allclose(last, ref, atol=1e-4), (last - ref).abs().max()


AMX = {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize(("flags", "kind", "want"), [(AMX, "Q4_K", torch.bfloat16), (AMX, "MIXED", torch.bfloat16),
                                                     (AMX, "Q8_0", torch.float32), (AMX, "Q6_K", torch.float32),
                                                     ({"avx512f", "avx512_bf16"}, "Q4_K", torch.float32),
                                                     ({"avx2"}, "Q4_K", torch.float32)],
                         ids=["amx-q4_k", "amx-mixed", "amx-q8_0", "amx-q6_k", "avx512-bf16", "avx2"])
def test_auto_computes_a_file_of_4_bit_blocks_in_bfloat16_on_amx(
        gguf_file: Callable[[str, str], Path], monkeypatch: pytest.MonkeyPatch, flags: set[str], kind: str,
        want: torch.dtype) -> None:
    # A quantized file has no float type of its own: "auto" takes bfloat16 where OpenVINO runs 4-bit blocks on
    # AMX's bfloat16 tiles (its 8-bit ones step faster in float32), float32 elsewhere; a float file keeps its
    # own type, and a dtype asked for is the dtype. (MIXED: Q8_0 and Q6_K beside Q4_K tensors.)
    from dspark.llm.gguf import load_runner
    from dspark.llm.gguf.reference import reference_runner
    from dspark.host import hostinfo

    facts = {**hostinfo.cpu_static(), "isa_features": sorted(flags)}
    monkeypatch.setattr(hostinfo, "cpu_static", lambda: facts)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    q = gguf_file("qwen2" if kind == "MIXED" else "llama", kind)
    assert load_runner(q, "auto", weightless_if_quantized=True)[0].dtype == want
    assert load_runner(q, "auto")[0].dtype == want  # the torch runner holding the file dequantized
    assert reference_runner(q, "auto", budget=0).dtype == want  # the probe's judge
    assert load_runner(q, "float32")[0].dtype == torch.float32
    assert load_runner(gguf_file("llama", "F32"), "auto")[0].dtype == torch.float32


def test_q8_0_maps_exactly_and_the_others_do_not() -> None:
    """The decision per type, on weights alone: only Q8_0's blocks survive the kernels' re-quantization."""
    from dspark.llm.gguf.tensors import exact_on_int8_kernels
    from gguf import GGMLQuantizationType as T
    from gguf import quants
    from gguf_testutil import quantize_q4_k, quantize_q6_k

    w = np.random.default_rng(0).standard_normal((64, 512)).astype(np.float32) * 0.05
    back = {
        "Q8_0": quants.dequantize(quants.quantize(w, T.Q8_0), T.Q8_0),
        "Q4_0": quants.dequantize(quants.quantize(w, T.Q4_0), T.Q4_0),
        "Q4_K": quants.dequantize(quantize_q4_k(w), T.Q4_K),
        "Q6_K": quants.dequantize(quantize_q6_k(w), T.Q6_K),
    }
    assert {k: exact_on_int8_kernels(v) for k, v in back.items()} == {
        "Q8_0": True, "Q4_0": False, "Q4_K": False, "Q6_K": False}


def test_convert_keeps_the_files_types(gguf_file: Callable[[str, str], Path], tmp_path: Path) -> None:
    """`dspark convert --quantization none` on a GGUF: Q8_0 projections stored int8/g32 (exact), the rest
    float; the optimized directory then generates what transformers generates from the file."""
    from dspark.llm.quantization.convert import PLAN_FILE, convert

    path = gguf_file("qwen2", "MIXED")
    out = tmp_path / "opt"
    plan = convert(path, out, quantization="none", draft_spec="none")
    assert plan.scheme == "gguf" and json.loads((out / PLAN_FILE).read_text())["scheme"] == "gguf"
    int8 = {lp.name for lp in plan.layers if lp.precision == "int8"}
    assert "lm_head" in int8 and all(lp.group_size == 32 for lp in plan.layers if lp.name in int8)
    assert json.loads((out / "dspark_gguf_source.json").read_text())["file"] == path.name
    llm = _llm(out)
    prompts = _prompts(path, llm.engine.runner.cfg.vocab_size)
    assert _greedy(llm, prompts) == _hf_greedy(path, prompts)
    assert not list(tmp_path.glob(".opt.gguf-*"))  # the intermediate checkpoint is gone


def test_unsupported_architecture_and_type_are_named(tmp_path: Path, hf_checkpoint: Callable[[str], Path]) -> None:
    import gguf

    bad_arch = tmp_path / "phi2.gguf"
    w = gguf.GGUFWriter(str(bad_arch), "phi2")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"phi2\.gguf: GGUF architecture 'phi2' is not supported; supported: llama"):
        LLM(str(bad_arch))
    # A llama file whose first q projection is Q8_1, which the gguf package cannot dequantize.
    bad_type = write_gguf(hf_checkpoint("llama"), tmp_path / "q8_1.gguf",
                          lambda name: "Q8_1" if name == "blk.0.attn_q.weight" else "F32")
    with pytest.raises(GGUFError, match=r"q8_1\.gguf: tensor blk\.0\.attn_q\.weight is stored as Q8_1"):
        LLM(str(bad_type))
    with pytest.raises(GGUFError, match="GGUF file does not exist"):
        LLM(str(tmp_path / "missing.gguf"))


def _file_tokenizer(path: Path) -> Any:
    from dspark.llm.gguf.metadata import open_reader, read_metadata
    from dspark.llm.gguf.tokenizer import build_tokenizer

    return build_tokenizer(read_metadata(open_reader(path)), path)


def _start_server() -> Callable[..., Any]:
    """tests/server/conftest.py's start_server (a real server process), loaded by path from here."""
    spec = importlib.util.spec_from_file_location("server_conftest", Path(__file__).parents[2] / "server" / "conftest.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being defined
    spec.loader.exec_module(mod)
    return mod.start_server  # type: ignore[no-any-return]


def test_served_through_the_openai_server(gguf_file: Callable[[str, str], Path], tmp_path: Path) -> None:
    """`dspark serve --model x.gguf`: the openai client gets transformers' greedy tokens, and chat uses the
    file's chat template."""
    path = gguf_file("llama", "Q8_0")
    h = _start_server()(tmp_path / "srv", model={"name": "tiny-gguf", "dtype": "float32"},
                        args=["--model", str(path)], env=NO_NPU)
    try:
        client = h.openai()
        assert [m.id for m in client.models.list().data] == ["tiny-gguf"]
        tok = _hf_tokenizer(path)
        ref = _hf_greedy(path, [tok(TEXTS[0])["input_ids"]])[0]
        r = client.completions.create(model="tiny-gguf", prompt=TEXTS[0], max_tokens=NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == _file_tokenizer(path).decode(ref, skip_special_tokens=True)
        msgs = [{"role": "user", "content": "hello"}]
        c = client.chat.completions.create(model="tiny-gguf", messages=msgs, max_tokens=4, temperature=0)  # type: ignore[arg-type]
        rendered = "user> hello\nassistant>"  # CHAT_TEMPLATE, from the file's tokenizer.chat_template
        assert c.usage is not None and c.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])
        applied = [x for x in h.log() if x.get("event") == "quantization.applied"]  # the file's Q8_0 plan
        assert applied and applied[0]["scheme"] == "gguf" and all(k.startswith("int8@") for k in applied[0]["kernels"])
        assert sum(applied[0]["kernels"].values()) == 9  # 2 layers x (qkv, o, gate_up, down) + lm_head
    finally:
        assert h.stop() == 0
