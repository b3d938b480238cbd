"""The CPU paged-attention kernel (paged_attention.c): build once, cache, call through ctypes.

The kernel is C built on first use with the system's gcc (``-O3 -march=native -fopenmp``)
into ``$DSPARK_CACHE_DIR/kernels`` under a name hashed from the source, the flags and
this CPU's feature flags, so a rebuild happens only when one of those changes. It links
``libgomp.so.1``, the OpenMP runtime torch has already loaded, so it shares torch's
threads. Without a compiler, or if the build or its self-check fails, :func:`kernel`
returns None with the reason logged once and the runner keeps its torch path (gather
and SDPA). ``DSPARK_PAGED_ATTENTION=0`` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from dspark.host import hostinfo
from dspark.host.cache import cache_dir
from dspark.host.log import get_logger

log = get_logger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC", "-std=c11"]
_I32, _I64, _F32, _P = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc or $CC) on PATH")
    src = _SOURCE.read_bytes()
    # -march=native: the build is only valid for this CPU model and instruction set.
    cpu = hostinfo.cpu_static()
    key = " ".join([cc, *_FLAGS, cpu["model"], cpu["arch"], *cpu["isa_features"]])
    tag = hashlib.sha256(src + key.encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"paged_attention-{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        r = subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SOURCE), "-lm"], capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed on {_SOURCE.name}: {r.stderr.strip()[-800:]}")
        os.replace(tmp, out)  # atomic: a concurrent build of the same source writes the same file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class PagedAttention:
    """``kernel(q, out, k_pages, v_pages, tables, row_seq, row_len, scale, window, softcap)``; see
    paged_attention.c."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.dspark_paged_attention
        self._fn.restype = None
        self._fn.argtypes = [_P, _I64, _P, _P, _P, _P, _I32, _P, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32, _F32,
                             _I32]
        g, d, p = _I32(), _I32(), _I32()
        lib.dspark_paged_attention_limits(ctypes.byref(g), ctypes.byref(d), ctypes.byref(p))
        self.max_group, self.max_head_dim, self.max_page = g.value, d.value, p.value

    def supports(self, *, heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype) -> bool:
        return (dtype == torch.float32 and heads % kv_heads == 0 and heads // kv_heads <= self.max_group
                and head_dim <= self.max_head_dim and head_dim % 8 == 0 and page_size <= self.max_page)

    def __call__(self, q: torch.Tensor, out: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                 tables: torch.Tensor, row_seq: torch.Tensor, row_len: torch.Tensor, scale: float,
                 window: int | None = None, softcap: float | None = None) -> None:
        """q [T, H, D] (rows may be strided, heads contiguous); out [T, H, D]; pages [N, P, KVH, D];
        tables int32 [S, W]; row_seq, row_len int32 [T]. Writes the rows with row_len > 0 of ``out``.
        ``window``: each row sees only its last this-many positions; ``softcap``: scores capped by tanh."""
        T, H, D = q.shape
        _, P, KVH, _ = k_pages.shape
        f32 = all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, out, k_pages, v_pages))
        if not (f32 and q.stride(2) == 1 and q.stride(1) == D and out.is_contiguous() and k_pages.is_contiguous()
                and v_pages.is_contiguous() and tables.is_contiguous() and tables.dtype == torch.int32
                and row_seq.dtype == torch.int32 and row_len.dtype == torch.int32):
            raise ValueError("paged attention: a tensor has the wrong layout or dtype")
        self._fn(q.data_ptr(), q.stride(0), out.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(),
                 tables.data_ptr(), tables.shape[1], row_seq.data_ptr(), row_len.data_ptr(), T, H, KVH, D, P,
                 scale, window or 0, softcap or 0.0, torch.get_num_threads())


def _self_check(k: PagedAttention) -> None:
    """The kernel against plain attention on a small random case with GQA, several pages and a partial
    one; plain, then with a sliding window and soft-capping."""
    g = torch.Generator().manual_seed(0)
    H, KVH, D, P, lens = 4, 2, 16, 4, [1, 6, 9]
    kc = torch.randn(8, P, KVH, D, generator=g)
    vc = torch.randn(8, P, KVH, D, generator=g)
    tables = torch.tensor([[5, 0, 0], [1, 7, 0], [2, 4, 6]], dtype=torch.int32)
    q = torch.randn(3, H, D, generator=g)
    for window, cap in ((None, None), (4, 2.0)):
        out = torch.zeros(3, H, D)
        k(q, out, kc, vc, tables, torch.arange(3, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
          D ** -0.5, window, cap)
        for i, n in enumerate(lens):
            lo = max(0, n - window) if window else 0
            slots = (tables[i].long()[:, None] * P + torch.arange(P)).reshape(-1)[lo:n]
            kk = kc.view(-1, KVH, D)[slots].repeat_interleave(H // KVH, dim=1)  # [n, H, D]
            vv = vc.view(-1, KVH, D)[slots].repeat_interleave(H // KVH, dim=1)
            s = torch.einsum("hd,nhd->hn", q[i], kk) * D ** -0.5
            if cap:
                s = cap * torch.tanh(s / cap)
            ref = torch.einsum("hn,nhd->hd", s.softmax(-1), vv)
            err = float((ref - out[i]).abs().max())
            if not err < 1e-4:
                raise RuntimeError(f"self-check differs from plain attention by {err:.2e} (row {i}, window "
                                   f"{window}, softcap {cap})")


@functools.cache
def kernel() -> PagedAttention | None:
    """The built kernel, or None (with the reason logged once) where it cannot run here."""
    if os.environ.get("DSPARK_PAGED_ATTENTION", "1") == "0":
        log.info("llm.paged_attention", enabled=False, reason="DSPARK_PAGED_ATTENTION=0")
        return None
    try:
        path = _build()
        k = PagedAttention(ctypes.CDLL(str(path)))
        _self_check(k)
    except Exception as e:  # no compiler, a failed build or check: the torch path runs
        log.warning("llm.paged_attention", enabled=False, reason=f"{type(e).__name__}: {e}")
        return None
    log.info("llm.paged_attention", enabled=True, library=str(path))
    return k
