"""The CUDA/Triton hardware plugin for dspark (plugin name ``cuda``).

Probes NVIDIA GPUs through NVML, measures their compute and memory bandwidth
with torch microbenchmarks (cached), bids a roofline estimate and runs
subgraphs with torch on the GPU. Quantized variants of MatMul subgraphs
(int8 / int4 weights) run on its Triton kernels (:mod:`.triton_quant`).
Importing this module is cheap: NVML, torch, Triton and the plugin's own
modules are imported inside the hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dspark.hookspecs import hookimpl

if TYPE_CHECKING:
    from dspark.graph.model import Subgraph
    from dspark.types import Bid, Device, Executable, QuantSpec, Unavailable

DSPARK_API_VERSION = "1.2"  # dspark_quantize, and run_torch on executables


@hookimpl
def dspark_probe_devices(refresh: bool) -> list[Device | Unavailable]:
    from dspark_plugins_cuda.probe import probe

    return probe(refresh)


@hookimpl
def dspark_bid(subgraph: Subgraph, device: Device) -> Bid | None:
    from dspark_plugins_cuda.bid import bid

    return bid(subgraph, device)


@hookimpl
def dspark_compile(subgraph: Subgraph, device: Device) -> Executable | None:
    if subgraph.quantized_by == "cuda":
        from dspark_plugins_cuda.quantize import QuantExecutable

        return QuantExecutable(subgraph, device.id)
    if subgraph.quantized_by is not None:
        return None  # another plugin's variant: never bid on (see bid.py)
    from dspark_plugins_cuda.executable import CudaExecutable

    return CudaExecutable(subgraph, device.id)


@hookimpl
def dspark_quantize(subgraph: Subgraph, device: Device, spec: QuantSpec) -> Subgraph | None:
    from dspark_plugins_cuda.quantize import quantize

    return quantize(subgraph, device, spec)
