"""The plugin's own checks, on a tiny random Llama written as a GGUF file with the gguf package (:mod:`tiny`).

What the engine relies on: rows of several sequences in one step, logits of any rows, positions dropped
and decoded again with bit-identical logits, steps wider than ``n_batch`` split, and bids that say what
runs and why not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import dspark_llamacpp as plugin
from dspark.sdk import resident_file
from dspark.sdk.decoder import DecoderSpec, SeqBatch
from dspark.types import Device
from dspark_llamacpp import amx, runtime, tiny

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FF = 96, 64, 2, 4, 2, 128


def _tiny_gguf(path: Path, hidden: int = HIDDEN, ff: int = FF, vocab: int = VOCAB) -> Path:
    return tiny.write(path, hidden=hidden, ff=ff, vocab=vocab, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf")


def _spec(path: Path, layers: tuple[int, int] = (0, LAYERS), dtype: str = "float32") -> DecoderSpec:
    return DecoderSpec(name=path.name, path=str(path), fingerprint="tiny", architecture="llama", vocab_size=VOCAB,
                       hidden_size=HIDDEN, intermediate_size=FF, num_layers=LAYERS, num_heads=HEADS,
                       num_kv_heads=KV_HEADS, head_dim=HIDDEN // HEADS, rms_norm_eps=1e-5, max_position_embeddings=256,
                       features=frozenset(), dtype=dtype, layers=layers, threads=1, max_num_tokens=64)


def _device() -> Device:
    devices = plugin.dspark_probe_devices(False)
    dev = devices[0]
    assert isinstance(dev, Device), devices
    return dev


def _want(n: int, rows: list[int]) -> np.ndarray:
    out = np.zeros(n, np.int8)
    out[rows] = 1
    return out


@pytest.mark.parametrize("unified", [True, False], ids=["one-cache", "cache-per-sequence"])
def test_rows_of_several_sequences_in_one_step_match_decoding_each_alone(gguf_file: Path, unified: bool) -> None:
    model = runtime.Model(gguf_file)
    a, b = [3, 17, 42, 8, 9], [50, 51]
    alone = []
    for toks in (a, b):
        ctx = runtime.Context(model, n_ctx=64, n_seq_max=1, n_batch=16, threads=1)
        alone.append(ctx.decode(np.zeros(len(toks)), np.asarray(toks), np.arange(len(toks)), _want(len(toks), [len(toks) - 1])))
    ctx = runtime.Context(model, n_ctx=128, n_seq_max=2, n_batch=16, threads=1, unified=unified)
    together = ctx.decode(np.asarray([0] * 5 + [1] * 2), np.asarray(a + b), np.asarray([*range(5), *range(2)]),
                          _want(7, [4, 6]))
    assert together.shape == (2, VOCAB)
    np.testing.assert_allclose(together[0], alone[0][0], atol=1e-4)
    np.testing.assert_allclose(together[1], alone[1][0], atol=1e-4)


def test_rows_out_of_slot_order_come_back_in_the_callers_order(gguf_file: Path) -> None:
    # A cache per sequence runs rows sorted by slot (one micro-batch); the logits must still follow the caller.
    model = runtime.Model(gguf_file)
    a, b = [3, 17, 42, 8, 9], [50, 51]
    a_next, b_next = [33], [60, 61]

    def alone(toks: list[int]) -> np.ndarray:
        ctx = runtime.Context(model, n_ctx=64, n_seq_max=1, n_batch=16, threads=1)
        n = len(toks)
        return ctx.decode(np.zeros(n), np.asarray(toks), np.arange(n), np.ones(n, np.int8))

    ctx = runtime.Context(model, n_ctx=192, n_seq_max=3, n_batch=16, threads=1, unified=False)
    ctx.decode(np.asarray([7] * 5 + [8] * 2), np.asarray(a + b), np.asarray([*range(5), *range(2)]), _want(7, [4, 6]))
    assert ctx.slots == {7: 0, 8: 1}
    # sequence 8 (slot 1) first, then 7 (slot 0): every row's logits, in this order
    out = ctx.decode(np.asarray([8, 8, 7]), np.asarray(b_next + a_next), np.asarray([2, 3, 5]), np.ones(3, np.int8))
    np.testing.assert_allclose(out[:2], alone(b + b_next)[2:], atol=1e-4)
    np.testing.assert_allclose(out[2], alone(a + a_next)[5], atol=1e-4)
    ctx.drop(7, 0)
    ctx.drop(8, 0)
    ctx.decode(np.asarray([9, 10]), np.asarray([4, 5]), np.asarray([0, 0]), np.ones(2, np.int8))
    assert ctx.slots == {9: 0, 10: 1}  # the lowest free slots first: live sequences stay consecutive


def test_dropped_positions_decode_again_to_the_same_logits(gguf_file: Path) -> None:
    ctx = runtime.Context(runtime.Model(gguf_file), n_ctx=64, n_seq_max=2, n_batch=8, threads=1)
    toks = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # wider than n_batch: two llama_decode calls
    first = ctx.decode(np.zeros(12), np.asarray(toks), np.arange(12), np.ones(12, np.int8))
    assert first.shape == (12, VOCAB)
    ctx.drop(0, 9)  # a rejected draft: positions 9.. go
    again = ctx.decode(np.zeros(3), np.asarray(toks[9:]), np.arange(9, 12), np.ones(3, np.int8))
    np.testing.assert_array_equal(again, first[9:])
    ctx.drop(0, 0)  # the sequence is gone; its slot serves a new one
    assert ctx.slots == {}


def _greedy_alone(model: runtime.Model, prompt: list[int], n: int) -> list[int]:
    ctx = runtime.Context(model, n_ctx=64, n_seq_max=1, n_batch=16, threads=1)
    lg = ctx.decode(np.zeros(len(prompt)), np.asarray(prompt), np.arange(len(prompt)), _want(len(prompt), [len(prompt) - 1]))
    out = []
    for p in range(len(prompt), len(prompt) + n):
        out.append(int(lg[-1].argmax()))
        lg = ctx.decode(np.zeros(1), np.asarray(out[-1:]), np.asarray([p]), np.ones(1, np.int8))
    return out


@pytest.mark.parametrize("unified", [True, False], ids=["one-cache", "cache-per-sequence"])
def test_a_greedy_run_gives_each_sequences_tokens_and_leaves_the_cache_as_steps_would(gguf_file: Path,
                                                                                     unified: bool) -> None:
    model = runtime.Model(gguf_file)
    prompts = {4: [3, 17, 42, 8, 9], 6: [50, 51], 5: [60, 2, 71]}
    want = {s: _greedy_alone(model, p, 8) for s, p in prompts.items()}
    stop = want[6][3]  # sequence 6 stops at its 4th token (or sooner, where that token comes earlier)
    dec = plugin.dspark_compile_decoder(_spec(gguf_file), _device())
    assert dec is not None
    kv = dec.allocate(192, 3) if unified else runtime.Context(model, n_ctx=192, n_seq_max=3, n_batch=16, threads=1,
                                                               unified=False)
    seqs = list(prompts)
    lg = np.asarray(dec.step(kv, SeqBatch(seq_ids=np.asarray([s for s in seqs for _ in prompts[s]]),
                                          input_ids=np.asarray([t for s in seqs for t in prompts[s]]),
                                          positions=np.asarray([i for s in seqs for i in range(len(prompts[s]))]),
                                          logit_rows=np.cumsum([len(prompts[s]) for s in seqs]) - 1)))
    first = [int(r.argmax()) for r in lg]
    limits = np.asarray([6, 8, 2])  # sequence 5 stops at its limit
    batch = SeqBatch(seq_ids=np.asarray(seqs), input_ids=np.asarray(first),
                     positions=np.asarray([len(prompts[s]) for s in seqs]), logit_rows=np.arange(3))
    out = dec.greedy_steps(kv, batch, limits, frozenset({stop}))
    assert out.shape == (3, 8) and out.dtype == np.int64
    got = {s: [int(t) for t in row if t >= 0] for s, row in zip(seqs, out)}
    cut6 = want[6][1:].index(stop) + 1  # its tokens after the first (the step's) up to the stop
    assert got[4] == want[4][1:7][: next((i + 1 for i, t in enumerate(want[4][1:7]) if t == stop), 6)]
    assert got[6] == want[6][1 : cut6 + 1]
    assert got[5] == want[5][1:3][: next((i + 1 for i, t in enumerate(want[5][1:3]) if t == stop), 2)]
    assert all((row[len(got[s]):] == -1).all() for s, row in zip(seqs, out))
    # The cache holds every token but the last of each run: the next step continues where single steps would.
    nxt = [got[s][-1] for s in seqs]
    pos = [len(prompts[s]) + len(got[s]) for s in seqs]
    lg = np.asarray(dec.step(kv, SeqBatch(seq_ids=np.asarray(seqs), input_ids=np.asarray(nxt),
                                          positions=np.asarray(pos), logit_rows=np.arange(3))))
    for s, row in zip(seqs, lg):
        assert int(row.argmax()) == want[s][len(got[s]) + 1]


def test_more_sequences_than_the_context_holds_is_an_error_not_a_crash(gguf_file: Path) -> None:
    ctx = runtime.Context(runtime.Model(gguf_file), n_ctx=64, n_seq_max=2, n_batch=8, threads=1)
    with pytest.raises(runtime.LlamaError, match="more than 2 live sequences"):
        ctx.decode(np.asarray([0, 1, 2]), np.asarray([1, 2, 3]), np.zeros(3), np.ones(3, np.int8))


def test_a_file_llamacpp_cannot_load_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(runtime.LlamaError, match="broken.gguf"):
        runtime.Model(bad)


def test_bids_on_a_gguf_file_as_stored_and_declines_ranges(gguf_file: Path) -> None:
    dev = _device()
    bid = plugin.dspark_decoder_bid(_spec(gguf_file), dev)
    assert bid is not None and bid.declined is None and bid.kv == "sequence"
    assert bid.note.startswith("GGUF as stored: F32") and bid.weight_bytes == gguf_file.stat().st_size
    part = plugin.dspark_decoder_bid(_spec(gguf_file, (0, 1)), dev)
    assert part is not None and part.declined and "whole models" in part.declined
    nothing = plugin.dspark_decoder_bid(_spec(gguf_file.parent / "missing"), dev)
    assert nothing is not None and nothing.declined and "config.json" in nothing.declined


def test_the_compiled_decoder_applies_drops_then_rows(gguf_file: Path) -> None:
    dec = plugin.dspark_compile_decoder(_spec(gguf_file), _device())
    assert dec is not None and dec.kv_mode == "sequence"
    kv = dec.allocate(128, 4)

    def step(seqs: list[int], toks: list[int], pos: list[int], rows: list[int],
             drops: list[tuple[int, int]] | None = None) -> np.ndarray:
        return np.asarray(dec.step(kv, SeqBatch(seq_ids=np.asarray(seqs), input_ids=np.asarray(toks),
                                                positions=np.asarray(pos), logit_rows=np.asarray(rows),
                                                drops=drops or [])))

    out = step([7, 7, 7, 9], [1, 2, 3, 4], [0, 1, 2, 0], [2, 3])
    assert out.shape == (2, VOCAB)
    again = step([7], [3], [2], [0], drops=[(7, 2), (9, 0)])  # roll 7 back one position; 9 is gone
    np.testing.assert_allclose(again[0], out[0], atol=1e-4)  # a 1-row step rounds unlike a 4-row one
    assert set(kv.slots) == {7}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_engine_holds_k_and_v_in_half_precision(gguf_file: Path, dtype: str) -> None:
    # A half-precision engine's cache takes half a float32 one's bytes (float16, llama.cpp's own default): the
    # bid says so, and a sequence's state (its K and V cells, as llama.cpp saves them) is half as large.
    dev = _device()
    sizes = {}
    for dt in ("float32", dtype):
        bid = plugin.dspark_decoder_bid(_spec(gguf_file, dtype=dt), dev)
        assert bid is not None and bid.kv_dtype == ("float32" if dt == "float32" else "float16")
        dec = plugin.dspark_compile_decoder(_spec(gguf_file, dtype=dt), dev)
        assert dec is not None and dec.kv_bytes_per_token == bid.kv_bytes_per_token
        kv = dec.allocate(128, 1)
        assert kv.kv_dtype == bid.kv_dtype
        toks = list(range(3, 43))
        logits = dec.step(kv, SeqBatch(seq_ids=np.zeros(40, np.int64), input_ids=np.asarray(toks),
                                       positions=np.arange(40), logit_rows=np.asarray([39]), drops=[]))
        assert np.isfinite(logits).all()
        sizes[dt] = (bid.kv_bytes_per_token, runtime.C.llama_state_seq_get_size(kv.ptr, kv.slot(0)))
    assert sizes[dtype][0] * 2 == sizes["float32"][0]
    kv_f32 = 40 * sizes["float32"][0]  # the K and V bytes of 40 tokens at float32
    assert sizes["float32"][1] - sizes[dtype][1] == pytest.approx(kv_f32 / 2, rel=0.05), sizes


def test_an_unknown_kv_dtype_is_an_error_that_names_it(gguf_file: Path) -> None:
    with pytest.raises(ValueError, match="'int4'"):
        runtime.Context(runtime.Model(gguf_file), n_ctx=64, n_seq_max=1, n_batch=16, threads=1, kv_dtype="int4")


def test_many_sequences_get_a_cache_each_within_the_budget(gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One shared cache makes every row attend over every sequence's cells: a cache per sequence is taken
    # while it costs at most KV_SPLIT_BUDGET times the engine's budget, and forced either way by the setting.
    dec = plugin.dspark_compile_decoder(_spec(gguf_file), _device())
    assert dec is not None
    monkeypatch.delenv("DSPARK_LLAMACPP_KV", raising=False)
    assert dec.allocate(1024, 8).n_ctx >= 8 * 256  # 8 x min(256 positions, 1024) fits 4 x 1024
    big = dec.allocate(256, 32)  # 32 x 256 > 4 x 256: one shared cache
    assert big.n_ctx == 256
    monkeypatch.setenv("DSPARK_LLAMACPP_KV", "split")
    assert dec.allocate(256, 32).n_ctx == 32 * 256


def test_a_cache_per_sequence_is_taken_only_where_the_memory_is_there() -> None:
    # The 0.5B file (20 layers, 4 KV heads of 128: 80 KiB of float32 K/V a token) at 32 sequences of 1,024 tokens
    # against an engine budget of 8,192 tokens: a cache per sequence is 2.5 GiB, four times the budget.
    per_token = 2 * 20 * 4 * 128 * 4
    assert plugin.split_fits(32 * 1024, 8192, per_token, 23 << 30)  # a 23 GB machine: the faster layout
    assert not plugin.split_fits(32 * 1024, 8192, per_token, 4 << 30)  # a 4 GB box: the budget's shared cache
    assert not plugin.split_fits(32 * 4096, 8192, per_token, 1 << 40)  # 16x the budget: never


def test_cancel_from_another_thread_stops_a_decode_and_the_context_goes_on(gguf_file: Path) -> None:
    # The engine's watchdog calls cancel() (API 1.11) from its own thread while a step runs on the engine's.
    import threading
    import time

    model = runtime.Model(gguf_file)
    ctx = runtime.Context(model, n_ctx=256, n_seq_max=1, n_batch=256, threads=1)
    toks = np.arange(200) % VOCAB
    errors: list[BaseException] = []
    stop = threading.Event()

    def decode_until_cancelled() -> None:
        while not stop.is_set():
            try:
                ctx.decode(np.zeros(200), toks, np.arange(200), _want(200, [199]))
            except runtime.LlamaError as exc:
                errors.append(exc)
                return
            finally:
                ctx.drop(0, 0)

    t = threading.Thread(target=decode_until_cancelled)
    t.start()
    deadline = time.monotonic() + 60
    while t.is_alive():
        assert time.monotonic() < deadline, "no decode was cancelled"
        ctx.cancel()
    stop.set()
    t.join(10)
    assert errors and "cancelled" in str(errors[0]), errors
    out = ctx.decode(np.zeros(5), toks[:5], np.arange(5), _want(5, [4]))  # the next step runs as usual
    fresh = runtime.Context(model, n_ctx=64, n_seq_max=1, n_batch=16, threads=1)
    np.testing.assert_allclose(out, fresh.decode(np.zeros(5), toks[:5], np.arange(5), _want(5, [4])), atol=1e-5)


def _first_logits(path: Path) -> tuple[np.ndarray, bool, int]:
    """A prompt's last logits, whether the weights were repacked, and the file's bytes left in memory."""
    model = runtime.Model(path)
    ctx = runtime.Context(model, n_ctx=64, n_seq_max=1, n_batch=16, threads=1)
    logits = ctx.decode(np.zeros(5, np.int32), np.arange(3, 8, dtype=np.int32), np.arange(5, dtype=np.int32),
                        _want(5, [4]))
    out = (np.array(logits[-1]), model.repacked, resident_file(path))
    ctx.close()
    model.close()
    return out


def test_repacked_weights_leave_the_files_pages_they_came_from(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Q4_0 rows of 256 are what llama.cpp repacks for its x86 kernels (8x8 tiles): once repacked, the file's
    # pages of those tensors are never read again, so they leave memory; the rest come back as read.
    if amx.has_amx() and not amx.runs():
        pytest.skip("this llama.cpp's AMX kernels fault (amx.probe): scripts/setup.sh builds it with the fix")
    q = tmp_path / "small-q4_0.gguf"
    runtime.quantize(_tiny_gguf(tmp_path / "small-f32.gguf", hidden=256, ff=1024, vocab=512), q, "Q4_0")
    monkeypatch.setenv("DSPARK_LLAMACPP_EXTRA_BUFTS", "0")
    stored, repacked, held_stored = _first_logits(q)
    assert not repacked and held_stored > 0.9 * q.stat().st_size  # run from the file's pages: all read
    monkeypatch.setenv("DSPARK_LLAMACPP_EXTRA_BUFTS", "1")
    got, repacked, held = _first_logits(q)
    assert repacked and held < 0.6 * q.stat().st_size, (held, q.stat().st_size)
    assert int(got.argmax()) == int(stored.argmax()) and np.allclose(got, stored, atol=1e-2)


def _bf16_steps(path: Path, prompt: int = 70, kv: str = "float16",
                flash: bool = True) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """A ``prompt``-token prompt's logits, and steps of 1, 2, 3, 5 and 9 rows after it, each with the same rows
    decoded one at a time (the step rolled back in between): (prompt, [(rows, rows alone), ...]). K and V in
    ``kv``, with flash attention where the plugin runs it (f16, as it holds a bfloat16 engine's) unless
    ``flash`` is off."""
    toks = np.random.default_rng(1).integers(3, VOCAB, prompt + 9).astype(np.int32)
    model = runtime.Model(path)
    ctx = runtime.Context(model, n_ctx=256 if prompt + 9 <= 256 else 512, n_seq_max=1, n_batch=128, threads=2,
                          kv_dtype=kv, flash_attn=flash and plugin.flash_attn(kv))
    first = ctx.decode(np.zeros(prompt, np.int32), toks[:prompt], np.arange(prompt, dtype=np.int32),
                       np.ones(prompt, np.int8))
    out = []
    for n in (1, 2, 3, 5, 9):
        pos = np.arange(prompt, prompt + n, dtype=np.int32)
        rows = ctx.decode(np.zeros(n, np.int32), toks[prompt:prompt + n], pos, np.ones(n, np.int8))
        ctx.drop(0, prompt)
        alone = np.concatenate([ctx.decode(np.zeros(1, np.int32), toks[p:p + 1], pos[i:i + 1], np.ones(1, np.int8))
                                for i, p in enumerate(range(prompt, prompt + n))])
        ctx.drop(0, prompt)
        out.append((rows, alone))
    ctx.close()
    model.close()
    return first, out


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Matrices of 32, 64, 96 and 192 rows (2 to 12 blocks of 16) over rows of 64 and 192: the packed kernels'
    # tiles of 4 blocks and of 1, split over two threads; 70 prompt rows: two blocks of activation rows, tiles of
    # 4, 2 and 1 of them. Heads of 16: flash attention's per-row kernel.
    return tiny.write(tmp_path_factory.mktemp("bf16") / "tiny-bf16.gguf", hidden=64, ff=192, vocab=VOCAB,
                      layers=LAYERS, heads=4, kv_heads=2, qtype="BF16", embd_qtype="BF16")


@pytest.fixture(scope="module")
def bf16_heads64_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Heads of 64, two query heads to a KV head: the project's build runs steps of fewer than 64 rows through
    # flash attention's grouped kernel (scripts/patches/llama-cpp-python-0.3.36/5-flash-attn-grouped-rows.patch)
    # where it targets AVX-512.
    return tiny.write(tmp_path_factory.mktemp("bf16h64") / "tiny-bf16-h64.gguf", hidden=128, ff=192, vocab=VOCAB,
                      layers=LAYERS, heads=2, kv_heads=1, qtype="BF16", embd_qtype="BF16")


def test_bf16_matrices_repacked_give_the_logits_of_the_weights_as_stored(bf16_file: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_LLAMACPP_EXTRA_BUFTS", "0")
    prompt, steps = _bf16_steps(bf16_file)
    stored = [prompt, *(rows for rows, _ in steps)]
    monkeypatch.setenv("DSPARK_LLAMACPP_EXTRA_BUFTS", "1")
    prompt, steps = _bf16_steps(bf16_file)
    packed = [prompt, *(rows for rows, _ in steps)]
    assert len(stored) == len(packed) == 6
    for a, b in zip(stored, packed):
        # Sums in another order round to another bfloat16 now and then on the way: close, not equal.
        np.testing.assert_allclose(b, a, atol=0.05)
        assert (b.argmax(1) == a.argmax(1)).all()


@pytest.mark.parametrize("heads", ["heads-16", "heads-64"])
@pytest.mark.parametrize("prompt", [70, 300], ids=["under-256-cells", "over-256-cells"])
def test_a_rows_logits_do_not_depend_on_how_many_rows_its_step_holds_once_bf16_is_packed(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, prompt: int, heads: str) -> None:
    # The project's build packs BF16 matrices for outer products where it targets AVX512-BF16
    # (scripts/patches/llama-cpp-python-0.3.36/3-bf16-packed-matmul.patch), runs a lone row's flash attention
    # through the per-row kernel past 256 cells too (4-flash-attn-row-order.patch), and a few rows' over heads of
    # 64 through the grouped kernel (5-flash-attn-grouped-rows.patch): each output is summed in one order
    # whatever the step's rows, so a verified draft's logits are those of its token decoded alone. The kernels
    # as shipped sum one row and several differently.
    if "AVX512_BF16 = 1" not in runtime.system_info():
        pytest.skip("this CPU (or this build) has no AVX512-BF16: BF16 matrices run as stored")
    path = request.getfixturevalue("bf16_file" if heads == "heads-16" else "bf16_heads64_file")
    monkeypatch.setenv("DSPARK_LLAMACPP_EXTRA_BUFTS", "1")
    _, steps = _bf16_steps(path, prompt)
    for rows, alone in steps:
        np.testing.assert_array_equal(rows, alone)


@pytest.mark.parametrize("heads", ["heads-16", "heads-64"])
def test_flash_attention_comes_as_close_to_f32_attention_as_plain_attention(request: pytest.FixtureRequest,
                                                                            heads: str) -> None:
    # Flash attention over f16 K and V (the per-row kernel over heads of 16, the grouped one over heads of 64
    # where the build targets AVX-512) and llama.cpp's attention as separate products and a softmax over the
    # same f16 K and V, each against the latter over f32 K and V: the prompt's rows (two chunks of 128 through
    # the tiled kernel, the last 44 through the few-row one) and every step's. The f16 roundings put both off
    # the f32 logits by about 1e-2 on average; a kernel that dropped or double-counted cells would be far off.
    path = request.getfixturevalue("bf16_file" if heads == "heads-16" else "bf16_heads64_file")

    def parts(kv: str, flash: bool) -> list[np.ndarray]:
        prompt, steps = _bf16_steps(path, 300, kv, flash)
        return [prompt, *(rows for rows, _ in steps)]

    f32 = parts("float32", False)
    for flash, plain, ref in zip(parts("float16", True), parts("float16", False), f32):
        err_flash, err_plain = float(np.abs(flash - ref).mean()), float(np.abs(plain - ref).mean())
        assert err_flash <= 2 * err_plain, (err_flash, err_plain)


def test_extra_buffer_types_follow_the_cpu_the_amx_probe_and_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSPARK_LLAMACPP_EXTRA_BUFTS", raising=False)
    facts = {"isa_features": ["avx2", "avx512f"]}
    monkeypatch.setattr(amx.hostinfo, "cpu_static", lambda: facts)
    assert runtime.extra_bufts() and runtime.extra_bufts(runtime.REPACK_MAX_SEQS)
    assert not runtime.extra_bufts(32)  # without AMX, steps of many rows ran slower repacked
    facts["isa_features"] = ["avx512f", "amx_tile", "amx_int8"]
    verdict = {"runs": True}
    monkeypatch.setattr(amx, "runs", lambda: verdict["runs"])
    assert runtime.extra_bufts() and runtime.extra_bufts(32)  # AMX's kernels ran faster at every size
    verdict["runs"] = False  # this library's AMX kernels faulted in the probe
    assert not runtime.extra_bufts() and not runtime.extra_bufts(32)
    monkeypatch.setenv("DSPARK_LLAMACPP_EXTRA_BUFTS", "1")
    assert runtime.extra_bufts() and runtime.extra_bufts(32)
    monkeypatch.setenv("DSPARK_LLAMACPP_EXTRA_BUFTS", "0")
    facts["isa_features"] = ["avx2"]
    assert not runtime.extra_bufts()


def test_the_amx_probe_runs_a_multi_row_step_in_a_child_and_caches_its_verdict(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Where the CPU has no AMX the library has no AMX buffer type, and the same step runs on the other kernels:
    # either way the child must load the Q8_0 file with the extra buffer types and decode, before and after a
    # torch bfloat16 matmul on its thread (oneDNN's AMX tiles: a build that configures its tiles once per
    # thread dies there of SIGILL, one built by scripts/setup.sh gives the same logits).
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    ok, why = amx.probe()
    assert ok, why
    monkeypatch.setattr(amx, "has_amx", lambda: True)
    monkeypatch.setattr(amx, "_known", {})
    assert amx.runs()
    stored = amx.cache.load(amx.NAMESPACE, amx.library_key())
    assert stored["runs"] is True and "32 rows" in stored["detail"] and "torch bfloat16" in stored["detail"]


def test_a_probe_that_faults_keeps_the_extra_buffer_types_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A child killed by SIGSEGV is what a library without the tile-configuration fix does on an AMX CPU.
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DSPARK_LLAMACPP_EXTRA_BUFTS", raising=False)
    monkeypatch.setattr(amx, "has_amx", lambda: True)
    monkeypatch.setattr(amx, "_known", {})
    monkeypatch.setattr(amx, "_child_command", lambda path: [
        sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    assert not runtime.extra_bufts()
    stored = amx.cache.load(amx.NAMESPACE, amx.library_key())
    assert stored == {"runs": False, "detail": "the probe's step was killed by SIGSEGV"}
    monkeypatch.setattr(amx, "_known", {})
    monkeypatch.setattr(amx, "probe", lambda: pytest.fail("a cached verdict is not probed again"))
    assert not amx.runs()
