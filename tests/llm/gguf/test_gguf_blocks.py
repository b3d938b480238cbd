"""A quantized GGUF file's weights as stored (``DecoderSpec.blocks()``, plugin API 1.14): each block type unpacks
to what the gguf package dequantizes, and a file's blocks are, projection by projection, the weights the engine
reads when it dequantizes the file (q/k rows in Hugging Face's order, biases, a tied head)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.llm.gguf import load_gguf
from dspark.llm.gguf.blocks import stored_weights
from dspark.types.blocks import BLOCK_TYPES, BlockPart, BlockWeight
from gguf_testutil import make_checkpoint, write_gguf

# Offsets of each block's float16 fields (d; Q4_K's dmin): finite values there, any bits elsewhere.
HALF_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q5_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}
RANGES = {"Q8_0": (np.int8, -128, 127), "Q5_0": (np.int8, -16, 15), "Q6_K": (np.int8, -32, 31),
          "Q4_0": (np.uint8, 0, 15), "Q4_K": (np.uint8, 0, 15)}


def _random_blocks(kind: str, rows: int, blocks_per_row: int, rng: np.random.Generator) -> np.ndarray:
    _, nbytes, _ = BLOCK_TYPES[kind]
    raw = rng.integers(0, 256, (rows * blocks_per_row, nbytes), dtype=np.uint8)
    for off in HALF_FIELDS[kind]:
        raw[:, off:off + 2] = rng.uniform(-0.05, 0.05, (len(raw), 1)).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":
        raw[0, 4:8] = 0  # sub-blocks 0-3 of the first block with scale 0: every value is -dmin * min
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
def test_each_block_type_unpacks_to_what_the_gguf_package_dequantizes(kind: str) -> None:
    import gguf

    per_block, _, group = BLOCK_TYPES[kind]
    rows, nblocks = 6, 4
    raw = _random_blocks(kind, rows, nblocks, np.random.default_rng(7))
    part = BlockPart("blk.0.ffn_up.weight", kind, raw, rows, per_block * nblocks)
    ref = np.asarray(gguf.dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float32).reshape(rows, -1)
    got = part.dequantize()
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))
    u = part.unpack()
    dtype, lo, hi = RANGES[kind]
    assert u.q.dtype == dtype and u.q.shape == (rows, per_block * nblocks // group, group)
    assert int(u.q.min()) >= lo and int(u.q.max()) <= hi
    assert u.scale.dtype == np.float32 and u.scale.shape == (*u.q.shape[:2], 1)
    assert u.bits == (8 if dtype == np.int8 else 4)


def test_a_type_without_unpacking_is_named() -> None:
    part = BlockPart("blk.3.attn_q.weight", "IQ2_XS", np.zeros((2, 8), np.uint8), 2, 256)
    with pytest.raises(TypeError, match=r"blk\.3\.attn_q\.weight is stored as IQ2_XS"):
        part.unpack()


MIXED = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q8_0",
         "ffn_up": "Q8_0", "ffn_down": "Q6_K", "output": "Q6_K", "token_embd": "Q4_K"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            ckpt = make_checkpoint(tmp_path_factory.mktemp(f"{arch}-hf"), arch)
            made[arch] = write_gguf(ckpt, tmp_path_factory.mktemp(arch) / f"{arch}-mixed.gguf",
                                    lambda name: MIXED[name.split(".")[-2]])
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama_tied"])
def test_a_files_blocks_are_the_weights_the_engine_dequantizes(files: Callable[[str], Path], arch: str) -> None:
    path = files(arch)
    w = stored_weights(path)
    ref = {k: v.numpy() for k, v in load_gguf(path, torch.float32).weights.items()}
    for i, L in enumerate(w.layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        assert isinstance(L.qkv, BlockWeight) and [p.ggml_type for p in L.qkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
        want = {"qkv": np.concatenate([ref[f"{a}.{p}_proj.weight"] for p in "qkv"]).T, "o": ref[f"{a}.o_proj.weight"].T,
                "gate_up": np.concatenate([ref[f"{m}.gate_proj.weight"], ref[f"{m}.up_proj.weight"]]).T,
                "down": ref[f"{m}.down_proj.weight"].T}
        for name, expected in want.items():
            got = getattr(L, name)
            assert got.shape == expected.shape, name
            np.testing.assert_allclose(got.dequantize(), expected, rtol=1e-6, atol=1e-7, err_msg=f"layer {i} {name}")
        np.testing.assert_array_equal(L.in_norm, ref[f"model.layers.{i}.input_layernorm.weight"])
        if arch == "qwen2":
            bias = np.concatenate([ref[f"{a}.{p}_proj.bias"] for p in "qkv"])
            np.testing.assert_array_equal(L.qkv_bias, bias)
    assert isinstance(w.embed, BlockWeight) and [p.ggml_type for p in w.embed.parts] == ["Q4_K"]
    np.testing.assert_allclose(w.embed.dequantize().T, ref["model.embed_tokens.weight"], rtol=1e-6, atol=1e-7)
    if arch == "llama_tied":
        assert w.head is w.embed  # one table, as the file holds it
    else:
        assert isinstance(w.head, BlockWeight)
        np.testing.assert_allclose(w.head.dequantize(), ref["lm_head.weight"].T, rtol=1e-6, atol=1e-7)


def test_openvino_runs_a_files_blocks_as_compressed_weights(files: Callable[[str], Path]) -> None:
    # The cpu plugin holds each projection as the file's integers (u4 or i8) and scales, OpenVINO's compressed
    # FullyConnected: no float copy of a projection. Admitted only once its probe matched the file dequantized
    # (in a process of its own: this one never holds the torch copy).
    from dspark.llm.engine import LLMEngine
    from dspark.llm.sampling import SamplingParams

    path = files("llama")
    e = LLMEngine.from_model(path, dtype="float32", decoder="cpu", max_batch_size=4)
    c = e.decoder_choice
    assert c is not None and c.chosen == "cpu@cpu" and "as stored" in c.reason, c
    assert e.runner.reference.is_weightless
    consts: dict[str, int] = {}
    for op in e.runner.current.compiled.compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        if "layerType" in rt and rt["layerType"].astype(str) == "Const":
            n = int(np.prod([d.get_length() for d in op.get_output_partial_shape(0)]))
            kind = op.get_output_element_type(0).get_type_name()
            consts[kind] = consts.get(kind, 0) + n
    w = stored_weights(path)
    projections = sum(int(np.prod(p.shape)) for L in w.layers for p in (L.qkv, L.o, L.gate_up, L.down))
    assert consts.get("u4", 0) > 0 and consts.get("i8", 0) > 0, consts
    assert consts.get("u4", 0) + consts.get("i8", 0) >= projections, consts
    assert consts.get("u8", 0) >= int(np.prod(w.embed.shape)), consts  # the table's 4-bit values, a byte each
    assert consts.get("f32", 0) < projections // 4, consts  # scales and zero points only
    e.add_request("a", [5, 9, 13, 2, 7], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    out = []
    while e.has_unfinished():
        out += [o for o in e.step() if o.finished]
    assert len(out) == 1 and len(out[0].token_ids) == 12 and e.stats().decoder == "cpu@cpu"


def test_openvino_maps_a_files_blocks_from_the_cache_and_lets_them_go_once_packed(
        files: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The integers, scales and zero points OpenVINO packs from are pages of a file in the disk cache
    # (dspark.sdk.mapped), dropped once it has packed them, as a checkpoint's float weights are: what stays
    # is OpenVINO's packed copy (and the embedding rows a step gathers), not the blocks beside it.
    from dspark.llm.engine import LLMEngine
    from dspark.llm.sampling import SamplingParams
    from dspark.sdk import mapped

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    if not mapped.usable():
        pytest.skip(f"mapped weights save nothing here (not Linux, or {tmp_path} is in memory)")
    path = files("llama")
    w = stored_weights(path)

    def tokens() -> tuple[Any, dict[str, list[int]]]:
        e = LLMEngine.from_model(path, dtype="float32", decoder="cpu", max_batch_size=4)
        assert e.stats().decoder == "cpu@cpu", e.decoder_choice
        out: dict[str, list[int]] = {}
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for batch in (["a"], ["b", "c"]):  # a step of one row and steps of several: OpenVINO packs for each
            for i, r in enumerate(batch):
                e.add_request(r, [5, 9, 13, 2, 7][: 3 + i], greedy)
            while e.has_unfinished():
                out.update({o.request_id: o.token_ids for o in e.step() if o.finished})
        return e.runner.current.compiled.weights_file, out

    wf, got = tokens()
    projections = sum(int(np.prod(p.shape)) for L in w.layers for p in (L.qkv, L.o, L.gate_up, L.down))
    assert wf is not None and wf.nbytes >= projections // 2, (wf, projections)  # every block: 4 bits or more
    # Most pages left: what OpenVINO reads in place stays (the rows a step gathers; on a model this small, some
    # of the scales too: on the 0.5B file, 12 MB of 423 stayed).
    assert wf.resident() <= wf.nbytes // 2, (wf.resident(), wf.nbytes)
    with monkeypatch.context() as m:
        m.setattr(mapped, "usable", lambda: False)  # as where the cache is in memory: OpenVINO's own copies
        owned, want = tokens()
    assert owned is None and got == want
