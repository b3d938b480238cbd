"""The runner's CPU fast paths against its plain torch path: the paged C attention kernel
(dspark.llm.runner.paged_attention) and the oneDNN-packed projections (dspark.llm.runner.packed_linear)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from llm_testutil import random_prompts

from dspark.llm.runner import paged_attention
from dspark.llm.runner.model import ModelRunner, SeqChunk
from dspark.llm.runner.packed_linear import pack_runner, unavailable_reason

GREEDY_KW = dict(max_tokens=12, temperature=0.0, ignore_eos=True)


def _kernel_or_skip() -> Any:
    k = paged_attention.kernel()
    if k is None:
        pytest.skip("the paged attention kernel does not build here (no C compiler?); the torch path runs")
    return k


def _steps(runner: ModelRunner, cache: Any) -> list[list[torch.Tensor]]:
    """A prefill, a mixed step (decode rows, a 5-token verification chunk, a long chunk), then decode."""
    p = random_prompts(4, seed=3, lo=20, hi=70)
    mixes = [
        [SeqChunk("a", p[0]), SeqChunk("b", p[1][:3])],  # a long prompt (SDPA) and a short one (kernel)
        [SeqChunk("a", [5]), SeqChunk("b", p[1][3:]), SeqChunk("c", p[2])],
        [SeqChunk("a", [6, 7, 8, 9, 10], all_logits=True), SeqChunk("b", [11]), SeqChunk("c", [12]),
         SeqChunk("d", p[3][:16], all_logits=True)],  # verification-like chunks, one exactly 16 long
        [SeqChunk(s, [13]) for s in "abcd"],
    ]
    return [runner.step(cache, m) for m in mixes]


@pytest.mark.parametrize("variant", ["llama", "llama_tied_mha", "qwen2"])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_kernel_matches_gather_and_sdpa(checkpoint: Callable[[str], Path], variant: str,
                                              threads: int) -> None:
    """GQA (2 and 4 query heads per KV head) and MHA; page size 4 so rows span several pages, some partial."""
    _kernel_or_skip()
    torch.set_num_threads(threads)
    fast = ModelRunner.from_pretrained(str(checkpoint(variant)), "float32")
    ref = ModelRunner.from_pretrained(str(checkpoint(variant)), "float32")
    ref.attention = "torch"
    c1, c2 = fast.make_cache(64, 4), ref.make_cache(64, 4)
    assert fast._kernel(c1) is not None and ref._kernel(c2) is None
    for got, want in zip(_steps(fast, c1), _steps(ref, c2), strict=True):
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    assert c1.seq_lens == c2.seq_lens and c1.block_tables == c2.block_tables


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(6, 2, 64), (4, 4, 24), (16, 1, 8)])
def test_paged_kernel_tiles_chunks_and_matches_sdpa_row_by_row(threads: int, heads: int, kv_heads: int,
                                                                head_dim: int) -> None:
    """Chunks of 1-64 rows (a chunk is tiled by up to 64 query vectors, and split further while
    there are fewer work items than threads), pages of 16 and 5 slots in random order, partial
    last pages, a row another path runs (length 0): each row against SDPA over its own keys."""
    k = _kernel_or_skip()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(heads * 100 + threads)
    # (cached tokens before the chunk, chunk rows) per sequence
    seqs = [(37, 1), (0, 9), (150, 33), (3, 64), (60, 5)]
    for P in (16, 5):
        n_pages = sum(-(-(s + n) // P) for s, n in seqs) + 3
        kc = torch.randn(n_pages, P, kv_heads, head_dim, generator=g)
        vc = torch.randn(n_pages, P, kv_heads, head_dim, generator=g)
        width = max(-(-(s + n) // P) for s, n in seqs)
        perm = torch.randperm(n_pages, generator=g)
        tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        o = 0
        for i, (s, n) in enumerate(seqs):
            need = -(-(s + n) // P)
            tables[i, :need] = perm[o:o + need].to(torch.int32)
            o += need
        row_seq = [i for i, (_, n) in enumerate(seqs) for _ in range(n)]
        row_len = [s + j + 1 for s, n in seqs for j in range(n)]
        row_len[10] = 0  # a row the kernel leaves alone
        T = len(row_seq)
        q = torch.randn(T, heads, head_dim, generator=g)
        out = torch.full((T, heads, head_dim), 7.0)
        k(q, out, kc, vc, tables, torch.tensor(row_seq, dtype=torch.int32), torch.tensor(row_len, dtype=torch.int32),
          head_dim ** -0.5)
        assert torch.equal(out[10], torch.full((heads, head_dim), 7.0))
        for t in range(T):
            n = row_len[t]
            if n == 0:
                continue
            slots = (tables[row_seq[t]].long()[:, None] * P + torch.arange(P)).reshape(-1)[:n]
            kk = kc.view(-1, kv_heads, head_dim)[slots].transpose(0, 1)
            vv = vc.view(-1, kv_heads, head_dim)[slots].transpose(0, 1)
            ref = F.scaled_dot_product_attention(q[t][:, None], kk, vv, enable_gqa=heads != kv_heads)[:, 0]
            torch.testing.assert_close(out[t], ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window", "softcap"),
                         [(8, 2, 256, 7, None), (4, 4, 24, 20, 3.0), (6, 2, 64, 1, None), (6, 3, 16, None, 0.5)])
def test_paged_kernel_windows_and_softcaps_match_plain_attention(threads: int, heads: int, kv_heads: int,
                                                                 head_dim: int, window: int | None,
                                                                 softcap: float | None) -> None:
    """Sliding windows (a row sees its last ``window`` positions; tiles of rows whose windows start at
    different blocks) and tanh soft-capping, against plain attention row by row."""
    k = _kernel_or_skip()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(head_dim + threads)
    seqs = [(37, 1), (0, 9), (150, 33), (3, 64), (60, 5)]
    P = 5
    n_pages = sum(-(-(s + n) // P) for s, n in seqs)
    kc = torch.randn(n_pages, P, kv_heads, head_dim, generator=g)
    vc = torch.randn(n_pages, P, kv_heads, head_dim, generator=g)
    width = max(-(-(s + n) // P) for s, n in seqs)
    perm = torch.randperm(n_pages, generator=g).to(torch.int32)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    o = 0
    for i, (s, n) in enumerate(seqs):
        need = -(-(s + n) // P)
        tables[i, :need] = perm[o:o + need]
        o += need
    row_seq = [i for i, (_, n) in enumerate(seqs) for _ in range(n)]
    row_len = [s + j + 1 for s, n in seqs for j in range(n)]
    q = torch.randn(len(row_seq), heads, head_dim, generator=g)
    out = torch.zeros_like(q)
    k(q, out, kc, vc, tables, torch.tensor(row_seq, dtype=torch.int32), torch.tensor(row_len, dtype=torch.int32),
      head_dim ** -0.5, window, softcap)
    for t, n in enumerate(row_len):
        lo = max(0, n - window) if window else 0
        slots = (tables[row_seq[t]].long()[:, None] * P + torch.arange(P)).reshape(-1)[lo:n]
        kk = kc.view(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
        vv = vc.view(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
        sc = torch.einsum("hd,nhd->hn", q[t], kk) * head_dim ** -0.5
        if softcap:
            sc = softcap * torch.tanh(sc / softcap)
        ref = torch.einsum("hn,nhd->hd", sc.softmax(-1), vv)
        torch.testing.assert_close(out[t], ref, rtol=1e-5, atol=2e-5)


def test_paged_kernel_refuses_what_it_cannot_run(checkpoint: Callable[[str], Path]) -> None:
    k = _kernel_or_skip()
    assert not k.supports(heads=4, kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    assert not k.supports(heads=4, kv_heads=2, head_dim=512, page_size=16, dtype=torch.float32)
    assert not k.supports(heads=4, kv_heads=2, head_dim=20, page_size=16, dtype=torch.float32)  # 8-float vectors
    assert not k.supports(heads=4, kv_heads=2, head_dim=64, page_size=4096, dtype=torch.float32)
    r = ModelRunner.from_pretrained(str(checkpoint("llama")), "bfloat16")
    assert r._kernel(r.make_cache(8, 4)) is None  # bf16 runs the torch path
    q = torch.zeros(1, 4, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="wrong layout or dtype"):
        k(q, torch.zeros(1, 4, 16), torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16),
          torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
          0.25)


def test_paged_kernel_build_failure_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    """A broken compiler is reported (named) and the runner keeps its torch path; so does the off switch."""
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    paged_attention.kernel.cache_clear()
    try:
        assert paged_attention.kernel() is None
        err = capfd.readouterr().err
        assert "no-such-cc" in err and "llm.paged_attention" in err
        paged_attention.kernel.cache_clear()
        monkeypatch.setenv("DSPARK_PAGED_ATTENTION", "0")
        assert paged_attention.kernel() is None
        assert not list(tmp_path.rglob("*.so"))
    finally:
        paged_attention.kernel.cache_clear()


def test_paged_kernel_builds_into_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _kernel_or_skip()
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    paged_attention.kernel.cache_clear()
    try:
        assert paged_attention.kernel() is not None
        built = list((tmp_path / "kernels").glob("paged_attention-*.so"))
        assert len(built) == 1 and not list((tmp_path / "kernels").glob(".build-*"))
    finally:
        paged_attention.kernel.cache_clear()


# -- packed projections ------------------------------------------------------------------------


def _packable_or_skip() -> None:
    why = unavailable_reason()
    if why is not None:
        pytest.skip(f"oneDNN packing unavailable: {why}")


def test_packed_projections_match_plain(checkpoint: Callable[[str], Path]) -> None:
    _packable_or_skip()
    fast = ModelRunner.from_pretrained(str(checkpoint("llama")), "float32")
    ref = ModelRunner.from_pretrained(str(checkpoint("llama")), "float32")
    assert pack_runner(fast, "on").startswith("packed 9 projections")  # 2 layers x 4, and the head
    assert all(L.p_qkv is not None and L.p_down is not None for L in fast.layers) and fast.p_head is not None
    c1, c2 = fast.make_cache(64, 4), ref.make_cache(64, 4)
    for got, want in zip(_steps(fast, c1), _steps(ref, c2), strict=True):
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    assert fast.weight_bytes() == ref.weight_bytes()  # the packed copies are a cache, not model weights
    # What DeepSpec prices a verification's rows at: packed steps of several rows run padded to a bucket.
    assert [fast.padded_rows(n) for n in (1, 8, 9, 17, 32, 33)] == [1, 8, 10, 20, 32, 40]
    assert [ref.padded_rows(n) for n in (1, 9, 33)] == [1, 9, 33]


def test_packed_engine_greedy_equals_unpacked(make_llm: Callable[..., Any]) -> None:
    _packable_or_skip()
    from dspark.llm import SamplingParams

    prompts = random_prompts(6, seed=5, lo=3, hi=40)
    on, off = make_llm(packed_linear="on"), make_llm(packed_linear="off")
    assert on.engine.packed_linear.startswith("packed") and off.engine.packed_linear == "off"
    sp = SamplingParams(**GREEDY_KW)
    assert [o.token_ids for o in on.generate(prompts, sp)] == [o.token_ids for o in off.generate(prompts, sp)]


def test_packing_is_refused_or_skipped_with_a_reason(checkpoint: Callable[[str], Path],
                                                     make_llm: Callable[..., Any]) -> None:
    _packable_or_skip()
    bf16 = ModelRunner.from_pretrained(str(checkpoint("llama")), "bfloat16")
    with pytest.raises(ValueError, match="packed_linear='on'.*bfloat16"):
        pack_runner(bf16, "on")
    assert pack_runner(bf16, "auto").startswith("not packed: the model runs in torch.bfloat16")
    r = ModelRunner.from_pretrained(str(checkpoint("llama")), "float32")
    assert "over 25% of the 0 MiB available" in pack_runner(r, "auto", available_bytes=1000)
    assert all(L.p_qkv is None for L in r.layers)
    assert pack_runner(r, "off") == "off"
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="packed_linear"):
        make_llm(packed_linear="sometimes")


def test_quantized_projections_keep_their_kernel_and_lose_their_copy(checkpoint: Callable[[str], Path]) -> None:
    _packable_or_skip()
    r = ModelRunner.from_pretrained(str(checkpoint("llama")), "float32")
    name = r.linear_names()[0]
    w = r.weight_t(name).clone()
    pack_runner(r, "on")
    assert r.layers[0].p_qkv is not None
    r.set_linear(name, lambda x: x @ w, drop_float=True)
    assert r.layers[0].p_qkv is None  # freed with the float weight
    assert len(r.float_projections()) == len(r.linear_names()) - 1


def test_row_buckets_bound_padding_and_shapes() -> None:
    """Rows are padded to few shapes (oneDNN compiles one primitive per shape), never by more than 25%."""
    from dspark.llm.runner.packed_linear import row_bucket

    assert [row_bucket(m) for m in range(1, 10)] == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert all(m <= row_bucket(m) <= 1.25 * m for m in range(1, 5000))
    assert len({row_bucket(m) for m in range(2, 513)}) == 31
