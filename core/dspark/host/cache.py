"""A small on-disk JSON cache for probe microbenchmarks and calibration timings.

Entries live under ``$DSPARK_CACHE_DIR`` (default ``~/.cache/dspark``), one
file per namespace and key; the key should include everything that changes
the measured value (runtime version, CPU model, ...). ``dspark cache list``
and ``dspark cache clear`` show and drop them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    root = os.environ.get("DSPARK_CACHE_DIR") or os.path.join(Path.home(), ".cache", "dspark")
    return Path(root)


def _path(namespace: str, key: Any) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_dir() / namespace / f"{digest}.json"


def blob_path(namespace: str, key: Any) -> Path:
    """A binary file kept beside an entry (its name, ``.bin``), e.g. weights a runtime maps; removed with
    the entry by :func:`delete` and :func:`clear`. Write it before storing the entry."""
    return _path(namespace, key).with_suffix(".bin")


def load(namespace: str, key: Any) -> Any | None:
    path = _path(namespace, key)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry.get("value") if entry.get("key") == json.loads(json.dumps(key, default=str)) else None


def store(namespace: str, key: Any, value: Any) -> None:
    path = _path(namespace, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump({"key": key, "value": value}, f, default=str)
    os.replace(tmp, path)  # atomic: concurrent readers see old or new, never half


def delete(namespace: str, key: Any) -> bool:
    """Remove one entry; whether there was one."""
    path = _path(namespace, key)
    path.with_suffix(".bin").unlink(missing_ok=True)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def clear(namespace: str) -> int:
    """Remove every entry of ``namespace``; how many there were."""
    d = cache_dir() / namespace
    removed = 0
    if d.is_dir():
        for p in d.glob("*.json"):
            p.with_suffix(".bin").unlink(missing_ok=True)
            p.unlink(missing_ok=True)
            removed += 1
        for p in d.glob(".tmp-*"):  # left by a writer that stopped before renaming its file
            p.unlink(missing_ok=True)
    return removed


@dataclass(frozen=True)
class Entry:
    """One cached entry as found on disk (``key`` and ``value`` None when the file is unreadable)."""

    namespace: str
    path: Path
    size: int
    mtime: float
    key: Any
    value: Any


def namespaces() -> list[str]:
    """The namespaces that hold entries, sorted."""
    root = cache_dir()
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.is_dir() and any(d.glob("*.json")))


def entries(namespace: str) -> list[Entry]:
    """Every entry of ``namespace``, oldest first."""
    found = []
    for p in (cache_dir() / namespace).glob("*.json"):
        try:
            stat = p.stat()
        except OSError:
            continue  # removed meanwhile
        try:
            data = json.loads(p.read_text())
            key, value = (data.get("key"), data.get("value")) if isinstance(data, dict) else (None, None)
        except (OSError, ValueError):
            key = value = None
        size = stat.st_size
        try:
            size += p.with_suffix(".bin").stat().st_size  # the entry's binary file, if it has one
        except OSError:
            pass
        found.append(Entry(namespace, p, size, stat.st_mtime, key, value))
    return sorted(found, key=lambda e: e.mtime)
