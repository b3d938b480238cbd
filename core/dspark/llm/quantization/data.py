"""Token windows for calibration and evaluation.

Calibration text comes from the user's JSONL (``calibration_data_path``: one
JSON object per line with a ``"text"`` string) or, by default, from standard
library source files that the embedded model's held-out list does not name
(the model's own training domain, never its evaluation set). Held-out windows
come from exactly the files in ``heldout_files.txt`` next to the model.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

from dspark.host.jsonl import iter_objects


class CalibrationDataError(ValueError):
    """Calibration data that cannot be used; the message names the file and line."""


def load_jsonl(path: str | Path) -> list[str]:
    """Texts of a calibration JSONL file; any bad line is an error naming it (nothing is skipped silently)."""
    p = Path(path)
    if not p.is_file():
        raise CalibrationDataError(f"{p}: calibration data file does not exist")
    texts: list[str] = []
    for n, obj in iter_objects(p, CalibrationDataError):
        if not isinstance(obj.get("text"), str):
            raise CalibrationDataError(f"{p}:{n}: expected an object with a \"text\" string, got keys {sorted(obj)}")
        if obj["text"]:
            texts.append(obj["text"])
    if not texts:
        raise CalibrationDataError(f"{p}: no calibration texts (every line empty)")
    return texts


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _heldout(model_path: Path) -> list[str] | None:
    listing = model_path / "heldout_files.txt"
    if not listing.exists():
        return None
    return [ln.strip() for ln in listing.read_text().splitlines() if ln.strip()]


def default_calibration_texts(model_path: str | Path, max_files: int = 64) -> list[str]:
    """Stdlib files not held out, spread evenly over the sorted list (deterministic)."""
    root = stdlib_root()
    held = set(_heldout(Path(model_path)) or [])
    files = sorted(p.relative_to(root).as_posix() for p in root.glob("*.py") if p.is_file())
    files = [f for f in files if f not in held]
    if not files:
        raise CalibrationDataError(f"{root}: no standard-library .py files for the default calibration set; "
                                   "pass calibration_data_path")
    step = max(1, len(files) // max_files)
    return [(root / f).read_bytes().decode("utf-8", errors="replace") for f in files[::step][:max_files]]


def heldout_texts(model_path: str | Path) -> list[str]:
    names = _heldout(Path(model_path))
    if names is None:
        raise CalibrationDataError(f"{model_path}: no heldout_files.txt (only the embedded models list their "
                                   "held-out files)")
    root = stdlib_root()
    return [(root / n).read_bytes().decode("utf-8", errors="replace") for n in names if (root / n).exists()]


def load_tokenizer(model_path: str | Path) -> Any:
    from tokenizers import Tokenizer

    f = Path(model_path) / "tokenizer.json"
    if not f.exists():
        raise CalibrationDataError(f"{f}: missing; calibration needs the model's tokenizer")
    return Tokenizer.from_file(str(f))


def token_windows(texts: list[str], tokenizer: Any, *, seq_len: int, max_windows: int,
                  eos_id: int | None) -> list[list[int]]:
    """Texts joined by EOS, cut into non-overlapping windows of ``seq_len + 1`` tokens.

    Every token after the first of a window is a prediction target; a short tail is dropped.
    """
    stream: list[int] = []
    need = (seq_len + 1) * max_windows
    for t in texts:
        stream.extend(tokenizer.encode(t, add_special_tokens=False).ids)
        if eos_id is not None:
            stream.append(eos_id)
        if len(stream) >= need:
            break
    windows = [stream[i : i + seq_len + 1] for i in range(0, len(stream) - seq_len, seq_len + 1)]
    return windows[:max_windows]


def spread_windows(texts: list[str], tokenizer: Any, *, seq_len: int, max_windows: int) -> list[list[int]]:
    """Windows of ``seq_len + 1`` tokens taken in turn from each text (first window of each, then the
    second ...), so a small calibration set still spans many files rather than the start of one."""
    per_text: list[list[list[int]]] = []
    for t in texts:
        ids = tokenizer.encode(t, add_special_tokens=False).ids
        per_text.append([ids[i : i + seq_len + 1] for i in range(0, len(ids) - seq_len, seq_len + 1)])
    out: list[list[int]] = []
    depth = 0
    while len(out) < max_windows and any(depth < len(w) for w in per_text):
        for w in per_text:
            if depth < len(w) and len(out) < max_windows:
                out.append(w[depth])
        depth += 1
    return out


def calibration_windows(model_path: str | Path, *, data_path: str | Path | None, seq_len: int, samples: int,
                        eos_id: int | None) -> list[list[int]]:
    texts = load_jsonl(data_path) if data_path is not None else default_calibration_texts(model_path)
    del eos_id  # windows never cross a text boundary here
    windows = spread_windows(texts, load_tokenizer(model_path), seq_len=seq_len, max_windows=samples)
    if not windows:
        src = data_path or "the default calibration set"
        raise CalibrationDataError(f"{src}: fewer than {seq_len + 1} tokens in all; add text or lower "
                                   "calibration_seq_len")
    return windows
