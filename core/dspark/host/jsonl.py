"""Reading JSONL files whose every line must be a JSON object: errors name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def iter_objects(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line; a line that is not UTF-8, not JSON or not
    an object raises ``error`` naming ``path:line``, so nothing is skipped silently."""
    p = Path(path)
    with p.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise error(f"{p}:{n}: not UTF-8 ({e.reason} at byte {e.start})") from e
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{p}:{n}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(obj, dict):
                raise error(f"{p}:{n}: expected a JSON object, got {type(obj).__name__}")
            yield n, obj
