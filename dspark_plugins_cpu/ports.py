"""Which port of an OpenVINO model each subgraph input is fed through.

The ONNX frontend keeps tensor names on ports, with two exceptions: a graph
input that feeds an output unchanged (Dropout at inference, Identity) takes
the output's name, and a zero-size input (an empty ``axes``) is folded into a
constant and has no port at all.
"""

from __future__ import annotations

from typing import Any

from dspark.graph import Subgraph


def input_ports(subgraph: Subgraph, ports: list[Any]) -> dict[str, int | None]:
    """Port index per subgraph input; None for a zero-size input the model folded away.

    Raises ``KeyError`` naming the inputs no port can be found for.
    """
    names = list(subgraph.inputs)
    found: dict[str, int | None] = {}
    for name in names:
        hit = next((i for i, port in enumerate(ports) if name in port.get_names()), None)
        if hit is not None:
            found[name] = hit
    free = [i for i in range(len(ports)) if i not in found.values()]
    missing = [n for n in names if n not in found]
    tensors = subgraph.graph.tensors
    folded = [n for n in missing if n in tensors and tensors[n].numel() == 0]
    renamed = [n for n in missing if n not in folded]
    if len(renamed) == len(free):  # the frontend keeps parameter order: the renamed ones are the free ports
        found.update(zip(renamed, free, strict=True))
        found.update(dict.fromkeys(folded))
    elif len(missing) == len(free):
        found.update(zip(missing, free, strict=True))
    else:
        raise KeyError(f"the OpenVINO model has no input port for {missing} "
                       f"(ports: {[sorted(p.get_names()) for p in ports]})")
    return {n: found[n] for n in names}


def output_ports(subgraph: Subgraph, ports: list[Any]) -> dict[str, int]:
    """Port index per subgraph output; ``KeyError`` naming an output without a port."""
    out: dict[str, int] = {}
    for name in subgraph.outputs:
        hit = next((i for i, port in enumerate(ports) if name in port.get_names()), None)
        if hit is None:
            raise KeyError(f"the OpenVINO model has no output port named {name!r}")
        out[name] = hit
    return out
