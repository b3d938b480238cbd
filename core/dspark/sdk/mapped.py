"""Weights a runtime reads from a file it maps, so that the process holds them once.

A runtime that packs its weights for its kernels (OpenVINO's CPU plugin, at the first
inference) keeps the constant it packed from as well: a model held twice. Mapped
read-only from a file, those constants' pages can be dropped once packed
(:meth:`MappedWeights.release`, ``madvise(MADV_DONTNEED)``): what stays is the
packed copy, and a page the runtime reads again comes back from the file, so a
release is always safe. OpenVINO GenAI runs a model the same way, from its IR's
mapped weights file.

The file is written once per key in the disk cache (``$DSPARK_CACHE_DIR``, namespace
``mapped-weights``; ``dspark cache clear`` removes it) and mapped again on a later
start. Arrays are added in the order the runtime's model is built; a file whose
arrays differ from the ones added (another build order, a changed model) is written
again. Where the cache lives on a memory file system (tmpfs), a mapped page is
memory either way: :func:`usable` says no and the caller keeps its own copy.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from dspark.host import cache

NAMESPACE = "mapped-weights"
_MADV_DONTNEED = 4  # Linux
_ALIGN = mmap.ALLOCATIONGRANULARITY


def _memory_fs(path: Path) -> bool:
    """Whether ``path`` lies on a file system held in memory (tmpfs, ramfs)."""
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                inside = str(path) == parts[1] or str(path).startswith(parts[1].rstrip("/") + "/")
                if len(parts) > 2 and inside and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        return False
    return kind in ("tmpfs", "ramfs")


def usable() -> bool:
    """Whether mapped weights save memory here: Linux (``madvise``) with the cache on a disk."""
    return platform.system() == "Linux" and not _memory_fs(cache.cache_dir().resolve())


def release_file(path: str | Path) -> int:
    """Drop from memory the pages of ``path`` this process maps (a runtime's own mapping of a model file,
    e.g. llama.cpp's of a GGUF once it has repacked the tensors it runs repacked, or safetensors' of a
    checkpoint once its tensors were copied into fused ones): a page read again comes back from the file.
    Mappings that hold writes are left alone (dropping their pages would drop the writes): shared writable
    ones, and private ones with a page copied on write. Returns the bytes advised; 0 where this is not
    Linux."""
    return release_files([path])


def release_files(paths: list[str | Path]) -> int:
    """:func:`release_file` for several files, reading the process's mappings once."""
    if platform.system() != "Linux":
        return 0
    try:
        spans = _file_mappings({_identity(p) for p in paths})
    except OSError:
        return 0
    done = 0
    for start, end, perms, written in spans:
        if "w" not in perms or (perms.endswith("p") and not written):
            done += _advise(start, end - start)
    return done


def _file_mappings(files: set[tuple[str, str]]) -> list[tuple[int, int, str, bool]]:
    """(start, end, permissions, whether a page was copied on write) of each mapping of the files, given by
    (device, inode)."""
    out: list[tuple[int, int, str, bool]] = []
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's header line
                inside = len(head) >= 6 and (head[3], head[4]) in files
                if inside:
                    start, end = (int(x, 16) for x in head[0].split("-"))
                    out.append((start, end, head[1], False))
            elif inside and head[0] == "Anonymous:" and int(head[1]) > 0:
                out[-1] = (*out[-1][:3], True)
    return out


def resident_file(path: str | Path) -> int:
    """Bytes of ``path``'s pages this process holds in memory, over all its mappings of the file (0 where
    there is no /proc, or no such file)."""
    try:
        dev, ino = _identity(path)
        total, inside = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if len(head) >= 5 and "-" in head[0] and ":" in head[3]:  # a mapping's header line
                    inside = head[4] == ino and head[3] == dev
                elif inside and head[0] == "Rss:":
                    total += int(head[1]) * 1024
        return total
    except OSError:
        return 0


def _identity(path: str | Path) -> tuple[str, str]:
    """The file's device and inode as /proc/<pid>/maps writes them ("fd:01", "1234")."""
    st = os.stat(path)
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", str(st.st_ino)


def _advise(start: int, length: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return length if length > 0 and libc.madvise(start, length, _MADV_DONTNEED) == 0 else 0


class MappedWeights:
    """Arrays copied once into a cache file and handed back as read-only views of its mapping.

    ``key``: everything that identifies the arrays' values (the model's fingerprint, the layer range, the
    layout's version). Add arrays with :meth:`add` in a fixed order, then :meth:`close`; keep this object
    alive as long as the runtime reads the views."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self.path = cache.blob_path(NAMESPACE, key)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stored = cache.load(NAMESPACE, key)
        want = stored.get("arrays") if isinstance(stored, dict) else None
        if want and (not self.path.exists() or self.path.stat().st_size < _end(want[-1])):
            want = None  # the file is gone or cut short
        self._want: list[list[Any]] = want or []
        self._layout: list[list[Any]] = []  # [offset, dtype, shape] of each array added
        self._maps: list[np.memmap] = []
        self._file: Any = None
        self._tmp: Path | None = None
        self.written = 0  # bytes this process wrote (0: every array was mapped from the cached file)
        if not self._want:
            self._begin_write()

    def _begin_write(self) -> None:
        """Write a new file from here on, with the arrays already mapped copied into it at their offsets."""
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".bin")
        self._file, self._tmp = os.fdopen(fd, "wb"), Path(tmp)
        for (offset, _, _), m in zip(self._layout, self._maps, strict=True):
            self._write(offset, m)

    def _write(self, offset: int, a: np.ndarray) -> None:
        self._file.seek(offset)
        self._file.write(memoryview(np.ascontiguousarray(a).view(np.uint8).reshape(-1)))
        self.written += a.nbytes

    def add(self, a: np.ndarray) -> np.ndarray:
        """A read-only view of ``a``'s values in the mapped file (C order; ``a``'s dtype and shape)."""
        a = np.ascontiguousarray(a)
        if a.nbytes == 0:
            return a  # nothing to map (an empty file region cannot be)
        offset = -(-_end(self._layout[-1]) // _ALIGN) * _ALIGN if self._layout else 0
        entry = [offset, a.dtype.name, list(a.shape)]
        i = len(self._layout)
        if self._file is None and (i >= len(self._want) or self._want[i] != entry):
            self._begin_write()  # the cached file holds other arrays from here on (another build order)
        self._layout.append(entry)
        if self._file is not None:
            self._write(offset, a)
            self._file.flush()  # mapped next: the mapping reads what the file holds
        m = np.memmap(self._tmp if self._file is not None else self.path, dtype=a.dtype, mode="r", offset=offset,
                      shape=a.shape)
        self._maps.append(m)
        return m

    def close(self) -> None:
        """Finish adding: a file written here becomes the cache's (a later start maps it)."""
        if self._file is None:
            return
        self._file.close()
        assert self._tmp is not None
        os.replace(self._tmp, self.path)  # the maps stay valid: the same file under its cache name
        cache.store(NAMESPACE, self.key, {"arrays": self._layout})
        self._file = None

    def discard(self) -> None:
        """Give up a file being written (the build failed): nothing reaches the cache."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self._maps)

    def resident(self) -> int:
        """Bytes of the file's pages this process holds in memory (over all its mappings of the file)."""
        return resident_file(self.path)

    def release(self) -> int:
        """Drop the mapped pages from memory (read back from the file if touched again); the bytes advised."""
        if platform.system() != "Linux":
            return 0
        done = 0
        for m in self._maps:
            start = m.ctypes.data - m.ctypes.data % mmap.PAGESIZE
            done += _advise(start, m.ctypes.data + m.nbytes - start)
        return done


def _end(entry: list[Any]) -> int:
    """The byte just past an array of the layout."""
    return int(entry[0]) + int(np.dtype(_dtype(entry[1])).itemsize) * int(np.prod(entry[2], dtype=np.int64))


def _dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)
