"""Paged KV cache: fixed-size pages, a free list, and a block table per sequence.

Sequences never own contiguous memory, so a finished sequence's pages are
reusable at once by any other and waste is bounded by one partial page per
sequence (vLLM's PagedAttention layout, without the custom kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class OutOfPages(RuntimeError):
    """Raised when a sequence needs more pages than are free; the scheduler preempts on it."""


class PageAllocator:
    """A LIFO free list of page ids: recently freed pages are reused first (warm in cache)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfPages("no free KV pages")
        page = self._free.pop()
        self._used.add(page)
        return page

    def free(self, pages: list[int]) -> None:
        for p in reversed(pages):
            if p not in self._used:
                raise RuntimeError(f"page {p} freed twice or never allocated")
            self._used.remove(p)
            self._free.append(p)


@dataclass(frozen=True)
class KVStats:
    page_size: int
    total_pages: int
    free_pages: int
    used_pages: int
    used_bytes: int
    total_bytes: int
    used_slots: int
    allocated_slots: int
    fragmentation: float  # wasted slots in allocated pages / allocated slots


class PagedKVCache:
    """Per layer K and V stores of shape [num_pages, page_size, kv_heads, head_dim]."""

    def __init__(
        self, *, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_tables: dict[str, list[int]] = {}
        self.seq_lens: dict[str, int] = {}
        # For LongRoPE models (rope.py), kept by the runner: the sequences whose cache holds the long factors'
        # keys, and every sequence's tokens, to recompute its cache when it crosses the switch.
        self.long_rope: set[str] = set()
        self.tokens: dict[str, list[int]] = {}
        # Where the K/V memory is when a compiled decoder owns it (dspark.llm.decoding.runner): that target's
        # label and what its ``allocate`` returned; then ``k``/``v`` are meta tensors. None: ``k``/``v`` hold it.
        self.device_kv: tuple[str, Any] | None = None
        self._bytes_per_page = 2 * num_layers * page_size * kv_heads * head_dim * self.k[0].element_size()

    # -- sequence lifecycle -------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_grow(self, seq_id: str, new_len: int) -> bool:
        have = len(self.block_tables.get(seq_id, ()))
        return self.pages_for(new_len) - have <= self.allocator.num_free

    def reserve(self, seq_id: str, new_len: int) -> None:
        """Make room for ``new_len`` tokens; all-or-nothing so a failed step leaks nothing."""
        table = self.block_tables.setdefault(seq_id, [])
        self.seq_lens.setdefault(seq_id, 0)
        need = self.pages_for(new_len) - len(table)
        if need > self.allocator.num_free:
            raise OutOfPages(f"sequence {seq_id} needs {need} more pages, {self.allocator.num_free} free")
        for _ in range(need):
            table.append(self.allocator.allocate())

    def slots(self, seq_id: str, start: int, end: int) -> torch.Tensor:
        """Flat slot indices (page * page_size + offset) of positions [start, end)."""
        table = torch.tensor(self.block_tables[seq_id], dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    def set_len(self, seq_id: str, new_len: int) -> None:
        self.seq_lens[seq_id] = new_len
        if seq_id in self.tokens:
            del self.tokens[seq_id][new_len:]

    def truncate(self, seq_id: str, n: int) -> None:
        """Drop the last ``n`` tokens (speculative rollback); pages left empty go back at once."""
        cur = self.seq_lens[seq_id]
        if not 0 <= n <= cur:
            raise ValueError(f"cannot roll back {n} tokens of sequence {seq_id} with {cur}")
        self.seq_lens[seq_id] = cur - n
        if seq_id in self.tokens:
            del self.tokens[seq_id][cur - n :]
        table = self.block_tables[seq_id]
        keep = self.pages_for(cur - n)
        if keep < len(table):
            self.allocator.free(table[keep:])
            del table[keep:]

    def free(self, seq_id: str) -> None:
        table = self.block_tables.pop(seq_id, None)
        self.seq_lens.pop(seq_id, None)
        self.long_rope.discard(seq_id)
        self.tokens.pop(seq_id, None)
        if table:
            self.allocator.free(table)

    # -- accounting ---------------------------------------------------------
    def all_free(self) -> bool:
        return self.allocator.num_free == self.allocator.num_pages and not self.block_tables

    def stats(self) -> KVStats:
        total = self.allocator.num_pages
        free = self.allocator.num_free
        used = total - free
        alloc_slots = used * self.page_size
        used_slots = sum(self.seq_lens.values())
        frag = (alloc_slots - used_slots) / alloc_slots if alloc_slots else 0.0
        return KVStats(
            page_size=self.page_size, total_pages=total, free_pages=free, used_pages=used,
            used_bytes=used * self._bytes_per_page, total_bytes=total * self._bytes_per_page,
            used_slots=used_slots, allocated_slots=alloc_slots, fragmentation=frag,
        )
