"""A model no single device holds: compiled decoders on consecutive layer ranges, chained.

The ranges are the device map's (:func:`~dspark.llm.device_map.layers.map_layers`, the same placer that
spreads the torch runner's layers), over the devices whose plugins bid on the whole model but cannot hold
it, with each layer sized as those bids size it. A compiled range holds the embedding with its first layer
and the head with its last, so the map's embedding and head go with the first and last ranges. Each range
is bid on and compiled by the plugin that bid on the whole model for that device. Between ranges the
hidden state ``[tokens, hidden]`` is handed over; its price per step (bytes over the devices' host links,
zero within host memory) is reported with the map, and the timed step includes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dspark.llm.device_map.layers import map_layers
from dspark.llm.device_map.pieces import DeviceMap
from dspark.sdk.decoder import StepBatch

if TYPE_CHECKING:
    from dspark.host.inventory import Inventory
    from dspark.host.plugin_manager import PluginHost
    from dspark.llm.runner.types import ModelConfig
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


def layer_bytes(bid: DecoderBid, spec: DecoderSpec, max_tokens: int) -> tuple[int, int]:
    """One layer's (weight, KV) bytes on the bidder's device: its share of the whole-model bid."""
    edges = 2 * spec.vocab_size * spec.hidden_size * 4  # embedding and head, counted on the whole-model bid
    return (max(0, bid.weight_bytes - edges) // spec.num_layers,
            bid.kv_bytes_per_token * max_tokens // spec.num_layers)


def first_per_device(bids: list[tuple[DecoderBid, Device]]) -> dict[str, tuple[DecoderBid, Device]]:
    """Device id -> its first bid and device: who runs that device's ranges."""
    out: dict[str, tuple[DecoderBid, Device]] = {}
    for bid, dev in bids:
        out.setdefault(dev.id, (bid, dev))
    return out


def map_ranges(host: PluginHost, inv: Inventory, config: ModelConfig, spec: DecoderSpec,
               bids: list[tuple[DecoderBid, Device]], max_tokens: int, dtype: str) -> DeviceMap | str:
    """The device map of the layers over the bidders' devices (the first bid per device runs it), or why not."""
    first = {d: b for d, (b, _) in first_per_device(bids).items()}
    sizes = [layer_bytes(b, spec, max_tokens) for b in first.values()]
    try:
        placed = map_layers(config, host, inv, max_model_len=spec.max_position_embeddings or max_tokens,
                            max_total_tokens=max_tokens, dtype=dtype, decode_batch=min(spec.max_num_seqs, 8),
                            devices=list(first), layer_bytes=(max(w for w, _ in sizes), max(k for _, k in sizes)),
                            runs={d: b.plugin for d, b in first.items()})
    except Exception as exc:  # the placer names the budget or op that made it impossible
        return f"the devices that bid cannot hold it together ({type(exc).__name__}: {exc})"
    stages = placed.stages()
    if len(stages) < 2:
        return f"the placer put every layer on {placed.layers[0].device_id}, whose bid does not hold the model"
    # A compiled range holds the embedding with its first layer and the head with its last.
    placed.embed = replace(placed.embed, device_id=stages[0].device_id, plugin=stages[0].runs)
    placed.head = replace(placed.head, device_id=stages[-1].device_id, plugin=stages[-1].runs)
    return placed


def handover_s(spec: DecoderSpec, placed: DeviceMap, devices: dict[str, Device], tokens: int) -> float:
    """Seconds per step to move the hidden state across every boundary, at the devices' host links."""
    total = 0.0
    nbytes = tokens * spec.hidden_size * 4
    stages = placed.stages()
    for a, b in zip(stages, stages[1:], strict=False):
        links = [bw for d in (a.device_id, b.device_id) if (bw := devices[d].host_link_bandwidth_bytes_per_s)]
        total += sum(nbytes / bw for bw in links)  # device -> host -> device; host memory costs nothing here
    return total


def build(host: PluginHost, whole: DecoderSpec, placed: DeviceMap, devices: dict[str, Device]
          ) -> ChainDecoder | str:
    """Bid on and compile every range of the map; the chain, or why it cannot be built."""
    parts: list[Part] = []
    block: int | None = None
    for stage in placed.stages():
        dev, layers, plugin = devices[stage.device_id], (stage.start, stage.end), stage.runs
        spec = replace(whole, layers=layers)
        rb = host.call(plugin, "dspark_decoder_bid", decoder=spec, device=dev)
        if rb is None or rb.declined:
            return f"{plugin}@{dev.id} declined layers {layers[0]}:{layers[1]}" + (
                f": {rb.declined}" if rb is not None else "")
        if rb.block_size is not None:
            if block is not None and rb.block_size != block:
                return f"ranges need different KV block sizes ({block}, {rb.block_size})"
            block = rb.block_size
        dec = host.call(plugin, "dspark_compile_decoder", decoder=spec, device=dev)
        if dec is None:
            return f"{plugin}@{dev.id} bid on layers {layers[0]}:{layers[1]}, then did not compile"
        parts.append(Part(plugin, dev, layers, dec))
    return ChainDecoder(parts, block or parts[0].decoder.block_size)
