"""The dspark plugin contract (API version 1.15).

A plugin is a module or object whose functions carry the ``@dspark.hookimpl``
marker and whose names are the hooks below. It declares the API version it
was written against as ``DSPARK_API_VERSION = "1.16"``; the core accepts the
same major version with a minor version not newer than its own (a "1.0"
plugin keeps working).

The public plugin API is this module, :mod:`dspark.types`, :mod:`dspark.graph`,
:mod:`dspark.sdk`, :mod:`dspark.testing` and the top-level names of :mod:`dspark`;
a plugin imports nothing else from dspark. API 1.4 added :mod:`dspark.sdk` as that
declared surface (the 1.3 module names ``dspark.cost``, ``quant``, ``cache``,
``calibration``, ``hostinfo`` and ``log`` still work). API 1.5 added control flow
to the graph: ``Op.captures``, ``TensorSpec.rank_known`` and the body helpers of
:mod:`dspark.graph`. API 1.6 added whole-decoder targets for the LLM engine:
``dspark_decoder_bid`` and ``dspark_compile_decoder``, with their types in
:mod:`dspark.sdk.decoder`. API 1.7 added real models to :mod:`dspark.testing`
(``real_model``, ``activations``, the demo block) for checking kernels on real activations.
API 1.8 added decoders that keep the KV per sequence themselves (``DecoderBid.kv="sequence"``,
:class:`~dspark.sdk.decoder.SequenceDecoder`, :class:`~dspark.sdk.decoder.SeqBatch`). API 1.9 gives
drafters that ask for them (a ``target_rows`` attribute) the target's own output rows at a
sequence's last positions (``DraftRequest.target_rows``), for feature-level draft heads.
API 1.10 writes every model family's decoder once (:func:`dspark.sdk.family.forward`) over ops a
plugin supplies (:class:`~dspark.sdk.family.DecoderOps`); ``DecoderSpec`` spells out what a family
changes (per-layer windows and RoPE tables, scales, soft-caps, activation) and ``LayerWeights``
carries Gemma's output norms. API 1.11 lets a compiled decoder offer ``cancel()``: its steps then
run on the engine's own thread, a watchdog cancelling one that passes its deadline, instead of on a
watchdog thread. API 1.12 hands a decoder the model's weights in the precision the engine holds
them (``DecoderSpec.weights(stored=True)``), so no float32 copy of a half-precision model is made.
API 1.13 lets a compiled decoder offer ``greedy_steps``: several greedy decode
steps in one call, the engine's own work paid once per run instead of once per token.
API 1.14 hands a decoder that runs a quantized GGUF file as stored (feature ``gguf_stored``) the
file's tensors in their own types (``DecoderSpec.blocks()``, :mod:`dspark.types.blocks`): blocks
unpacked to integers, scales and zero points, so a runtime with grouped integer kernels holds them
without a float copy. API 1.15 lets a decoder that runs greedy runs offer ``end_run()``: called from
any thread when a request arrives, it ends the run in progress after its step in flight, so an
arrival waits for one step rather than a whole run.

How the core calls hooks. Unlike plain pluggy, the core calls each plugin's
implementation on its own, in a worker thread with a timeout, so that one
plugin cannot break the others: a plugin that raises, returns something that
does not validate, or does not return in time is reported (``dspark devices``
shows status ``failed`` and the reason), left out of every later call, and the
run goes on. Returning ``None`` always means "abstain". Setting
``DSPARK_TRACE=1`` logs every call with its plugin, duration and outcome.

Device-scoped hooks (``dspark_bid``, ``dspark_compile``, ``dspark_quantize``,
``dspark_decoder_bid``, ``dspark_compile_decoder``)
are only ever called with a :class:`~dspark.types.Device` that the same plugin
returned from its own ``dspark_probe_devices``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from dspark.graph import Subgraph
    from dspark.types.decoder import CompiledDecoder, DecoderSpec
    from dspark.types import (
        Bid,
        DecoderBid,
        Device,
        DrafterSpec,
        Executable,
        QuantSpec,
        TargetModel,
        Unavailable,
    )

PROJECT = "dspark"
API_VERSION = "1.16"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def dspark_probe_devices(refresh: bool) -> list[Device | Unavailable] | None:
    """Report the devices this plugin can drive, with their capabilities.

    When: once per inventory (``dspark devices``, before planning, and again
    when the placer re-plans because load changed), for every plugin that is
    not blocked or failed.

    :param refresh: True when the user asked to re-measure (``dspark devices
        --refresh``): drop cached microbenchmark results and measure again.
        False means cached measurements may be used; live figures (free
        memory, utilization) must always be current.

    Return a list of :class:`~dspark.types.Device`, one per (physical device,
    runtime) the plugin drives, plus an :class:`~dspark.types.Unavailable`
    (what, reason) for each device or runtime it found but cannot drive (an
    execution provider without its driver): these are listed under the
    plugin, never skipped silently. ``Device.id`` names the physical device
    (``cpu``, ``cuda:0``, ``npu:0``) so the same silicon driven by several
    plugins is merged in the inventory. Raise
    :class:`~dspark.types.HardwareUnavailable` with a reason when the hardware
    is absent (status ``no hardware``); an empty list is treated the same way.

    Combining: all plugins are called; their lists are concatenated and merged
    by device id. This must be fast (``dspark devices`` starts in under 1.5 s):
    import heavy runtimes only here, never at module import, and cache
    microbenchmarks on disk (:mod:`dspark.host.cache`).
    """


@hookspec
def dspark_bid(subgraph: Subgraph, device: Device) -> Bid | None:
    """Offer to run ``subgraph`` on ``device``, with the predicted cost.

    When: during planning, for each candidate subgraph (single ops and
    connected runs of ops) and each device the plugin reported.

    :param subgraph: the ops to run; may be a quantized variant this plugin
        produced with ``dspark_quantize`` (``subgraph.quantized_by`` is then
        the plugin's name). Shapes may contain symbolic dims.
    :param device: one of the plugin's own devices.

    Return a :class:`~dspark.types.Bid` (predicted latency of one run, peak
    device memory, the precision it computes in), or ``None`` to abstain
    because the runtime cannot run some op of the subgraph. A bid is a
    promise: ``dspark_compile`` must then succeed for the same arguments, and
    the outputs must match the fp32 reference within the tolerance of the
    stated precision (:data:`dspark.types.TOLERANCES`).

    Combining: all plugins are called; every bid is kept and the placer picks
    the cheapest assignment, counting transfers between devices. Start from
    :func:`dspark.sdk.cost.roofline` and refine it by timing the real subgraph
    (cached per ``subgraph.signature()`` and device).
    """


@hookspec
def dspark_compile(subgraph: Subgraph, device: Device) -> Executable | None:
    """Compile ``subgraph`` for ``device`` and return something that runs it.

    When: after planning, once per partition this plugin won, and by the
    conformance kit. Only the winning plugin is called.

    :param subgraph: the partition, as bid on (possibly a quantized variant).
    :param device: one of the plugin's own devices.

    Return an :class:`~dspark.types.Executable`: ``run(inputs)`` takes a dict
    of host numpy arrays keyed by ``subgraph.inputs`` and returns a dict keyed
    by ``subgraph.outputs``. Weights are ``subgraph.graph.initializers``.
    ``None`` means the plugin cannot compile it after all, which is reported
    as a broken promise (the bid was wrong).

    Combining: only the owner of the winning bid is called.
    """


@hookspec
def dspark_quantize(subgraph: Subgraph, device: Device, spec: QuantSpec) -> Subgraph | None:
    """Produce a quantized variant of ``subgraph`` for ``device``.

    When: during planning with quantization enabled, for subgraphs whose
    weights the quantization plan allows to be lowered to ``spec``.

    :param subgraph: the float subgraph (weights in ``graph.initializers``).
    :param device: one of the plugin's own devices.
    :param spec: weight bits (8 or 4), per-channel or group-wise with group
        size, symmetric or not, and whether activations are quantized
        dynamically.

    Return a new :class:`~dspark.graph.model.Subgraph` over the same ops with
    ``quantized_by`` set to the plugin's name, ``quant_spec`` to ``spec`` and
    ``payload`` holding whatever the plugin's kernels need (weights repacked
    into the layout its kernels read). The core then asks the same plugin to
    ``dspark_bid`` and ``dspark_compile`` the variant, so precision and
    placement are chosen together. ``None`` means the plugin has no kernel for
    this spec on this device.

    The LLM engine calls this once per projection it quantizes, with
    :func:`dspark.sdk.quant.linear_subgraph` (one MatMul ``x[tokens, K] @ W[K, N]``,
    ``tokens`` symbolic): the compiled variant must take any row count, and
    since API 1.2 its executable may offer ``run_torch`` (see
    :func:`dspark.types.torch_runner`) so the engine's tensors need no host
    round trip. The canonical quantized values are
    :func:`dspark.sdk.quant.quantize_weight`'s; the variant's output must match
    :func:`dspark.sdk.quant.reference_linear` within the spec's tolerance.

    Combining: all plugins driving the device are called; each variant is bid
    on separately.
    """


@hookspec
def dspark_drafters(target: TargetModel) -> list[DrafterSpec] | None:
    """Offer drafters for speculative decoding of ``target``.

    When: when an engine with speculative decoding starts, once per target
    model.

    :param target: the verifier model: name, local path, architecture, vocab
        size, layer count, tokenizer fingerprint; ``properties`` carries the
        checkpoint's extra config (e.g. ``early_exit_layers``) and, since API
        1.1, ``runtime`` is the in-process engine (``runtime.runner``,
        ``runtime.cache``) when the target runs in this process.

    Return a list of :class:`~dspark.types.DrafterSpec` (name, kind, and a
    ``create()`` factory for a :class:`~dspark.types.Drafter`), or ``None``
    when the plugin has nothing for this model (e.g. a tokenizer mismatch).
    A drafter needs only ``propose(tokens, k)``; since API 1.1 it may add
    ``propose_batch(requests)``, ``commit(seq_id, num_tokens)`` and
    ``release(seq_id)`` (see :class:`~dspark.types.Drafter`); since API 1.3 a
    copying drafter may say where its draft was copied from (``Draft.source``),
    which the acceptance predictor learns from. Drafters run in
    the engine's thread during generation: one that raises or returns a
    malformed draft is reported and disabled for the rest of the run, and the
    requests go on without it.

    Combining: all plugins are called; every offer is kept, and the
    speculative-decoding controller chooses among them at run time from
    measured acceptance and cost.
    """


@hookspec
def dspark_decoder_bid(decoder: DecoderSpec, device: Device) -> DecoderBid | None:
    """Offer to run the LLM engine's whole decoder (or ``decoder.layers``, a range of it) on ``device``.

    When: once per engine start with ``decoder="auto"`` (the default) or a
    target naming this plugin, for each device the plugin reported; and by
    ``dspark devices --decoders MODEL``. Since API 1.6.

    :param decoder: the model (config, ``features`` it needs beyond a plain
        Llama decoder, ``dtype`` the engine computes in, ``quantization`` plan if
        any) and the layer range asked for; ``decoder.weights()`` gives the
        weights but bidding should not need them.
    :param device: one of the plugin's own devices.

    Return a :class:`~dspark.sdk.decoder.DecoderBid`: the runtime, the KV block
    size it needs (or None for any), the memory it will take (weights, KV per
    token), whether it runs early exits; or one with ``declined`` set to say
    why not (``DecoderSpec.unsupported`` names missing features), or ``None``
    to abstain silently. A bid is a promise: ``dspark_compile_decoder`` must then
    succeed and its logits match the torch reference's (the engine checks on a
    probe step before trusting it). No latency is asked: the engine times every
    bidder's compiled decoder at its real step shapes (decode at batch 1, 8 and
    32, a prefill chunk, a k=8 verification), caches the timings per runtime
    version and model fingerprint, and runs the model where they are lowest.

    Combining: all plugins are called; every bid is kept and compared with the
    built-in torch runner's.
    """


@hookspec
def dspark_compile_decoder(decoder: DecoderSpec, device: Device) -> CompiledDecoder | None:
    """Compile the decoder (range) this plugin bid on, for ``device``.

    When: for each bid being timed, and for the winner at engine start. The
    same spec may be compiled more than once per process (cache what you can).

    :param decoder: the spec this plugin bid on (a whole decoder or a range).
    :param device: one of the plugin's own devices, the one it bid for.

    Return a :class:`~dspark.sdk.decoder.CompiledDecoder`: ``block_size``,
    ``allocate(num_blocks)`` (KV memory on the device, in the engine's blocks)
    and ``step(kv, batch)`` (one :class:`~dspark.sdk.decoder.StepBatch`; logits
    of ``batch.logit_rows``, or the hidden state for a range that stops early).
    For a bid with ``kv="sequence"`` (API 1.8) return a
    :class:`~dspark.sdk.decoder.SequenceDecoder` instead: ``allocate(num_tokens,
    max_seqs)`` and ``step(kv, batch)`` over a :class:`~dspark.sdk.decoder.SeqBatch`
    (sequence ids, tokens, positions, logit rows and the positions to drop); the
    runtime keeps each sequence's KV itself.
    ``None`` is a broken promise and is reported as one. Steps run in the
    engine's thread, outside this hook's timeout; a step that raises or hangs is
    charged to the plugin and the engine moves the model to its next target,
    recomputing the sequences' KV there.

    Combining: only the plugin whose bid is being timed or has won is called.
    """


HOOK_NAMES: tuple[str, ...] = (
    "dspark_probe_devices", "dspark_bid", "dspark_compile", "dspark_quantize", "dspark_drafters",
    "dspark_decoder_bid", "dspark_compile_decoder",
)
