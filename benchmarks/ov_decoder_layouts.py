"""The cpu plugin's decoder graph in other layouts: does OpenVINO fuse them differently, and is a step faster?

Usage: .venv/bin/python benchmarks/ov_decoder_layouts.py [--batch 1,8] [--rounds 40]

Issue 20's note suspected the forward's gap to OpenVINO GenAI lies in the
graph's layout: GenAI's graph (exported from transformers) has separate q, k,
v, gate and up projections on rank-3 activations with f16 weight constants,
ours fused QKV and gate_up on rank-2 activations with f32 constants. The CPU
plugin has LLM-specific fusions (``QKVProjection``, ``LLMMLP``) whose patterns
depend on exactly that. This builds the embedded model's decoder in each
combination (``dspark_plugins_cpu.decoder.ops`` with its projections laid out so),
compiles each with the plugin's own config (the engine's dtype, 2 threads),
lists the fused node types OpenVINO made, and times a decode step at each
batch (past 64 tokens per sequence), the variants interleaved in blocks in
one process (one runtime, so no thread interference between them).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

MODEL = Path(__file__).resolve().parents[1] / "core" / "dspark" / "assets" / "models" / "stdlib-llama"
VARIANTS = {"ours (fused, rank 2, f32)": (False, False, False), "separate projections": (True, False, False),
            "rank-3 inputs": (False, True, False), "f16 weights": (False, False, True),
            "separate, rank 3, f16 (as exported)": (True, True, True)}
SHOWN = ("FullyConnected", "Split", "QKVProjection", "LLMMLP", "RoPE", "RMS", "PagedAttention")


def variant_ops(spec: Any, separate: bool, rank3: bool, f16: bool) -> Any:
    """The plugin's own ops (dspark_plugins_cpu.decoder.ops) with the projections laid out another way:
    separate q/k/v and gate/up matmuls (concatenated back, so the one definition still splits them),
    rank-3 activations around each projection, f16 weight constants."""
    from dspark_plugins_cpu.decoder.ops import I64, OpenVINOOps

    H, KVH, D, inter = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size

    class Variant(OpenVINOOps):
        def _matmul(self, x: Any, w: np.ndarray, bias: np.ndarray | None) -> Any:
            if f16:
                c = self.o.convert(self.o.constant(np.ascontiguousarray(w.T).astype(np.float16)), "f32")
                y = self.o.matmul(x, c, transpose_a=False, transpose_b=True)
                return y if bias is None else self.o.add(y, self.const(bias))
            return super().linear(x, w, bias, None, "")

        def linear(self, x: Any, weight: np.ndarray, bias: np.ndarray | None, quant: Any, name: str) -> Any:
            h = self.o.reshape(x, self.const([1, -1, weight.shape[0]], I64), False) if rank3 else x
            cuts = ([0, H * D, (H + KVH) * D, (H + 2 * KVH) * D] if name.endswith("qkv_proj")
                    else [0, inter, 2 * inter] if name.endswith("gate_up_proj") else None)
            if separate and cuts:
                y = self.o.concat([self._matmul(h, weight[:, a:b], None if bias is None else bias[a:b])
                                   for a, b in zip(cuts, cuts[1:])], -1)
            else:
                y = self._matmul(h, weight, bias)
            return self.o.reshape(y, self.const([-1, weight.shape[1]], I64), False) if rank3 else y

    return Variant(spec)


def step_request(compiled: Any, batch: int, past: int = 64) -> Any:
    import openvino as ov

    blocks = (past + 1 + 31) // 32
    feed = {"input_ids": np.arange(batch, dtype=np.int64) + 5, "position_ids": np.full(batch, past, np.int64),
            "past_lens": np.full(batch, past, np.int32), "subsequence_begins": np.arange(batch + 1, dtype=np.int32),
            "block_indices": np.arange(batch * blocks, dtype=np.int32),
            "block_indices_begins": np.arange(0, batch * blocks + 1, blocks, dtype=np.int32),
            "max_context_len": np.array(past + 1, np.int32), "logit_rows": np.arange(batch, dtype=np.int64)}
    req = compiled.create_infer_request()
    for inp in compiled.inputs:
        name = inp.get_any_name()
        if name in feed:
            req.set_tensor(name, ov.Tensor(feed[name]))
        else:  # a KV cache: the plugin fixed every dim but the block count
            shape = [batch * blocks if i == 0 else d.get_length() for i, d in enumerate(inp.get_partial_shape())]
            req.set_tensor(name, ov.Tensor(inp.get_element_type(), shape))
    return req


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    from dspark.testing import decoder_spec
    from dspark_plugins_cpu import decoder as D
    from dspark_plugins_cpu import runtime
    from dspark_plugins_cpu.decoder import ops as O

    spec = decoder_spec(MODEL, args.dtype)
    layers = spec.num_layers
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": D._OV_TYPES[spec.dtype],
              "KV_CACHE_PRECISION": D._OV_TYPES[spec.dtype], "INFERENCE_NUM_THREADS": 2}
    compiled: dict[str, Any] = {}
    for name, flags in VARIANTS.items():
        model = O.build(spec, (0, layers), head=True, ops=variant_ops(spec, *flags))
        compiled[name] = runtime.core().compile_model(model, "CPU", config)
        ops = collections.Counter(str(op.get_rt_info()["layerType"].astype(str))
                                  for op in compiled[name].get_runtime_model().get_ordered_ops())
        print(f"{name}: " + ", ".join(f"{k} {ops[k]}" for k in SHOWN if ops[k]), flush=True)
    for batch in (int(b) for b in args.batch.split(",")):
        reqs = {k: step_request(c, batch) for k, c in compiled.items()}
        ms: dict[str, list[float]] = {k: [] for k in reqs}
        for _ in range(args.rounds):
            for k, r in reqs.items():
                r.infer()
                for _ in range(args.block):
                    t = time.perf_counter()
                    r.infer()
                    ms[k].append((time.perf_counter() - t) * 1e3)
        base = statistics.median(ms[next(iter(ms))])
        print(f"\ndecode step, batch {batch} ({spec.dtype}, 2 threads), median ms and vs ours:")
        for k, xs in ms.items():
            print(f"  {k:<38}{statistics.median(xs):8.3f}{statistics.median(xs) / base:8.3f}")


if __name__ == "__main__":
    main()
