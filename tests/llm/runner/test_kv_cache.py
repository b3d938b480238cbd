"""Page allocator, block tables, rollback and accounting."""

from __future__ import annotations

import pytest
import torch

from dspark.llm.runner.kv_cache import OutOfPages, PageAllocator, PagedKVCache


def _cache(pages: int = 8, page: int = 4) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_pages=pages, page_size=page, kv_heads=2, head_dim=8)


def test_allocator_free_list_reuses_pages() -> None:
    a = PageAllocator(3)
    p = [a.allocate() for _ in range(3)]
    with pytest.raises(OutOfPages):
        a.allocate()
    a.free([p[1]])
    assert a.allocate() == p[1]
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([p[1], p[1]])


def test_block_table_slots_and_storage_shape() -> None:
    c = _cache()
    assert c.k[0].shape == (8, 4, 2, 8)
    c.reserve("a", 6)
    c.reserve("b", 1)
    c.reserve("a", 9)  # grows by one page
    ta = c.block_tables["a"]
    assert len(ta) == 3 and len(c.block_tables["b"]) == 1
    slots = c.slots("a", 3, 6)
    assert slots.tolist() == [ta[0] * 4 + 3, ta[1] * 4, ta[1] * 4 + 1]
    with pytest.raises(OutOfPages):
        c.reserve("c", 100)
    assert "c" not in c.block_tables or not c.block_tables["c"]
    c.free("a"), c.free("b"), c.free("c")
    assert c.all_free()


def test_truncate_frees_empty_pages() -> None:
    c = _cache()
    c.reserve("a", 10)
    c.set_len("a", 10)
    c.truncate("a", 5)  # 5 tokens left -> 2 pages
    assert c.seq_lens["a"] == 5 and len(c.block_tables["a"]) == 2
    assert c.allocator.num_free == 6
    with pytest.raises(ValueError):
        c.truncate("a", 6)
    c.free("a")
    assert c.all_free()


def test_accounting() -> None:
    c = _cache(pages=8, page=4)
    c.reserve("a", 5)
    c.set_len("a", 5)
    s = c.stats()
    per_page = 2 * 2 * 4 * 2 * 8 * 4  # K and V, layers, slots, heads, dim, fp32 bytes
    assert (s.used_pages, s.free_pages, s.total_pages) == (2, 6, 8)
    assert s.used_bytes == 2 * per_page and s.total_bytes == 8 * per_page
    assert s.fragmentation == pytest.approx(3 / 8)
    c.free("a")
    assert c.stats().fragmentation == 0.0 and c.all_free()


def test_dtype_follows_model() -> None:
    c = PagedKVCache(num_layers=1, num_pages=2, page_size=2, kv_heads=1, head_dim=4, dtype=torch.bfloat16)
    assert c.v[0].dtype == torch.bfloat16
