"""Triton paged attention over the engine's KV blocks, and the kernel that writes new K/V rows.

Layout (per layer): ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size, kv_heads, head_dim]``,
head_dim contiguous. A step's rows are flattened as in :class:`dspark.sdk.decoder.StepBatch`:
sequence ``s`` owns rows ``seq_begins[s] .. seq_begins[s + 1]``, has ``past_lens[s]`` cached
positions before them, and its block table is ``block_table[table_begins[s]:]`` (the flattened
``block_indices`` + ``block_indices_begins``; a padded 2-D table ``[S, W]`` is the same thing with
``table_begins = arange(S + 1) * W``, see :func:`padded_table_begins`). Row ``r`` of sequence ``s``
sits at position ``past_lens[s] + r - seq_begins[s]`` and sees every position up to its own.

:data:`_paged_attn` is a flash-attention loop with one program per (sequence, kv head, tile of
``BLOCK_Q`` (row, q head) pairs): the ``GROUP`` q heads that share a kv head are folded into the
tile's rows, so GQA reads each K/V block once per tile and a decode row still fills a 16-row
``tl.dot``. Scores, the running max/sum and the output accumulate in float32 whatever the
input dtype (float32, bfloat16, float16); float32 dots run as IEEE float32, not TF32, so a
float32 decoder stays within rounding of the torch reference.

The grid depends only on the number of sequences and the longest chunk, and every length is read
on the device, so a decode step's launch is the same for any context: CUDA graphs can capture it.

Under ``TRITON_INTERPRET=1`` (set before Triton is first imported) both kernels run in Triton's
interpreter on CPU tensors; the tests use that. The interpreter mis-multiplies bfloat16 dots, so
there every dot is taken in float32 (``UPCAST``).
"""

from __future__ import annotations

from typing import Any

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

MAX_HEAD_DIM = 256  # larger heads would not fit the tiles in registers


@triton.jit
def _paged_attn(q_ptr, k_ptr, v_ptr, o_ptr, seq_begins_ptr, past_lens_ptr, table_ptr, table_begins_ptr,
                scale_log2, window, softcap,
                stride_qt, stride_qh, stride_ot, stride_oh,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                WINDOWED: tl.constexpr, CAPPED: tl.constexpr):
    s = tl.program_id(0)
    g = tl.program_id(1)
    m = tl.program_id(2)
    row0 = tl.load(seq_begins_ptr + s)
    n_new = tl.load(seq_begins_ptr + s + 1) - row0
    past = tl.load(past_lens_ptr + s)
    t0 = tl.load(table_begins_ptr + s)

    j = m * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row = j // GROUP
    head = g * GROUP + j % GROUP
    qmask = row < n_new
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + (row0 + row)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=qmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    qpos = past + row
    # Keys this tile can see: up to its last valid row's position (nothing for an empty tile).
    last = tl.minimum(m * BLOCK_Q + BLOCK_Q, n_new * GROUP) - 1
    hi = tl.where(last >= m * BLOCK_Q, past + last // GROUP + 1, 0)
    lo = 0
    if WINDOWED:  # keys before the tile's first row's window are seen by no row of the tile
        lo = tl.maximum(past + (m * BLOCK_Q) // GROUP - window + 1, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        blk = tl.load(table_ptr + t0 + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
        off = kpos % PAGE
        kv_mask = kmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + (blk * stride_kb + off * stride_ks + g * stride_kh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (blk * stride_vb + off * stride_vs + g * stride_vh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        if CAPPED:  # cap * tanh(s / cap) on the scaled scores, tanh written with exp2 (no tanh in every Triton)
            t = qk * (scale_log2 / softcap)  # (s / cap) * log2(e)
            qk = softcap * 1.4426950408889634 * (1.0 - 2.0 / (tl.exp2(2.0 * t) + 1.0))
        else:
            qk = qk * scale_log2
        visible = (kpos[None, :] <= qpos[:, None]) & kmask[None, :]
        if WINDOWED:
            visible = visible & (kpos[None, :] > qpos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
        # A row may see no key of a block (a window, or the tile's padding): keep its max finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (row0 + row)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=qmask[:, None] & dmask[None, :])


@triton.jit
def _write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_vt, stride_kc, stride_vc,
              WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    c = tl.arange(0, BLOCK)
    # A negative slot is a padding row (CUDA-graph buckets): it writes nothing.
    mask = (c < WIDTH) & ((c * 0 + slot) >= 0)  # a vector compare: the interpreter rejects a scalar & vector mask
    tl.store(kc_ptr + slot * stride_kc + c, tl.load(k_ptr + t * stride_kt + c, mask=mask), mask=mask)
    tl.store(vc_ptr + slot * stride_vc + c, tl.load(v_ptr + t * stride_vt + c, mask=mask), mask=mask)


def interpreted() -> bool:
    """True when the kernels run in Triton's interpreter (CPU tensors), False when compiled (CUDA)."""
    return type(_paged_attn).__name__ == "InterpretedFunction"


def check_device(device: Any) -> None:
    if device.type == "cuda" and interpreted():
        raise RuntimeError("TRITON_INTERPRET is set: the Triton kernels run in the interpreter, "
                           "on CPU tensors only; unset it to run them on the GPU")
    if device.type != "cuda" and not interpreted():
        raise RuntimeError(f"the Triton kernels need CUDA tensors (got {device.type}); on the CPU they run "
                           "only in Triton's interpreter (TRITON_INTERPRET=1 before triton is imported)")


def supported_head_dim(head_dim: int) -> bool:
    return 1 <= head_dim <= MAX_HEAD_DIM


def padded_table_begins(num_seqs: int, width: int, device: Any = None) -> Any:
    """``table_begins`` for a padded 2-D block table ``[num_seqs, width]`` passed flattened."""
    import torch

    return torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * width


def write_kv(k: Any, v: Any, k_cache: Any, v_cache: Any, slots: Any) -> None:
    """Store rows ``k``, ``v`` ``[T, kv_heads, head_dim]`` at ``slots`` ``[T]`` (block * block_size +
    offset) of the caches; rows whose slot is negative are skipped. No host sync."""
    t = k.shape[0]
    if t == 0:
        return
    width = k.shape[1] * k.shape[2]
    k2, v2 = k.reshape(t, width), v.reshape(t, width)
    if k2.stride(1) != 1:
        k2 = k2.contiguous()
    if v2.stride(1) != 1:
        v2 = v2.contiguous()
    kc, vc = k_cache.view(-1, width), v_cache.view(-1, width)  # one row per slot (contiguous caches)
    _write_kv[(t,)](k2, v2, kc, vc, slots, k2.stride(0), v2.stride(0), kc.stride(0), vc.stride(0),
                    WIDTH=width, BLOCK=triton.next_power_of_2(width), num_warps=4)


def tiles(max_rows: int, group: int) -> tuple[int, int]:
    """(BLOCK_Q, tiles per sequence) for chunks of at most ``max_rows`` rows: a decode row's GROUP
    heads fill one tile of at least 16 (tl.dot's minimum); prefill chunks take tiles of 64."""
    items = max(1, max_rows) * group
    block_q = min(64, max(16, triton.next_power_of_2(items)))
    return block_q, triton.cdiv(items, block_q)


def paged_attention(q: Any, k_cache: Any, v_cache: Any, seq_begins: Any, past_lens: Any, block_table: Any,
                    table_begins: Any, max_rows: int, scale: float, out: Any = None, window: int | None = None,
                    softcap: float | None = None) -> Any:
    """Attention of ``q`` ``[T, heads, head_dim]`` over the paged caches; returns ``[T, heads, head_dim]``
    in q's dtype (``out`` if given).

    ``seq_begins`` ``[S + 1]``, ``past_lens`` ``[S]``, ``table_begins`` ``[S + 1]`` and ``block_table``
    are integer tensors on q's device (int32 or int64); ``max_rows`` is the longest chunk (a host int:
    it sizes the grid). ``scale`` multiplies the scores (``head_dim ** -0.5`` for Llama); ``softcap``
    caps them (``c * tanh(s / c)``); ``window``: a row sees only its last this-many positions.
    """
    import torch

    t, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} q heads do not share {kv_heads} kv heads evenly")
    if not supported_head_dim(dim) or k_cache.shape[3] != dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"head_dim {dim} with caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty((t, heads, dim), dtype=q.dtype, device=q.device)
    num_seqs = past_lens.shape[0]
    if t == 0 or num_seqs == 0:
        return out
    group = heads // kv_heads
    block_q, per_seq = tiles(max_rows, group)
    interp = interpreted()
    ieee = q.dtype == torch.float32
    block_n = 64 if interp or dim <= 128 else 32  # wide blocks: fewer (slow) interpreted iterations
    block_d = max(16, triton.next_power_of_2(dim))
    warps = 8 if block_q * block_d >= 64 * 128 else 4  # a prefill tile of wide heads: more threads for it
    _paged_attn[(num_seqs, kv_heads, per_seq)](
        q, k_cache, v_cache, out, seq_begins, past_lens, block_table, table_begins,
        float(scale) * 1.4426950408889634,  # log2(e): the kernel uses exp2
        int(window or 0), float(softcap or 1.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group, HEAD_DIM=dim, BLOCK_D=block_d, PAGE=k_cache.shape[1],
        BLOCK_Q=block_q, BLOCK_N=block_n, UPCAST=interp, IEEE=ieee, WINDOWED=window is not None,
        CAPPED=softcap is not None, num_warps=warps, num_stages=2)
    return out
