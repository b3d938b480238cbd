"""dspark plugin ``npu``: ONNX Runtime execution providers (QNN, OpenVINO, CANN, CUDA, CPU ...).

Every provider the installed ONNX Runtime build lists is tried for real and
reported as a device or as unavailable with the reason. Importing this
module imports neither onnxruntime nor onnx: the hooks do, so ``dspark
devices`` stays fast.

Modules: :mod:`.providers` (provider -> device table), :mod:`.session`
(sessions that never fall back silently), :mod:`.bench` (cached
microbenchmarks), :mod:`.probe`, :mod:`.support` (what a provider runs and
answers right), :mod:`.bidding` (prices only), :mod:`.executable`,
:mod:`.quantize` (int8/int4 variants in ONNX Runtime's quantized formats),
:mod:`.decoder` (with :mod:`.decoder.graph`: the whole LLM decoder as one graph
around ``com.microsoft.GroupQueryAttention``, API 1.6).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dspark.hookspecs import hookimpl

if TYPE_CHECKING:
    from dspark.graph import Subgraph
    from dspark.sdk import decoder as sdk_decoder
    from dspark.types import Bid, DecoderBid, Device, QuantSpec, Unavailable
    from dspark_plugins_npu.decoder import OrtDecoder
    from dspark_plugins_npu.executable import OrtExecutable

DSPARK_API_VERSION = "1.16"  # the decoder as ops of dspark.sdk.family; its device list cached
PLUGIN_NAME = "npu"


@hookimpl
def dspark_probe_devices(refresh: bool) -> list[Device | Unavailable]:
    from dspark_plugins_npu.probe import probe

    return probe(refresh)


@hookimpl
def dspark_bid(subgraph: Subgraph, device: Device) -> Bid | None:
    from dspark_plugins_npu.bidding import bid

    return bid(subgraph, device, PLUGIN_NAME)


@hookimpl
def dspark_compile(subgraph: Subgraph, device: Device) -> OrtExecutable | None:
    from dspark_plugins_npu.executable import compile_subgraph

    return compile_subgraph(subgraph, device, PLUGIN_NAME)


@hookimpl
def dspark_quantize(subgraph: Subgraph, device: Device, spec: QuantSpec) -> Subgraph | None:
    from dspark_plugins_npu import support
    from dspark_plugins_npu.executable import ep_of
    from dspark_plugins_npu.quantize import quantize

    if "execution_provider" not in device.properties:
        return None
    ep, index = ep_of(device)
    # A format counts only if a session on the EP really runs it (strictly off the CPU).
    return quantize(subgraph, device, spec, PLUGIN_NAME,
                    accepts=lambda variant: support.why_not(variant, ep, index) is None)


@hookimpl
def dspark_decoder_bid(decoder: sdk_decoder.DecoderSpec, device: Device) -> DecoderBid | None:
    from dspark_plugins_npu.decoder import decoder_bid

    return decoder_bid(decoder, device)


@hookimpl
def dspark_compile_decoder(decoder: sdk_decoder.DecoderSpec, device: Device) -> OrtDecoder | None:
    from dspark_plugins_npu.decoder import compile_decoder

    return compile_decoder(decoder, device)
