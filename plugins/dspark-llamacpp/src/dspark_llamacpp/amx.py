"""Whether llama.cpp's AMX kernels run on this machine, asked once of a child process and cached.

llama.cpp's extra CPU buffer types include an AMX one on CPUs with AMX (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K,
IQ4_XS weights). Built by GCC, its tile configuration used to reach ``ldtilecfg`` with most of its bytes
never written (the builtin does not declare the 64 bytes it reads, so the stores were dropped as dead) and
the first multi-row step crashed the process; and its kernels loaded that configuration once per thread, so
a step after torch ran a bfloat16 matmul on the same thread (oneDNN's AMX kernels load their own and release
the tiles) died of SIGILL. scripts/patches/ holds the fixes scripts/setup.sh builds with. A llama-cpp-python
built elsewhere may lack them, and a crash cannot be caught in the process it kills, so before the plugin
loads a model with the extra buffer types on an AMX CPU, a child process loads a tiny Q8_0 model that way,
decodes a few rows (the tile path), runs a torch bfloat16 matmul and decodes them again. The verdict is
cached per llama.cpp library (its files' contents) and CPU; a fault keeps the extra buffer types off, with a
warning.

The child's side: :mod:`dspark_llamacpp.amx_child`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from dspark.sdk import cache, get_logger, hostinfo

log = get_logger("dspark_llamacpp.amx")

NAMESPACE = "llamacpp-amx-v2"  # v2: the probe also runs a step after torch's AMX tiles (a verdict of v1 is not it)
PROBE_TIMEOUT_S = 180.0
_lock = threading.Lock()
_known: dict[str, bool] = {}


def has_amx() -> bool:
    return "amx_tile" in hostinfo.cpu_static()["isa_features"]


@functools.cache
def library_key() -> str:
    """The llama.cpp libraries llama-cpp-python loads (a hash of their contents: a reinstall of the same
    build keeps its verdict) and this CPU; read once per process."""
    spec = importlib.util.find_spec("llama_cpp")
    roots = list(spec.submodule_search_locations or []) if spec else []
    h = hashlib.sha256()
    for p in sorted({p.resolve() for r in roots for p in Path(r).rglob("*.so*") if p.is_file()}):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    info = hostinfo.cpu_static()
    return repr((h.hexdigest()[:32], info.get("model"), sorted(info.get("isa_features", []))))


def _child_command(path: Path) -> list[str]:
    return [sys.executable, "-m", "dspark_llamacpp.amx_child", str(path)]


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def probe() -> tuple[bool, str]:
    """Run the child once: (whether a multi-row step on AMX weights ran, what happened)."""
    from dspark_llamacpp import tiny

    with tempfile.TemporaryDirectory(prefix="dspark-amx-") as d:
        f = tiny.write(Path(d) / "amx-q8_0.gguf", hidden=256, ff=512, vocab=256, layers=1, qtype="Q8_0")
        try:
            proc = subprocess.run(_child_command(f), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return False, f"the probe did not finish in {PROBE_TIMEOUT_S:.0f} s"
    if proc.returncode == 0:
        return True, ("steps of 32 rows on Q8_0 weights in llama.cpp's AMX buffer ran, before and after a torch "
                      "bfloat16 matmul on the same thread")
    tail = (proc.stderr or "").strip().splitlines()[-1:]
    return False, f"the probe's step was {_how(proc.returncode)}" + (f" ({tail[0]})" if tail else "")


def runs() -> bool:
    """Whether the extra buffer types may be used on this CPU: always without AMX, else the cached verdict
    of :func:`probe` for this library (probed on first use)."""
    if not has_amx():
        return True
    key = library_key()
    with _lock:
        if key in _known:
            return _known[key]
        hit: Any = cache.load(NAMESPACE, key)
        if isinstance(hit, dict) and isinstance(hit.get("runs"), bool):
            _known[key] = hit["runs"]
            return _known[key]
        ok, why = probe()
        if ok:
            log.info("llamacpp.amx_probe", runs=True, detail=why)
        else:
            log.warning("llamacpp.amx_probe", runs=False, detail=why,
                        action="llama.cpp's extra CPU buffer types stay off on this CPU: weights run as stored; "
                               "scripts/setup.sh builds llama-cpp-python with the fix (scripts/patches/)")
        try:
            cache.store(NAMESPACE, key, {"runs": ok, "detail": why})
        except OSError as exc:  # a cache that cannot be written: the verdict holds for this process
            log.warning("llamacpp.amx_probe_not_cached", error=f"{type(exc).__name__}: {exc}")
        _known[key] = ok
        return ok
