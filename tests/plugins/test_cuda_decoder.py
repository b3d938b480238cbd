"""The cuda plugin's whole decoder: the Triton paged-attention kernels against plain attention, the
decoder against the torch reference runner (conformance scenario, early exits, layer ranges), its bids.

Without a GPU the kernels run in Triton's interpreter on CPU tensors and the decoder on the CPU; on a
GPU machine (scripts/gpu_check.sh) the same tests run compiled on cuda:0, plus the CUDA-graph tests.
``TRITON_INTERPRET=1`` set by the caller forces the interpreter even where CUDA is available.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton reads it once, when triton.language is first imported (nothing in dspark imports
    # Triton before this): its own library functions must be interpreted too.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dspark.llm.decoding.batch import build_batch, split_logits
from dspark.llm.decoding.conformance import compare
from dspark.llm.decoding.spec import make_spec
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.runner.model import ModelRunner, SeqChunk
from dspark.sdk.decoder import DecoderSpec, StepBatch
from dspark.testing.decoder_kit import DECODER_VARIANTS
from dspark.types import Device, QuantSpec

import dspark_plugins_cuda
import dspark_plugins_cuda.decoder as decoder_module
from dspark_plugins_cuda.decoder import KVCache, TritonDecoder, decoder_bid
from dspark_plugins_cuda.decoder import triton_paged as tp

INTERPRETED = tp.interpreted()
DEVICE = "cpu" if INTERPRETED else "cuda:0"
MODEL = Path(__file__).resolve().parents[2] / "core" / "dspark" / "assets" / "models" / "stdlib-llama"
needs_kernels = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRETED), reason="no GPU, and Triton was imported in this process before "
                                          "TRITON_INTERPRET=1 was set: run this file on its own")
needs_gpu = pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="no CUDA GPU on this machine "
                               "(or TRITON_INTERPRET=1 forces the interpreter)")


# -- the kernels ----------------------------------------------------------------------------------


def _plain_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, begins: list[int], past: list[int],
                     tables: list[list[int]], window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Per sequence: gather its positions from the blocks, repeat kv heads, causal softmax in float32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    group, page = q.shape[1] // kc.shape[2], kc.shape[1]
    for s, table in enumerate(tables):
        r0, r1 = begins[s], begins[s + 1]
        n = past[s] + r1 - r0
        pos = torch.arange(n)
        blocks = torch.tensor([table[p // page] for p in range(n)])
        k = kc[blocks, pos % page].float().repeat_interleave(group, 1)
        v = vc[blocks, pos % page].float().repeat_interleave(group, 1)
        scores = torch.einsum("thd,lhd->htl", q[r0:r1].float(), k) * q.shape[2] ** -0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = past[s] + torch.arange(r1 - r0)
        hidden = pos[None, None, :] > qpos[None, :, None]
        if window is not None:
            hidden = hidden | (pos[None, None, :] <= qpos[None, :, None] - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        out[r0:r1] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v)
    return out


def _case(past: list[int], new: list[int], heads: int, kv_heads: int, dim: int, page: int, dtype: torch.dtype,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // page) for p, n in zip(past, new, strict=True)]
    num_blocks = sum(need) + 3
    kc = torch.randn((num_blocks, page, kv_heads, dim), generator=g).to(dtype)
    vc = torch.randn((num_blocks, page, kv_heads, dim), generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # blocks out of order, as a real cache has them
    tables, o = [], 0
    for k in need:
        tables.append(perm[o:o + k])
        o += k
    begins = [0]
    for n in new:
        begins.append(begins[-1] + n)
    q = torch.randn((begins[-1], heads, dim), generator=g).to(dtype)
    return q, kc, vc, begins, tables


def _i32(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=DEVICE)


_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("past", "new", "heads", "kv_heads", "dim", "page"), [
    ([0], [1], 4, 4, 32, 16),  # one decode row, no GQA, nothing cached
    ([37, 0, 5, 20], [1, 11, 9, 1], 6, 2, 64, 16),  # GQA 3, several blocks, partial blocks, decode + chunks
    ([70], [40], 8, 1, 80, 16),  # a chunk over past: several query tiles, head_dim not a power of two
    ([3, 9], [2, 4], 4, 2, 64, 8),  # small blocks, a verified draft per sequence
])
def test_paged_attention_matches_plain_attention(dtype: torch.dtype, past: list[int], new: list[int], heads: int,
                                                 kv_heads: int, dim: int, page: int) -> None:
    q, kc, vc, begins, tables = _case(past, new, heads, kv_heads, dim, page, dtype)
    flat = [b for t in tables for b in t]
    tb = np.concatenate([[0], np.cumsum([len(t) for t in tables])]).tolist()
    got = tp.paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), _i32(begins), _i32(past), _i32(flat),
                             _i32(tb), max(new), dim ** -0.5)
    assert got.dtype == dtype and got.shape == q.shape
    want = _plain_attention(q, kc, vc, begins, past, tables)
    torch.testing.assert_close(got.cpu().float(), want.to(dtype).float(), atol=_TOL[dtype], rtol=_TOL[dtype])


@needs_kernels
@pytest.mark.parametrize(("window", "softcap"), [(5, None), (None, 0.5), (8, 2.0)])
def test_sliding_windows_and_soft_caps_match_plain_attention(window: int | None, softcap: float | None) -> None:
    # Decode rows past the window, a chunk over a past (tiles whose first blocks lie outside every row's
    # window), a first prompt longer than it.
    past, new = [37, 0, 20], [1, 11, 9]
    q, kc, vc, begins, tables = _case(past, new, 6, 2, 64, 16, torch.float32, seed=2)
    flat = [b for t in tables for b in t]
    tb = np.concatenate([[0], np.cumsum([len(t) for t in tables])]).tolist()
    got = tp.paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), _i32(begins), _i32(past), _i32(flat),
                             _i32(tb), max(new), 64 ** -0.5, window=window, softcap=softcap)
    want = _plain_attention(q, kc, vc, begins, past, tables, window, softcap)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_padded_two_dimensional_tables_and_int64_lengths() -> None:
    past, new = [20, 2, 0], [1, 1, 3]
    q, kc, vc, begins, tables = _case(past, new, 4, 2, 32, 16, torch.float32, seed=1)
    width = max(len(t) for t in tables) + 2
    padded = torch.zeros((len(tables), width), dtype=torch.int32)
    for s, t in enumerate(tables):
        padded[s, :len(t)] = torch.tensor(t)
    i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)
    got = tp.paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), i64(begins), i64(past),
                             padded.reshape(-1).to(DEVICE), tp.padded_table_begins(len(tables), width, DEVICE),
                             max(new), 32 ** -0.5)
    torch.testing.assert_close(got.cpu(), _plain_attention(q, kc, vc, begins, past, tables), atol=1e-5, rtol=1e-5)


@needs_kernels
def test_write_kv_stores_rows_at_their_slots_and_skips_padding() -> None:
    kc = torch.zeros((4, 8, 2, 16), device=DEVICE)
    vc = torch.zeros_like(kc)
    k = torch.randn((3, 2, 16), device=DEVICE)
    v = torch.randn((3, 2, 16), device=DEVICE)
    tp.write_kv(k, v, kc, vc, torch.tensor([9, -1, 31], device=DEVICE))
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(vc[3, 7], v[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2 and int((vc != 0).any(-1).any(-1).sum()) == 2


# -- the decoder against the torch reference -------------------------------------------------------


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner.from_pretrained(str(MODEL), "float32")


@pytest.fixture(scope="module")
def spec(runner: ModelRunner) -> DecoderSpec:
    return make_spec(runner, MODEL, max_num_seqs=8)


@pytest.fixture(scope="module")
def decoder(spec: DecoderSpec) -> TritonDecoder:
    return TritonDecoder(spec, torch_device=DEVICE, block_size=16)


class _Side:
    """One KV allocation of a decoder and the engine's bookkeeping for it (block tables, lengths)."""

    def __init__(self, dec: TritonDecoder, num_layers: int, num_blocks: int = 16) -> None:
        self.dec = dec
        self.kv = dec.allocate(num_blocks)
        self.cache = PagedKVCache(num_layers=num_layers, num_pages=num_blocks, page_size=dec.block_size,
                                  kv_heads=1, head_dim=1, device="meta")

    def batch(self, chunks: list[SeqChunk], exit_layer: int | None = None) -> StepBatch:
        return build_batch(self.cache, chunks, exit_layer)

    def advance(self, chunks: list[SeqChunk]) -> None:
        for ch in chunks:
            self.cache.set_len(ch.seq_id, self.cache.seq_lens.get(ch.seq_id, 0) + len(ch.token_ids))

    def step(self, chunks: list[SeqChunk], exit_layer: int | None = None) -> torch.Tensor:
        out = torch.as_tensor(self.dec.step(self.kv, self.batch(chunks, exit_layer)))
        self.advance(chunks)
        return out


def _prompts(vocab: int, lens: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]


@needs_kernels
def test_conformance_with_the_torch_runner(decoder: TritonDecoder, runner: ModelRunner) -> None:
    r = compare(decoder, runner, prompt_lens=(11, 37), decode_steps=4, draft=5, num_blocks=16)
    assert r.rows > 10
    assert r.argmax_flips == 0, r
    assert r.max_abs_diff < 1e-3, r


@needs_kernels
def test_exit_layer_matches_the_runner(decoder: TritonDecoder, runner: ModelRunner) -> None:
    e = 2
    mine = _Side(decoder, runner.cfg.num_hidden_layers)
    ref = runner.make_cache(16, decoder.block_size)
    a, b = _prompts(runner.cfg.vocab_size, (7, 18), seed=3)
    steps = [[SeqChunk("a", a), SeqChunk("b", b, all_logits=True)], [SeqChunk("a", [5]), SeqChunk("b", [9])]]
    for chunks in steps:
        want = runner.step(ref, chunks, exit_layer=e)
        got = split_logits(chunks, mine.step(chunks, exit_layer=e))
        for w, o in zip(want, got, strict=True):
            torch.testing.assert_close(o.float(), w.float(), atol=1e-3, rtol=1e-4)
    # An exit runs fewer layers than the whole model: the logits must differ from a full step's.
    full = runner.step(runner.make_cache(16, decoder.block_size), [SeqChunk("a", a)])[0]
    early = runner.step(runner.make_cache(16, decoder.block_size), [SeqChunk("a", a)], exit_layer=e)[0]
    assert not torch.allclose(full, early, atol=1e-2)


@needs_kernels
def test_two_ranges_chained_equal_the_whole(decoder: TritonDecoder, runner: ModelRunner) -> None:
    n = runner.cfg.num_hidden_layers
    front = TritonDecoder(make_spec(runner, MODEL, layers=(0, n // 2)), torch_device=DEVICE, block_size=16)
    back = TritonDecoder(make_spec(runner, MODEL, layers=(n // 2, n)), torch_device=DEVICE, block_size=16)
    whole, s1, s2 = _Side(decoder, n), _Side(front, n), _Side(back, n)
    assert len(s1.kv.k) == n // 2 and len(s2.kv.k) == n - n // 2
    a, b = _prompts(runner.cfg.vocab_size, (9, 4), seed=5)
    for chunks in ([SeqChunk("a", a), SeqChunk("b", b)], [SeqChunk("a", [7]), SeqChunk("b", [11])]):
        want = whole.step(chunks)
        hidden = s1.step(chunks)
        assert hidden.shape == (sum(len(c.token_ids) for c in chunks), runner.cfg.hidden_size)
        batch = s2.batch(chunks)
        batch = dataclasses.replace(batch, input_ids=None, hidden=np.asarray(hidden, dtype=np.float32))
        got = torch.as_tensor(back.step(s2.kv, batch))
        s2.advance(chunks)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@needs_kernels
def test_bfloat16_decoder_passes_the_engine_probe() -> None:
    runner = ModelRunner.from_pretrained(str(MODEL), "bfloat16")
    dec = TritonDecoder(make_spec(runner, MODEL), torch_device=DEVICE, block_size=16)
    r = compare(dec, runner, prompt_lens=(5, 19), decode_steps=2, draft=3, num_blocks=16)
    # The engine's probe tolerances for half precision (dspark.llm.decoding.choose).
    assert r.max_abs_diff <= 1.0 and r.flip_rate <= 0.25, r


@needs_kernels
def test_kv_allocation_layout(decoder: TritonDecoder, spec: DecoderSpec) -> None:
    kv = decoder.allocate(3)
    assert isinstance(kv, KVCache) and len(kv.k) == len(kv.v) == spec.num_layers
    assert tuple(kv.k[0].shape) == (3, 16, spec.num_kv_heads, spec.head_dim) and kv.k[0].dtype == torch.float32


# -- bids ---------------------------------------------------------------------------------------------


def _gpu(dtypes: list[str] | None = None, triton: str | None = "3.9.0") -> Device:
    return Device(id="cuda:0", kind="cuda", name="NVIDIA Test GPU", runtime="torch-cuda",
                  dtypes=dtypes or ["float32", "float16", "bfloat16", "int64", "int32", "int8", "bool"],
                  properties={"triton": triton})  # type: ignore[arg-type]


def test_bid_promises_the_spec(spec: DecoderSpec) -> None:
    bid = dspark_plugins_cuda.dspark_decoder_bid(decoder=spec, device=_gpu())
    assert bid is not None and bid.declined is None
    assert bid.block_size is None and bid.exit_layers and bid.precision == bid.kv_dtype == "float32"
    assert bid.kv_bytes_per_token == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    assert bid.weight_bytes > spec.vocab_size * spec.hidden_size * 4
    assert dspark_plugins_cuda.DSPARK_API_VERSION == "1.10"


def test_bid_declines_what_it_does_not_run(spec: DecoderSpec) -> None:
    ctx = decoder_bid(dataclasses.replace(spec, features=frozenset({"gguf_stored", "qkv_bias"})), _gpu())
    assert ctx is not None and ctx.declined and "gguf_stored" in ctx.declined and "qkv_bias" not in ctx.declined
    int8 = QuantSpec(weight_bits=8)
    quant = decoder_bid(dataclasses.replace(spec, quantization={"model.layers.0.self_attn.qkv_proj": int8}), _gpu())
    assert quant is not None and quant.declined and "linear.int8" in quant.declined
    old = decoder_bid(dataclasses.replace(spec, dtype="bfloat16"), _gpu(["float32", "float16"]))
    assert old is not None and old.declined and "bfloat16" in old.declined
    assert "Triton" in (decoder_bid(spec, _gpu(triton=None)).declined or "")  # type: ignore[union-attr]
    cpu = Device(id="cpu", kind="cpu", name="CPU", runtime="torch")
    assert decoder_bid(spec, cpu) is None
    assert dspark_plugins_cuda.dspark_compile_decoder(
        decoder=dataclasses.replace(spec, features=frozenset({"gguf_stored"})), device=_gpu()) is None


def test_the_bid_knows_the_kernels_head_dim_limit(spec: DecoderSpec) -> None:
    assert decoder_module.MAX_HEAD_DIM == tp.MAX_HEAD_DIM
    big = decoder_bid(dataclasses.replace(spec, head_dim=tp.MAX_HEAD_DIM * 2), _gpu())
    assert big is not None and big.declined and "head_dim" in big.declined


def test_a_range_that_does_not_start_at_layer_zero_runs_no_exits(spec: DecoderSpec) -> None:
    bid = decoder_bid(dataclasses.replace(spec, layers=(3, spec.num_layers)), _gpu())
    assert bid is not None and not bid.declined and not bid.exit_layers
    assert bid.kv_bytes_per_token == 2 * 3 * spec.num_kv_heads * spec.head_dim * 4


# -- CUDA graphs ----------------------------------------------------------------------------------------


def _decode_run(dec: TritonDecoder, runner: ModelRunner, exit_layer: int | None) -> list[torch.Tensor]:
    """A prefill of three prompts, then decode steps of three sequences (bucket 4), then of two (bucket 2)."""
    side = _Side(dec, runner.cfg.num_hidden_layers, 32)
    prompts = _prompts(runner.cfg.vocab_size, (4, 9, 21), seed=7)
    ids = [f"s{i}" for i in range(len(prompts))]
    chunks = [SeqChunk(i, p) for i, p in zip(ids, prompts, strict=True)]
    outs = []
    for step in range(4):
        out = side.step(chunks, exit_layer)
        outs.append(out)
        live = ids if step < 2 else ids[:2]
        chunks = [SeqChunk(i, [t]) for i, t in zip(live, out.argmax(-1).tolist(), strict=False)]
    return outs


@needs_kernels
def test_bucketed_static_inputs_equal_eager(spec: DecoderSpec, runner: ModelRunner) -> None:
    # Off CUDA, cuda_graphs=True runs the graphs' padded static buffers eagerly: padding rows, their
    # slots, lengths and tables must leave the real rows' logits and KV as the eager path's.
    bucketed = TritonDecoder(spec, torch_device=DEVICE, block_size=16, cuda_graphs=True)
    eager = TritonDecoder(spec, torch_device=DEVICE, block_size=16, cuda_graphs=False)
    for got, want in zip(_decode_run(bucketed, runner, None), _decode_run(eager, runner, None), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # matmuls over padded rows round apart
    assert {k[1] for k in bucketed._graphs} == {2, 4} and not eager._graphs


# -- CUDA graphs (GPU only) ---------------------------------------------------------------------------


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("exit_layer", [None, 2])
def test_cuda_graph_replay_equals_eager(spec: DecoderSpec, runner: ModelRunner, exit_layer: int | None) -> None:
    graphed = TritonDecoder(spec, torch_device="cuda:0", block_size=16)
    eager = TritonDecoder(spec, torch_device="cuda:0", block_size=16, cuda_graphs=False)
    assert graphed.cuda_graphs and not eager.cuda_graphs
    for got, want in zip(_decode_run(graphed, runner, exit_layer), _decode_run(eager, runner, exit_layer),
                         strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert len(graphed._graphs) == 2 and all(g.graph is not None for g in graphed._graphs.values())
    assert not eager._graphs


@pytest.mark.cuda
@needs_gpu
def test_cuda_graphs_keep_allocations_apart(spec: DecoderSpec, runner: ModelRunner) -> None:
    dec = TritonDecoder(spec, torch_device="cuda:0", block_size=16)
    n = runner.cfg.num_hidden_layers
    one, two = _Side(dec, n), _Side(dec, n)
    (a,) = _prompts(runner.cfg.vocab_size, (12,), seed=9)
    one.step([SeqChunk("a", a)])
    two.step([SeqChunk("a", a[:6])])
    x = one.step([SeqChunk("a", [42])])
    y = two.step([SeqChunk("a", [42])])
    assert len(dec._graphs) == 2 and not torch.allclose(x, y)
    ref = runner.make_cache(16, 16)
    runner.step(ref, [SeqChunk("a", a)])
    torch.testing.assert_close(x[0], runner.step(ref, [SeqChunk("a", [42])])[0], atol=1e-3, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("variant", [v for v in DECODER_VARIANTS if v != "phi3_longrope"])
def test_every_family_the_definition_expresses_runs_on_triton(tmp_path: Path, variant: str) -> None:
    """dspark.sdk.family.forward on the torch/Triton ops: windows and soft-caps in the paged kernel."""
    from dspark.testing import check_decoder, decoder_spec, tiny_checkpoint

    path = tiny_checkpoint(tmp_path / variant, variant)
    spec = decoder_spec(path)
    assert decoder_bid(spec, _gpu()).declined is None  # type: ignore[union-attr]
    ok, seen = check_decoder(TritonDecoder(spec, torch_device=DEVICE, block_size=16), path)
    assert ok, seen
