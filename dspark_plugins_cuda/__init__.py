"""The CUDA/Triton hardware plugin for dspark (plugin name ``cuda``).

Probes NVIDIA GPUs through NVML, measures their compute and memory bandwidth
with torch microbenchmarks (cached), bids a roofline estimate and runs
subgraphs with torch on the GPU. Quantized variants of MatMul subgraphs
(int8 / int4 weights) run on its Triton kernels (:mod:`.triton_quant`). The
LLM engine's whole decoder runs in torch with Triton paged attention and CUDA
graphs for decode steps (:mod:`.decoder`, :mod:`.decoder.triton_paged`).
Importing this module is cheap: NVML, torch, Triton and the plugin's own
modules are imported inside the hooks.

Modules by role, as in every hardware plugin: :mod:`.probe` (devices),
:mod:`.support` (what it can run, pure), :mod:`.bidding` (prices only),
:mod:`.executable` (dspark_compile), :mod:`.quantize` (dspark_quantize).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dspark.hookspecs import hookimpl

if TYPE_CHECKING:
    from dspark.graph import Subgraph
    from dspark.sdk import decoder as sdk_decoder
    from dspark.types import Bid, DecoderBid, Device, Executable, QuantSpec, Unavailable

# 1.6: whole-decoder targets (dspark_decoder_bid / dspark_compile_decoder). Imports only the public
# plugin API (dspark.sdk for the reference executor and the decoder types).
DSPARK_API_VERSION = "1.10"  # the decoder as ops of dspark.sdk.family


@hookimpl
def dspark_probe_devices(refresh: bool) -> list[Device | Unavailable]:
    from dspark_plugins_cuda.probe import probe

    return probe(refresh)


@hookimpl
def dspark_bid(subgraph: Subgraph, device: Device) -> Bid | None:
    from dspark_plugins_cuda.bidding import bid

    return bid(subgraph, device)


@hookimpl
def dspark_compile(subgraph: Subgraph, device: Device) -> Executable | None:
    from dspark_plugins_cuda.executable import compile_subgraph

    return compile_subgraph(subgraph, device)


@hookimpl
def dspark_quantize(subgraph: Subgraph, device: Device, spec: QuantSpec) -> Subgraph | None:
    from dspark_plugins_cuda.quantize import quantize

    return quantize(subgraph, device, spec)


@hookimpl
def dspark_decoder_bid(decoder: sdk_decoder.DecoderSpec, device: Device) -> DecoderBid | None:
    from dspark_plugins_cuda.decoder import decoder_bid

    return decoder_bid(decoder, device)


@hookimpl
def dspark_compile_decoder(decoder: sdk_decoder.DecoderSpec, device: Device) -> sdk_decoder.CompiledDecoder | None:
    from dspark_plugins_cuda.decoder import compile_decoder

    return compile_decoder(decoder, device)
