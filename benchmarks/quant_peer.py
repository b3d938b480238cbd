"""The quantization benchmark's peer: NNCF ``compress_weights`` on the same checkpoint, run by OpenVINO.

Usage: .venv/bin/python benchmarks/quant_peer.py [--model DIR] [--threads 2] [--no-ppl]
(alone; benchmarks/quantization.py runs it beside dspark's rows)

Export: optimum-intel would pull its own torch and transformers (2.14 / 5.5
against the pinned 2.13 / 5.24), so the checkpoint is exported here instead:
the transformers ``LlamaForCausalLM`` itself, wrapped so the KV cache is
explicit tensors (``past.{i}.{k,v}`` in, ``present.{i}.{k,v}`` out), is
converted with ``openvino.convert_model``; OpenVINO's MakeStateful pass then
turns those pairs into internal state and a ``beam_idx`` reorder is put in
front of each, as optimum-intel's export does, so a decode step moves no KV
through Python and the CPU plugin fuses attention with its cache. The export is checked against
transformers' logits (prefill and one cached decode step) before use.

Variants: ``fp32`` (the export as is), ``nncf-int8`` =
``compress_weights(mode=INT8_ASYM)`` (NNCF's default mode: per-channel,
asymmetric) and ``nncf-int4`` = ``compress_weights(mode=INT4_SYM)`` with
NNCF's defaults (read from nncf 3.4.0: ratio 1, group size 128, all_layers
False so the embedding/last MatMul stay INT8_ASYM, sensitivity metric
WEIGHT_QUANTIZATION_ERROR, no data-aware AWQ/GPTQ/scale estimation).

Each is compiled for the CPU with INFERENCE_NUM_THREADS (2 by default),
INFERENCE_PRECISION_HINT f32 and KV_CACHE_PRECISION f32 (dspark's float
activations and KV cache are fp32 too, so the cache is not where they
differ); everything else is OpenVINO's default, including its dynamic int8
quantization of activations in compressed-weight matmuls
(DYNAMIC_QUANTIZATION_GROUP_SIZE, reported), as dspark's int8 layers quantize
activations per token by default.

Measured per variant: held-out perplexity and top-1 on the same windows as
dspark's (``dspark.llm.quantization.evaluate.heldout_windows``: 64 windows of
256 predicted tokens), greedy single-request decode tokens/s
(prompt of 64 held-out tokens, 128 new tokens; decode tok/s = (T(n) - T(1)) /
(n - 1), so prefill is excluded, as benchmarks/engine.py measures dspark),
and weight bytes = the sum of all Constant nodes' bytes in the compressed
model (weights, scales, zero points, norms; the few shape constants are a
few KB), which for the tied embedding counts the shared matrix once.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

OUT = Path(__file__).resolve().parent / "out"
OV_CACHE = OUT / "openvino"
_BEAM = np.zeros(1, np.int32)  # batch of one: the cache is never reordered
VARIANTS = ("fp32", "nncf-int8", "nncf-int4")
SETTINGS = {"fp32": "OpenVINO export, uncompressed",
            "nncf-int8": "compress_weights(mode=INT8_ASYM): NNCF's default mode, per-channel asymmetric",
            "nncf-int4": "compress_weights(mode=INT4_SYM), defaults: ratio 1.0, group 128, all_layers False "
                         "(embedding/lm_head INT8_ASYM), data-free"}


# ---------------------------------------------------------------- perplexity
def nll_top1(logits: np.ndarray, targets: np.ndarray) -> tuple[float, int]:
    """Summed negative log-likelihood and top-1 hits of ``targets`` under ``logits`` [T, vocab]."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(x - m).sum(axis=1)))
    nll = float((lse - x[np.arange(len(targets)), targets]).sum())
    return nll, int((x.argmax(axis=1) == targets).sum())


# ---------------------------------------------------------------- export
def export(model_path: Path, cache: Path = OV_CACHE) -> Path:
    """The checkpoint as a stateful OpenVINO IR (fp32), converted once per checkpoint; returns the .xml path."""
    import hashlib

    model_path = Path(model_path)
    st = model_path / "model.safetensors"
    key = hashlib.sha256(f"{st.resolve()}:{st.stat().st_size}:{st.stat().st_mtime_ns}".encode()).hexdigest()[:12]
    xml = cache / f"{model_path.name}-{key}" / "model.xml"
    if xml.exists():
        return xml
    import openvino as ov
    import torch
    from openvino._offline_transformations import apply_make_stateful_transformation
    from transformers import AutoModelForCausalLM, DynamicCache

    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    cfg = hf.config
    L, KVH = cfg.num_hidden_layers, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    class ExplicitKV(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = hf

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
            kv = DynamicCache(config=cfg)
            for i, layer in enumerate(kv.layers):  # filled directly: update() would trace a concat with []
                layer.keys, layer.values = past[2 * i], past[2 * i + 1]  # type: ignore[union-attr]
                layer.device, layer.is_initialized = past[2 * i].device, True  # type: ignore[union-attr]
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=kv, use_cache=True)
            flat = [t for lay in out.past_key_values.layers for t in (lay.keys, lay.values)]
            return (out.logits, *flat)

    # Traced with a cached prefix and several new tokens: the general path (mask with an offset).
    P, T = 5, 3
    g = torch.Generator().manual_seed(0)
    example = (torch.randint(0, cfg.vocab_size, (1, T), generator=g), torch.ones(1, P + T, dtype=torch.long),
               torch.arange(P, P + T)[None], *[torch.randn(1, KVH, P, D, generator=g) for _ in range(2 * L)])
    past_names = [f"past.{i}.{kv}" for i in range(L) for kv in "kv"]
    with torch.no_grad():
        om = ov.convert_model(ExplicitKV().eval(), example_input=example)
    for port, name in zip(om.inputs, ["input_ids", "attention_mask", "position_ids", *past_names]):
        port.get_tensor().set_names({name})
    for port, name in zip(om.outputs, ["logits", *(n.replace("past", "present") for n in past_names)]):
        port.get_tensor().set_names({name})
    shapes = {"input_ids": [1, -1], "attention_mask": [1, -1], "position_ids": [1, -1]}
    shapes |= {n: [1, KVH, -1, D] for n in past_names}
    om.reshape({k: ov.PartialShape(v) for k, v in shapes.items()})
    _add_beam_gather(om, past_names)
    apply_make_stateful_transformation(om, {n: n.replace("past", "present") for n in past_names})
    _init_states_empty(om)
    _check_export(om, hf)
    xml.parent.mkdir(parents=True, exist_ok=True)
    tmp = xml.with_name("tmp.xml")
    ov.save_model(om, tmp, compress_to_fp16=False)
    tmp.with_suffix(".bin").rename(xml.with_suffix(".bin"))
    tmp.rename(xml)
    return xml


def _add_beam_gather(om: Any, past_names: list[str]) -> None:
    """Reorder each cached K/V by a ``beam_idx`` input, as optimum-intel's export does.

    OpenVINO's CPU plugin fuses ReadValue -> Gather(beam_idx) -> Concat -> SDPA
    into one attention node that appends to the cache in place; without the
    Gather the pattern does not match and attention runs as separate
    transposes, matmuls and a softmax with a copied cache every step.
    """
    import openvino as ov
    from openvino import opset13 as ops

    beam = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    beam.output(0).get_tensor().set_names({"beam_idx"})
    axis = ops.constant(np.int64(0))
    for p in om.get_parameters():
        if p.output(0).get_any_name() in past_names:
            users = list(p.output(0).get_target_inputs())
            g = ops.gather(p, beam, axis)
            for u in users:
                u.replace_source_output(g.output(0))
    om.add_parameters([beam])
    om.validate_nodes_and_infer_types()


def _init_states_empty(om: Any) -> None:
    """Give every cache state an initializer: an empty [1, heads, 0, head_dim] tensor (the CPU plugin needs one)."""
    from openvino import opset13 as ops

    for op in om.get_ops():
        if op.get_type_name() == "ReadValue":
            dims = [d.get_min_length() for d in op.get_output_partial_shape(0)]
            zero = ops.constant(np.zeros((), np.float32))
            op.set_arguments([ops.broadcast(zero, ops.constant(np.array(dims, np.int64))).output(0)])
    om.validate_nodes_and_infer_types()


def _check_export(om: Any, hf: Any) -> None:
    """The stateful model's prefill of 20 tokens and one cached decode step must match transformers' logits."""
    import openvino as ov
    import torch

    req = ov.Core().compile_model(om, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
                                  ).create_infer_request()
    ids = torch.randint(0, hf.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0].numpy()
    err = 0.0
    for lo, hi in ((0, 20), (20, 21)):
        req.infer({"input_ids": ids[:, lo:hi].numpy(), "beam_idx": _BEAM, "attention_mask": np.ones((1, hi), np.int64),
                   "position_ids": np.arange(lo, hi)[None]})
        err = max(err, float(np.abs(req.get_tensor("logits").data[0] - ref[lo:hi]).max()))
    if err > 1e-3:
        raise RuntimeError(f"OpenVINO export differs from transformers by {err:.3g} in the logits")


# ---------------------------------------------------------------- variants
def constant_bytes(model: Any) -> dict[str, int]:
    """Bytes of every Constant node in the model, by element type."""
    out: collections.Counter[str] = collections.Counter()
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Constant":
            out[op.get_element_type().get_type_name()] += op.get_byte_size()
    return dict(out)


def load_variant(xml: Path, name: str) -> Any:
    import openvino as ov

    model = ov.Core().read_model(xml)
    if name == "fp32":
        return model
    import nncf

    mode = {"nncf-int8": nncf.CompressWeightsMode.INT8_ASYM, "nncf-int4": nncf.CompressWeightsMode.INT4_SYM}[name]
    return nncf.compress_weights(model, mode=mode)  # every other argument at NNCF's default


class Peer:
    """One compiled, stateful variant: a full-window forward for perplexity, a greedy loop for decode."""

    def __init__(self, model: Any, threads: int) -> None:
        import openvino as ov

        cfg = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
               "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
        self.compiled = ov.Core().compile_model(model, "CPU", cfg)
        self.req = self.compiled.create_infer_request()
        self.config = {k: str(self.compiled.get_property(k)) for k in
                       ("INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION",
                        "DYNAMIC_QUANTIZATION_GROUP_SIZE")}

    def forward(self, ids: list[int], start: int) -> np.ndarray:
        """Run ``ids`` after ``start`` cached tokens; logits [len(ids), vocab] (a view, valid until the next call)."""
        n = len(ids)
        self.req.infer({"input_ids": np.asarray([ids], np.int64), "beam_idx": _BEAM,
                        "attention_mask": np.ones((1, start + n), np.int64),
                        "position_ids": np.arange(start, start + n, dtype=np.int64)[None]})
        return np.asarray(self.req.get_tensor("logits").data[0])

    def perplexity(self, windows: list[list[int]]) -> dict[str, float]:
        nll, hits, count = 0.0, 0, 0
        for w in windows:
            self.req.reset_state()
            logits = self.forward(w[:-1], 0)
            a, b = nll_top1(logits, np.asarray(w[1:]))
            nll, hits, count = nll + a, hits + b, count + len(w) - 1
        return {"perplexity": math.exp(nll / count), "top1": hits / count, "tokens": count}

    def generate(self, prompt: list[int], n: int) -> list[int]:
        self.req.reset_state()
        out = [int(self.forward(prompt, 0)[-1].argmax())]
        pos = len(prompt)
        while len(out) < n:
            out.append(int(self.forward(out[-1:], pos)[-1].argmax()))
            pos += 1
        return out


def decode_tps(gen: Any, prompt: list[int], n: int, rounds: int) -> tuple[float, float, float, list[int]]:
    """(decode tok/s, median T(1), median T(n), tokens) for ``gen(prompt, n) -> ids``; one warm-up first."""
    gen(prompt, 8)
    t1s: list[float] = []
    tns: list[float] = []
    toks: list[int] = []
    for _ in range(rounds):
        for k, acc in ((1, t1s), (n, tns)):
            t0 = time.perf_counter()
            out = gen(prompt, k)
            acc.append(time.perf_counter() - t0)
            if k == n:
                toks = out
    t1, tn = statistics.median(t1s), statistics.median(tns)
    return (n - 1) / (tn - t1), t1, tn, toks


@dataclass
class Variant:
    """One compiled peer variant and what it costs to hold."""

    name: str
    setting: str
    peer: Peer
    weight_bytes: int
    bytes_by_type: dict[str, int] = field(default_factory=dict)
    build_s: float = 0.0


def variants(model_path: Path, threads: int = 2, names: tuple[str, ...] = VARIANTS,
             log: Any = print) -> list[Variant]:
    """Export (cached), compress and compile every variant of the peer on ``model_path``."""
    t0 = time.perf_counter()
    xml = export(model_path)
    log(f"  peer: OpenVINO IR {xml} ({time.perf_counter() - t0:.0f} s incl. export if not cached)")
    out = []
    for name in names:
        t0 = time.perf_counter()
        model = load_variant(xml, name)
        by = constant_bytes(model)
        peer = Peer(model, threads)
        out.append(Variant(name, SETTINGS[name], peer, sum(by.values()), by, time.perf_counter() - t0))
        log(f"  peer {name}: {out[-1].weight_bytes / 2**20:.2f} MiB of constants, built in {out[-1].build_s:.0f} s")
    return out


def main() -> None:
    from dspark.llm.api import default_model_path
    from dspark.llm.quantization.evaluate import heldout_windows

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=default_model_path())
    ap.add_argument("--threads", type=int, default=2, help="INFERENCE_NUM_THREADS (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="decode timing rounds, median reported (default 3)")
    ap.add_argument("--no-ppl", action="store_true", help="speed and bytes only (e.g. a random-weight model)")
    args = ap.parse_args()
    windows = heldout_windows(args.model, seq_len=256, max_windows=64)
    prompt = windows[0][:64]
    rows = {}
    print(f"{'variant':<10} {'ppl':>9} {'top1':>6} {'decode tok/s':>12} {'weight MiB':>10}  setting")
    for v in variants(args.model, args.threads, log=lambda s: None):
        r = {"perplexity": float("nan"), "top1": float("nan")} if args.no_ppl else v.peer.perplexity(windows)
        tps, t1, tn, _ = decode_tps(v.peer.generate, prompt, 128, args.rounds)
        rows[v.name] = {**r, "decode_tps": tps, "t1_s": t1, "tn_s": tn, "weight_bytes": v.weight_bytes,
                        "bytes_by_type": v.bytes_by_type, "setting": v.setting, "ov_config": v.peer.config}
        print(f"{v.name:<10} {r['perplexity']:9.3f} {r['top1']:6.3f} {tps:12.1f} {v.weight_bytes / 2**20:10.2f}  "
              f"{v.setting}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    dst = OUT / f"quant_peer-{args.model.name}.json"
    dst.write_text(json.dumps(rows, indent=2))
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
