"""Whole-decoder targets (plugin API 1.6): what a plugin needs to compile and drive an LLM decoder.

The engine owns the paged KV cache's bookkeeping (block tables, lengths, which
sequence runs when); a plugin's compiled decoder owns the KV *memory* on its
device, laid out in the engine's blocks, and runs a whole step: any mix of
prefill chunks, decode tokens and verified drafts of many sequences.

- :class:`DecoderSpec`: the model, its weights in one canonical layout, the
  layer range asked for and the largest step; what ``dspark_decoder_bid`` and
  ``dspark_compile_decoder`` receive.
- :class:`DecoderBid`: a plugin's promise to compile and run it on one device
  (or ``declined``, with the reason, which ``dspark devices --decoders`` and the
  engine's start-up log show).
- :class:`StepBatch`: one step's inputs, flattened as OpenVINO's
  ``PagedAttentionExtension`` and vLLM take them.
- :class:`CompiledDecoder`: ``allocate(num_blocks)`` and ``step(kv, batch)``.

API 1.8 adds a second mode, for whole-model runtimes that keep the KV per sequence
themselves (llama.cpp, NPU LLM runtimes): a :class:`SequenceDecoder` (``kv_mode =
"sequence"``) is given, each step, a :class:`SeqBatch`: every row's stable sequence
id, token and position, the rows that want logits, and the positions to drop first
(rejected drafts, preemption, finished or aborted requests). The engine keeps its
block tables only as bookkeeping of how many tokens each sequence holds; the
plugin's ``allocate(num_tokens, max_seqs)`` says what it can hold.

Weights are numpy float32 views of the engine's own tensors (no copy), so
every plugin builds from the same numbers the torch reference runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from dspark.types import DecoderBid, QuantSpec

__all__ = ["FEATURES", "CompiledDecoder", "DecoderBid", "DecoderSpec", "DecoderWeights", "LayerWeights",
           "SeqBatch", "SequenceDecoder", "StepBatch", "is_sequence"]

# What a model may need beyond a plain Llama decoder (RMSNorm, RoPE, SwiGLU, GQA); a plugin
# declines a spec whose ``features`` hold one it does not implement.
FEATURES: dict[str, str] = {
    "qkv_bias": "biases on the q/k/v projections (Qwen2)",
    "o_bias": "a bias on the attention output projection",
    "qk_norm": "RMSNorm over each head's q and k before RoPE (Qwen3)",
    "gelu_tanh": "GeGLU with tanh-approximated GELU instead of SwiGLU",
    "gelu": "GeGLU with exact GELU instead of SwiGLU",
    "gemma": "Gemma's (1 + w) norms, embedding scale and output norms",
    "sliding_window": "layers that see only their last N positions",
    "softcap": "tanh soft-capping of attention or final logits",
    "context_rope": "RoPE whose frequencies depend on the context length (LongRoPE, dynamic NTK)",
    "partial_rotary": "RoPE over only part of each head",
    "no_rope_layers": "layers without RoPE (SmolLM3)",
    "attn_scale": "an attention scale other than head_dim ** -0.5",
    # API 1.8: a GGUF file whose weights are quantized (Q4_K_M, Q8_0, ...) runs in its own types, read from
    # ``DecoderSpec.path``; ``weights()`` gives only the engine's dequantized copy, not what the user asked for.
    "gguf_stored": "weights quantized in a GGUF file, run as stored (read from DecoderSpec.path)",
}


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer, float32 (values exactly the engine's, whatever its dtype), ``y = x @ W`` for every projection."""

    in_norm: np.ndarray  # [hidden]
    post_norm: np.ndarray  # [hidden], the norm before the MLP
    qkv: np.ndarray  # [hidden, (H + 2 * KVH) * D]: q, then k, then v columns
    o: np.ndarray  # [H * D, hidden]
    gate_up: np.ndarray  # [hidden, 2 * intermediate]: gate, then up columns
    down: np.ndarray  # [intermediate, hidden]
    qkv_bias: np.ndarray | None = None  # [(H + 2 * KVH) * D]
    o_bias: np.ndarray | None = None  # [hidden]
    q_norm: np.ndarray | None = None  # [D]
    k_norm: np.ndarray | None = None  # [D]
    # API 1.10: Gemma's norms of the attention output and of the MLP output, before each residual add.
    attn_out_norm: np.ndarray | None = None  # [hidden]
    mlp_out_norm: np.ndarray | None = None  # [hidden]


@dataclass(frozen=True)
class DecoderWeights:
    embed: np.ndarray  # [vocab, hidden]
    norm: np.ndarray  # [hidden], the final norm
    head: np.ndarray  # [hidden, vocab]: logits = norm(x) @ head
    layers: list[LayerWeights]  # every layer of the model (a range uses its own slice)


@dataclass(frozen=True)
class DecoderSpec:
    """A decoder (or a contiguous range of its layers) to bid on and compile.

    A range ``layers=(a, b)`` with ``a > 0`` takes the hidden state ``[T, hidden]``
    instead of token ids; with ``b < num_layers`` it returns the hidden state after
    layer ``b - 1`` instead of logits. Ranges are only asked of plugins when no single
    device holds the whole model.
    """

    name: str
    path: str
    fingerprint: str  # changes with the weights, config and quantization: a key for compiled caches
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    features: frozenset[str]
    dtype: str  # what the engine computes in ("float32", "bfloat16", "float16"): the decoder should too
    layers: tuple[int, int]
    # Early exits the engine may ask for in ``StepBatch.exit_layer`` (self-drafting): run the first E
    # layers, then the final norm and head. A decoder without ``exit_layers`` support declines them in
    # its bid and the engine does not offer that drafter on it.
    exit_layers: tuple[int, ...] = ()
    threads: int = 0  # the engine's compute threads (torch's intra-op threads); 0 = the runtime's default
    max_num_tokens: int = 512  # the most rows of one step
    max_num_seqs: int = 256  # the most sequences of one step
    # The engine's quantization plan: weight name -> how it is quantized; None = float. Names are the
    # engine's: ``model.layers.N.self_attn.qkv_proj``, ``...o_proj``, ``...mlp.gate_up_proj``,
    # ``...mlp.down_proj``, ``lm_head`` (weights ``[in, out]`` as in :class:`LayerWeights`) and
    # ``model.embed_tokens`` (per row: quantize ``embed.T``). ``dspark.sdk.quant.quantize_weight(w, spec)``
    # gives the canonical values the torch runner uses. A plugin that cannot run one natively declines.
    quantization: dict[str, QuantSpec] | None = None
    weights_fn: Callable[[], DecoderWeights] = field(repr=False, compare=False, default=lambda: _no_weights())
    # API 1.12: the weights in the precision the engine holds them (``weights(stored=True)``); None: as
    # ``weights_fn`` (float32), for specs built before 1.12.
    stored_weights_fn: Callable[[], DecoderWeights] | None = field(repr=False, compare=False, default=None)
    rope_fn: Callable[[int], tuple[np.ndarray, np.ndarray]] = field(repr=False, compare=False,
                                                                     default=lambda n: _no_weights())
    # API 1.10: what the family changes in the forward, spelled out so that one definition
    # (dspark.sdk.family.forward) runs every family. Empty per-layer tuples mean "the plain default".
    windows: tuple[int | None, ...] = ()  # per layer: attends to its last this-many positions; None = all
    layer_rope: tuple[int | None, ...] = ()  # per layer: which RoPE table (rope_at's index); None = no RoPE
    rotary_dim: int = 0  # dims of each head RoPE rotates (partial rotary); 0 = head_dim
    attn_scale: float | None = None  # the attention scale; None = head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> tanh(scores / c) * c before the softmax
    final_softcap: float | None = None  # logits -> tanh(logits / c) * c
    embed_scale: float | None = None  # the embedding rows multiplied by this (Gemma: sqrt(hidden))
    activation: str = "silu"  # the gated MLP's activation: "silu", "gelu_tanh" or "gelu"
    rope_tables_fn: Callable[[int, int], tuple[np.ndarray, np.ndarray]] | None = field(
        repr=False, compare=False, default=None)
    # API 1.14: a quantized GGUF file's weights as stored (feature ``gguf_stored``); see :meth:`blocks`.
    blocks_fn: Callable[[], DecoderWeights] | None = field(repr=False, compare=False, default=None)

    @property
    def first(self) -> bool:
        return self.layers[0] == 0

    @property
    def last(self) -> bool:
        return self.layers[1] == self.num_layers

    def weights(self, stored: bool = False) -> DecoderWeights:
        """The model's weights; treat them as read-only. Float32 arrays (views where the engine holds
        float32), or with ``stored`` (API 1.12) the arrays in the precision the engine holds them, views of
        its tensors where the layout allows: ``float32``, ``float16`` or ``ml_dtypes.bfloat16`` (numpy has
        no bfloat16 of its own). A runtime that keeps weights in the model's precision reads them stored,
        so that no float32 copy of a half-precision model is made on the way; ``np.asarray(w, np.float32)``
        widens one where float32 is needed."""
        if stored and self.stored_weights_fn is not None:
            return self.stored_weights_fn()
        return self.weights_fn()

    def blocks(self) -> DecoderWeights | None:
        """API 1.14, for a spec with feature ``gguf_stored``: the file's weights as it stores them, in
        :class:`DecoderWeights`' layout, with every projection (and a head of its own) a
        :class:`dspark.types.blocks.BlockWeight` of the file's tensors in their own types (unpacked one at a
        time on request, read from its memory map); the embedding table a ``BlockWeight`` of one part
        ``[vocab, hidden]`` too (its rows are gathered; float32 where the file stores it as floats), and a tied
        head the same object; norms and biases float32. None where the engine has no such view of the file (a
        plugin then declines the spec)."""
        return None if self.blocks_fn is None else self.blocks_fn()

    def rope(self, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin tables ``[num_positions, head_dim]`` (float32, rotate-half layout: row p is
        ``cat(f, f)`` for the frequencies ``f`` at position p, attention scaling folded in)."""
        return self.rope_fn(num_positions)

    def rope_at(self, index: int, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
        """Table ``index`` of :attr:`layer_rope` (0: the model's RoPE; 1: Gemma 3's local one), as :meth:`rope`;
        ``[num_positions, rotary_dim]``. For LongRoPE (feature ``context_rope``), rows from
        ``max_position_embeddings`` on are the long factors' positions 0, 1, ...: the rows a sequence in
        long mode reads (:attr:`StepBatch.rope_positions`)."""
        if self.rope_tables_fn is None:
            if index != 0:
                raise ValueError(f"this DecoderSpec has no RoPE table {index}")
            return self.rope_fn(num_positions)
        return self.rope_tables_fn(index, num_positions)

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (it attends to its last this-many positions); None = every position."""
        return self.windows[layer] if self.windows else None

    def rope_of(self, layer: int) -> int | None:
        """Which RoPE table ``layer`` rotates q and k by; None = the layer has no RoPE."""
        return self.layer_rope[layer] if self.layer_rope else 0

    @property
    def rope_table_rows(self) -> int:
        """Rows of :meth:`rope_at` that cover every row a step may ask for (LongRoPE's long rows included)."""
        return self.max_position_embeddings * (2 if "context_rope" in self.features else 1)

    @property
    def rotary(self) -> int:
        """Dims of each head RoPE rotates (the rest pass through)."""
        return self.rotary_dim or self.head_dim

    def unsupported(self, supported: set[str] | frozenset[str]) -> str | None:
        """The reason to decline, naming the features outside ``supported``; None if all are."""
        missing = sorted(self.features - set(supported))
        if not missing:
            return None
        return "does not implement " + "; ".join(f"{m} ({FEATURES.get(m, m)})" for m in missing)


def _no_weights() -> Any:
    raise RuntimeError("this DecoderSpec carries no weights")


@dataclass
class StepBatch:
    """One forward step. Tokens of all sequences are flattened in sequence order.

    ``T`` rows, ``S`` sequences. Sequence ``s`` owns rows ``subsequence_begins[s] ..
    subsequence_begins[s + 1]``; its cached length before the step is ``past_lens[s]``;
    its block table is ``block_indices[block_indices_begins[s] : block_indices_begins[s + 1]]``
    and already covers ``past_lens[s]`` plus its new rows. Row ``r`` writes its K/V at
    ``slot_mapping[r]`` (block * block_size + offset) and attends causally to every
    earlier position of its own sequence.
    """

    positions: np.ndarray  # [T] int64
    past_lens: np.ndarray  # [S] int32
    subsequence_begins: np.ndarray  # [S + 1] int32
    block_indices: np.ndarray  # [sum of table lengths] int32
    block_indices_begins: np.ndarray  # [S + 1] int32
    slot_mapping: np.ndarray  # [T] int64
    max_context_len: int  # the longest past + new of any sequence
    # Rows whose logits are returned, ascending: each sequence's last row, or every row of a chunk that
    # wants them all (a verified draft, prompt logprobs). Ignored by a range that returns hidden states.
    logit_rows: np.ndarray  # [R] int64
    input_ids: np.ndarray | None = None  # [T] int64: a range that starts at layer 0
    hidden: np.ndarray | None = None  # [T, hidden] float32: a range that starts later
    exit_layer: int | None = None  # run layers [0, exit_layer), then the final norm and head
    # API 1.10: the row of each RoPE table a row rotates by, where it is not its position: a sequence in
    # LongRoPE's long mode reads row ``position + max_position_embeddings`` (DecoderSpec.rope_at). None:
    # the positions.
    rope_positions: np.ndarray | None = None  # [T] int64

    @property
    def rope_rows(self) -> np.ndarray:
        """Which row of the RoPE tables each row rotates by (``rope_positions``, else ``positions``)."""
        return self.positions if self.rope_positions is None else self.rope_positions

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.past_lens.shape[0])


@runtime_checkable
class CompiledDecoder(Protocol):
    """What ``dspark_compile_decoder`` returns.

    ``block_size``: tokens per KV block (the engine lays out its block tables in it).
    ``allocate(num_blocks)``: KV memory for that many blocks of every layer of the range, on the
    plugin's device; the engine may hold several (a drafter's own cache). ``step(kv, batch)``:
    runs one step against that memory, writing the new rows' K/V; returns float32 logits
    ``[len(batch.logit_rows), vocab]`` (a range ending at the last layer, or ``batch.exit_layer``
    set) or the hidden state ``[T, hidden]`` (a range ending earlier), as a numpy array or a
    CPU torch tensor. A step that raises is charged to the plugin and the engine moves to its
    next target; it must not leave other allocations unusable.

    Optional (API 1.11): ``cancel()``, called from another thread while a step runs past its
    deadline; the running step must then end soon by raising (OpenVINO's ``InferRequest.cancel``,
    llama.cpp's abort callback). A decoder that offers it runs its steps on the engine's own
    thread, a watchdog calling ``cancel`` at the deadline; one that does not runs them on a
    watchdog thread that abandons a step past its deadline (two thread wake-ups each step).

    Optional (API 1.13): ``greedy_steps(kv, batch, limits, stop_ids)``, several greedy decode steps
    in one call. ``batch`` holds one decode row per sequence (in paged mode its block tables already
    cover each sequence's length plus its limit); each step takes every sequence's argmax over the
    model's vocabulary as its next token and feeds it the step after, until sequence ``i`` has
    ``limits[i]`` tokens (``>= 1``) or gave a token of ``stop_ids`` (a frozenset); a decoder may end
    any sequence's run sooner (OpenVINO's ends every sequence's with the first, keeping the step's
    shape). Returns int64 ``[len(limits), max(limits)]``: each row's tokens in order, then -1.
    Afterwards the cache holds each sequence's row and every token it gave but the last, as that many
    ``step`` calls would leave it. The engine calls it only while every running request is plain
    greedy decoding and none waits; tokens past a stop string or a finished request are discarded.
    A call that raises or answers malformed rows is charged as a failed step.

    Optional (API 1.15, with ``greedy_steps``): ``end_run()``, called from another thread when a
    request arrives while a run may be in progress; the run then returns after the step in flight
    with the tokens so far (a call while no run is in progress does nothing). The engine's runs may
    then be long (``EngineConfig.decode_run_ms``): an arrival waits for one step, not a run.
    """

    block_size: int

    def allocate(self, num_blocks: int) -> Any: ...

    def step(self, kv: Any, batch: StepBatch) -> Any: ...


@dataclass
class SeqBatch:
    """One forward step of a decoder that keeps its KV per sequence (API 1.8).

    ``T`` rows. Before the rows run, every ``(seq_id, first)`` of ``drops`` drops that
    sequence's positions ``>= first`` (``first == 0``: the sequence is gone, its id will not
    come back). Then row ``r`` appends ``input_ids[r]`` at ``positions[r]`` to sequence
    ``seq_ids[r]`` and attends causally to that sequence's earlier positions. A sequence's rows
    are contiguous and continue from its last kept position (a new id starts at 0).
    """

    seq_ids: np.ndarray  # [T] int64: stable for a sequence's life; new ids appear, dropped ones do not return
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    # Rows whose logits are returned, ascending: each sequence's last row, or every row of a chunk that
    # wants them all (a verified draft, prompt logprobs).
    logit_rows: np.ndarray  # [R] int64
    drops: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, first position dropped)
    exit_layer: int | None = None  # only if the bid said exit_layers=True

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


@runtime_checkable
class SequenceDecoder(Protocol):
    """What ``dspark_compile_decoder`` returns for a bid with ``kv="sequence"`` (API 1.8).

    ``kv_mode``: ``"sequence"``. ``allocate(num_tokens, max_seqs)``: a KV store holding up to
    ``num_tokens`` cached tokens over at most ``max_seqs`` live sequences (the engine may hold
    several: a drafter's own); raise if the runtime cannot give that much. ``step(kv, batch)``:
    apply ``batch.drops``, run ``batch``'s rows, return float32 logits ``[len(batch.logit_rows),
    vocab]`` as a numpy array or CPU torch tensor. A step that raises is charged to the plugin and
    the engine moves to its next target, which recomputes the sequences from their tokens.
    Optional ``cancel()`` as for :class:`CompiledDecoder` (API 1.11), ``greedy_steps`` as there
    (API 1.13; apply the batch's drops first, as ``step`` does) and ``end_run()`` (API 1.15).
    """

    kv_mode: Literal["sequence"]

    def allocate(self, num_tokens: int, max_seqs: int) -> Any: ...

    def step(self, kv: Any, batch: SeqBatch) -> Any: ...


def is_sequence(decoder: object) -> bool:
    """True for a decoder that keeps its KV per sequence (:class:`SequenceDecoder`)."""
    return getattr(decoder, "kv_mode", "paged") == "sequence"
