"""How often a plugin's compiled decoder picks another greedy token than the torch runner.

Teacher-forced on held-out prompts: the torch runner generates greedily; every
target then runs the same tokens through the engine's step shapes (the prompt
prefilled, then one decode step per token, all sequences batched) and its argmax
at each position is compared with the torch runner's. Reported per target and
dtype: argmax flips / positions, and the largest logit difference.

    .venv/bin/python benchmarks/decoder_agreement.py [--prompts 16] [--tokens 128] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from dspark.host.inventory import probe
from dspark.host.plugin_manager import PluginHost
from dspark.llm.api import default_model_path
from dspark.llm.config import EngineConfig
from dspark.llm.decoding.choose import choose_decoder
from dspark.llm.decoding.runner import DecoderRunner
from dspark.llm.quantization.data import heldout_texts, load_tokenizer
from dspark.llm.runner.model import ModelRunner, SeqChunk

OUT = Path(__file__).resolve().parent / "out"


def prompts(path: Path, n: int, length: int) -> list[list[int]]:
    tok = load_tokenizer(path)
    out = []
    for text in heldout_texts(path):
        ids = tok.encode(text).ids
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            break
    return out


def run(step: Any, make_cache: Any, page: int, seqs: list[list[int]], tokens: int,
        forced: list[list[int]] | None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens (or ``forced`` ones) and every decode position's logits, all sequences batched."""
    cache = make_cache(len(seqs) * (-(-(len(seqs[0]) + tokens) // page) + 1), page)
    ids = [f"s{i}" for i in range(len(seqs))]
    first = step(cache, [SeqChunk(s, p) for s, p in zip(ids, seqs, strict=True)])
    logits = [torch.stack(first)]
    picks = [[int(r.argmax())] for r in first] if forced is None else [[f[0]] for f in forced]
    for t in range(1, tokens):
        out = step(cache, [SeqChunk(s, [p[-1]]) for s, p in zip(ids, picks, strict=True)])
        logits.append(torch.stack(out))
        for i, r in enumerate(out):
            picks[i].append(int(r.argmax()) if forced is None else forced[i][t])
    return picks, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    path = Path(args.model) if args.model else default_model_path()
    seqs = prompts(path, args.prompts, args.prompt_len)
    host = PluginHost().load()
    inv = probe(host)
    rows = []
    for dtype in args.dtypes.split(","):
        ref = ModelRunner.from_pretrained(str(path), dtype)
        want, ref_logits = run(ref.step, ref.make_cache, 16, seqs, args.tokens, None)
        for plugin in ("cpu", "npu"):
            runner, choice = choose_decoder(ref, path, EngineConfig(decoder=plugin), host=host, inv=inv)
            if not isinstance(runner, DecoderRunner):
                rows.append({"dtype": dtype, "target": plugin, "declined": choice.declined})
                continue
            one = DecoderRunner(ref, [runner.targets[0]], step_timeout_s=None)
            _, got = run(one.step, one.make_cache, runner.targets[0].compiled.block_size, seqs, args.tokens, want)
            flips = sum(int((a.argmax(-1) != b.argmax(-1)).sum()) for a, b in zip(ref_logits, got, strict=True))
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref_logits, got, strict=True))
            n = len(seqs) * args.tokens
            rows.append({"dtype": dtype, "target": runner.targets[0].label, "positions": n, "flips": flips,
                         "flip_rate": flips / n, "max_abs_logit_diff": diff})
            print(json.dumps(rows[-1]))
    OUT.mkdir(exist_ok=True)
    (OUT / "decoder_agreement.json").write_text(json.dumps(rows, indent=2))
    print("| dtype | target | positions | argmax flips | rate | max logit diff |\n|---|---|---|---|---|---|")
    for r in rows:
        if "flips" in r:
            print(f"| {r['dtype']} | {r['target']} | {r['positions']} | {r['flips']} | {r['flip_rate']:.2%} | "
                  f"{r['max_abs_logit_diff']:.3g} |")


if __name__ == "__main__":
    main()
