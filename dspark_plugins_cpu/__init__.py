"""dspark hardware plugin for CPUs (and other OpenVINO devices) through OpenVINO.

Registered as entry point ``cpu``. Importing this package is cheap: OpenVINO
itself is imported inside the hooks, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dspark.hookspecs import hookimpl

if TYPE_CHECKING:
    from dspark.graph import Subgraph
    from dspark.sdk.decoder import CompiledDecoder, DecoderSpec
    from dspark.types import Bid, DecoderBid, Device, Executable, QuantSpec, Unavailable

DSPARK_API_VERSION = "1.16"  # the decoder as ops of dspark.sdk.family; cancel(); weights as stored; greedy_steps;
# GGUF blocks as stored; end_run


@hookimpl
def dspark_probe_devices(refresh: bool) -> list[Device | Unavailable]:
    from dspark_plugins_cpu.probe import probe

    return probe(refresh)


@hookimpl
def dspark_bid(subgraph: Subgraph, device: Device) -> Bid | None:
    from dspark_plugins_cpu.bidding import bid

    return bid(subgraph, device)


@hookimpl
def dspark_compile(subgraph: Subgraph, device: Device) -> Executable | None:
    from dspark_plugins_cpu.executable import compile_subgraph

    return compile_subgraph(subgraph, device)


@hookimpl
def dspark_quantize(subgraph: Subgraph, device: Device, spec: QuantSpec) -> Subgraph | None:
    from dspark_plugins_cpu.quantize import quantize

    return quantize(subgraph, device, spec)


@hookimpl
def dspark_decoder_bid(decoder: DecoderSpec, device: Device) -> DecoderBid | None:
    from dspark_plugins_cpu.decoder import decoder_bid

    return decoder_bid(decoder, device)


@hookimpl
def dspark_compile_decoder(decoder: DecoderSpec, device: Device) -> CompiledDecoder | None:
    from dspark_plugins_cpu.decoder import compile_decoder

    return compile_decoder(decoder, device)
