"""A model no single device holds: contiguous layer ranges on several devices, chained.

Devices are filled in the order given (the caller puts the faster first), each
with as many layers as its free memory holds at the engine's KV budget; the
embedding goes with the first range and the head with the last. Each range is
bid on and compiled by the plugin that bid on the whole model for that device.
Between ranges the hidden state ``[tokens, hidden]`` is handed over; its price
per step (bytes over the slower device's host link, zero within host memory)
is reported with the plan, and the timed step includes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dspark.sdk.decoder import StepBatch

if TYPE_CHECKING:
    from dspark.host.plugin_manager import PluginHost
    from dspark.sdk.decoder import CompiledDecoder, DecoderSpec
    from dspark.types import DecoderBid, Device


@dataclass
class Part:
    plugin: str
    device: Device
    layers: tuple[int, int]
    decoder: CompiledDecoder


class ChainDecoder:
    """A :class:`~dspark.sdk.decoder.CompiledDecoder` over ranges: tokens in, hidden across, logits out."""

    def __init__(self, parts: list[Part], block_size: int) -> None:
        self.parts = parts
        self.block_size = block_size
        self.failed_part: Part | None = None
        for p in parts:
            if p.decoder.block_size != block_size:
                p.decoder.block_size = block_size  # a range that bid block_size=None takes the chain's

    def allocate(self, num_blocks: int) -> list[Any]:
        return [p.decoder.allocate(num_blocks) for p in self.parts]

    def step(self, kv: list[Any], batch: StepBatch) -> Any:
        if batch.exit_layer is not None and batch.exit_layer > self.parts[0].layers[1]:
            raise NotImplementedError("an early exit past the first range's layers")
        last = 0 if batch.exit_layer is not None else len(self.parts) - 1
        hidden: np.ndarray | None = None
        self.failed_part = None
        for i, (p, k) in enumerate(zip(self.parts, kv, strict=True)):
            b = batch if i == 0 else replace(batch, input_ids=None, hidden=hidden)
            try:
                out = p.decoder.step(k, b)
            except Exception as exc:  # charged to this range's plugin and device, not to the chain
                self.failed_part = p
                raise RuntimeError(f"{p.plugin}@{p.device.id} layers {p.layers[0]}:{p.layers[1]}: "
                                   f"{type(exc).__name__}: {exc}") from exc
            if i == last:
                return out
            hidden = np.ascontiguousarray(np.asarray(out, dtype=np.float32))
        raise AssertionError("unreachable")

    def describe(self) -> str:
        return " + ".join(f"{p.plugin}@{p.device.id}[{p.layers[0]}:{p.layers[1]}]" for p in self.parts)


def layer_bytes(bid: DecoderBid, spec: DecoderSpec, max_tokens: int) -> float:
    """Memory one layer takes on the bidder's device: its share of the weights and of the KV budget."""
    edges = 2 * spec.vocab_size * spec.hidden_size * 4  # embedding and head, counted on the whole-model bid
    per_layer_w = max(0, bid.weight_bytes - edges) / spec.num_layers
    return per_layer_w + bid.kv_bytes_per_token / spec.num_layers * max_tokens


def assign(bids: list[tuple[DecoderBid, Device]], spec: DecoderSpec, max_tokens: int) -> list[tuple[DecoderBid, Device, tuple[int, int]]] | None:
    """Consecutive layer ranges over ``bids`` (in order) by free memory; None if all of them cannot hold it."""
    out = []
    start = 0
    for bid, dev in bids:
        if start >= spec.num_layers:
            break
        free = dev.memory_free_bytes
        per = layer_bytes(bid, spec, max_tokens)
        fits = spec.num_layers - start if free is None or per <= 0 else int(free // per)
        # The first range holds the embedding, the last the head: reserve them where they go.
        fits = min(fits, spec.num_layers - start)
        if fits <= 0:
            continue
        out.append((bid, dev, (start, start + fits)))
        start += fits
    return out if start == spec.num_layers and len(out) > 1 else None


def handover_s(spec: DecoderSpec, parts: list[tuple[DecoderBid, Device, tuple[int, int]]], tokens: int) -> float:
    """Seconds per step to move the hidden state across every boundary, at the devices' host links."""
    total = 0.0
    nbytes = tokens * spec.hidden_size * 4
    for (_, a, _), (_, b, _) in zip(parts, parts[1:], strict=False):
        links = [d.host_link_bandwidth_bytes_per_s for d in (a, b) if d.host_link_bandwidth_bytes_per_s]
        total += sum(nbytes / bw for bw in links)  # device -> host -> device; host memory costs nothing here
    return total


def build(host: PluginHost, whole: DecoderSpec, plan: list[tuple[DecoderBid, Device, tuple[int, int]]]
          ) -> ChainDecoder | str:
    """Bid on and compile every range; the chain, or why it cannot be built."""
    parts: list[Part] = []
    block: int | None = None
    for bid, dev, layers in plan:
        spec = replace(whole, layers=layers)
        rb = host.call(bid.plugin, "dspark_decoder_bid", decoder=spec, device=dev)
        if rb is None or rb.declined:
            return f"{bid.plugin}@{dev.id} declined layers {layers[0]}:{layers[1]}" + (
                f": {rb.declined}" if rb is not None else "")
        if rb.block_size is not None:
            if block is not None and rb.block_size != block:
                return f"ranges need different KV block sizes ({block}, {rb.block_size})"
            block = rb.block_size
        dec = host.call(bid.plugin, "dspark_compile_decoder", decoder=spec, device=dev)
        if dec is None:
            return f"{bid.plugin}@{dev.id} bid on layers {layers[0]}:{layers[1]}, then did not compile"
        parts.append(Part(bid.plugin, dev, layers, dec))
    return ChainDecoder(parts, block or parts[0].decoder.block_size)
