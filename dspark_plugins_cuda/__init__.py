"""The CUDA/Triton hardware plugin for dspark (plugin name ``cuda``).

Probes NVIDIA GPUs through NVML, measures their compute and memory bandwidth
with torch microbenchmarks (cached), bids a roofline estimate and runs
subgraphs with torch on the GPU. Importing this module is cheap: NVML, torch
and the plugin's own modules are imported inside the hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dspark.hookspecs import hookimpl

if TYPE_CHECKING:
    from dspark.graph import Subgraph
    from dspark.types import Bid, Device, Executable, Unavailable

DSPARK_API_VERSION = "1.0"


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
    if subgraph.quantized_by is not None:
        return None  # never bid on it (see bid.py)
    from dspark_plugins_cuda.executable import CudaExecutable

    return CudaExecutable(subgraph, device.id)
