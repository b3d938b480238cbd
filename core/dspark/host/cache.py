"""A small on-disk JSON cache for probe microbenchmarks and calibration timings.

Entries live under ``$DSPARK_CACHE_DIR`` (default ``~/.cache/dspark``), one
file per namespace and key; the key should include everything that changes
the measured value (runtime version, CPU model, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    root = os.environ.get("DSPARK_CACHE_DIR") or os.path.join(Path.home(), ".cache", "dspark")
    return Path(root)


def _path(namespace: str, key: Any) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_dir() / namespace / f"{digest}.json"


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


def clear(namespace: str) -> None:
    d = cache_dir() / namespace
    if d.is_dir():
        for p in d.glob("*.json"):
            p.unlink(missing_ok=True)
