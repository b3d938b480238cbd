"""dspark.sdk.mapped: weights copied once into the disk cache, handed back as views of its mapping, whose
pages can be dropped and come back from the file."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dspark.host import cache
from dspark.sdk import mapped


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    if not mapped.usable():
        pytest.skip(f"mapped weights save nothing here (not Linux, or {tmp_path} is in memory)")
    return tmp_path


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((256, 384), dtype=np.float32).astype(ml_dtypes.bfloat16),
            rng.standard_normal((1000,), dtype=np.float32),
            rng.standard_normal((384, 96), dtype=np.float32).astype(np.float16).T]  # not C-contiguous


def test_arrays_are_written_once_and_mapped_again_by_a_later_start() -> None:
    key = {"model": "m", "layers": [0, 2]}
    first = mapped.MappedWeights(key)
    views = [first.add(a) for a in _arrays()]
    first.close()
    assert first.written == first.nbytes == sum(a.nbytes for a in _arrays())
    for v, a in zip(views, _arrays(), strict=True):
        assert v.dtype == a.dtype and v.shape == a.shape and not v.flags.writeable
        assert np.array_equal(np.asarray(v, np.float32), np.asarray(a, np.float32))
    again = mapped.MappedWeights(key)
    views2 = [again.add(a) for a in _arrays()]
    again.close()
    assert again.written == 0  # every array mapped from the cached file
    assert all(np.array_equal(np.asarray(v, np.float32), np.asarray(a, np.float32))
               for v, a in zip(views2, _arrays(), strict=True))
    assert [e.size for e in cache.entries(mapped.NAMESPACE)] == [first.path.stat().st_size
                                                                  + first.path.with_suffix(".json").stat().st_size]


def test_other_arrays_under_the_same_key_write_the_file_again_and_earlier_views_stay_valid() -> None:
    key = {"model": "m"}
    a, b, c = _arrays()
    first = mapped.MappedWeights(key)
    first.add(a), first.add(b)
    first.close()
    other = mapped.MappedWeights(key)
    va = other.add(a)  # as cached
    vc = other.add(c)  # not what the file holds next: a new file from here, with `a` copied into it
    other.close()
    assert other.written == a.nbytes + c.nbytes
    assert np.array_equal(np.asarray(va, np.float32), np.asarray(a, np.float32))
    assert np.array_equal(np.asarray(vc, np.float32), np.asarray(c, np.float32))
    third = mapped.MappedWeights(key)
    third.add(a), third.add(c)
    assert third.written == 0  # the rewritten file is the cache's now


def test_released_pages_leave_memory_and_come_back_from_the_file() -> None:
    big = np.random.default_rng(1).standard_normal((2048, 1024), dtype=np.float32)  # 8 MiB
    store = mapped.MappedWeights({"model": "big"})
    view = store.add(big)
    store.close()
    assert float(np.asarray(view).sum()) == pytest.approx(float(big.sum()), rel=1e-4)  # every page touched
    assert store.resident() >= big.nbytes
    assert store.release() >= big.nbytes
    assert store.resident() < big.nbytes // 8
    assert np.array_equal(view, big)  # read back from the file


def test_a_private_mapping_is_released_until_a_page_of_it_is_written(tmp_path: Path) -> None:
    """safetensors maps a checkpoint private and writable (copy on write): its pages go while none was
    written, and a mapping holding a write keeps its pages, so the write is not lost."""
    big = np.random.default_rng(2).standard_normal((2048, 1024), dtype=np.float32)  # 8 MiB
    path = tmp_path / "weights.bin"
    big.tofile(path)
    cow = np.memmap(path, dtype=np.float32, mode="c", shape=big.shape)  # MAP_PRIVATE, readable and writable
    assert float(cow.sum()) == pytest.approx(float(big.sum()), rel=1e-4)  # every page touched
    assert mapped.resident_file(path) >= big.nbytes
    assert mapped.release_file(path) >= big.nbytes
    assert mapped.resident_file(path) < big.nbytes // 8
    assert np.array_equal(cow, big)  # read back from the file
    cow[7, 7] = 123.0  # one page now holds a write of this process alone
    assert float(cow.sum()) != 0.0
    assert mapped.release_file(path) == 0
    assert mapped.resident_file(path) >= big.nbytes // 2
    assert cow[7, 7] == 123.0 and np.array_equal(np.fromfile(path, np.float32).reshape(big.shape), big)


def test_clearing_the_cache_removes_the_files() -> None:
    store = mapped.MappedWeights({"model": "gone"})
    store.add(_arrays()[1])
    store.close()
    assert store.path.exists()
    assert cache.clear(mapped.NAMESPACE) == 1
    assert not store.path.exists() and not list(store.path.parent.iterdir())
