"""llama.cpp's flash attention against its attention as separate products and a softmax, over f16 K and V (as the
llamacpp plugin holds a bfloat16 engine's), through the plugin's own ``Context``: the time of a step of one
sequence of 1, 2, 4, 6 and 8 rows after a 300-token prompt (a decode step, the verification of 1 to 7 drafted
tokens, past the 256 cells where a lone row's attention could take another kernel), of a decode step of 8 and 32
sequences of 96 prompt tokens each (a cache per sequence, as the plugin keeps them while they fit), and of a
128-token prefill.

Usage: .venv/bin/python benchmarks/llamacpp_attention.py [GGUF] [--rounds 3] [--threads 2] [--compare-lib DIR]

Default file: the embedded model's BF16 GGUF that benchmarks/vs_llamacpp.py writes. ``--compare-lib DIR`` adds a
side with flash attention on the llama.cpp libraries in DIR (``LLAMA_CPP_LIB_PATH``: a folder holding another
build's libllama.so and libggml*.so, for instance one built without a patch of scripts/patches). Each side runs in
its own process (OpenMP workers spin between calls), sides rotating, ``--rounds`` rounds; medians of the rounds'
medians. Ratios are a side / flash attention on the installed build (> 1: slower).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llamacpp_repack import fill_prompts, in_children, median_ms  # noqa: E402

DEFAULT = HERE / "out" / "llamacpp" / "files" / "stdlib-llama-bf16.gguf"
ONE_SEQ = (1, 2, 4, 6, 8)  # rows of one sequence's steps
SEQS = (8, 32)
PROMPT = 300


def child(path: str, threads: int, flash: bool) -> dict[str, float]:
    import numpy as np

    from dspark_llamacpp import runtime

    model = runtime.Model(path)
    out: dict[str, float] = {}
    one = runtime.Context(model, n_ctx=512, n_seq_max=1, n_batch=512, threads=threads, kv_dtype="float16",
                          flash_attn=flash)
    last = np.zeros(PROMPT, bool)
    last[-1] = True
    one.decode(np.zeros(PROMPT, np.int32), np.arange(PROMPT, dtype=np.int32) % 5000 + 5,
               np.arange(PROMPT, dtype=np.int32), last)
    for n in ONE_SEQ:
        seqs, toks = np.zeros(n, np.int32), np.full(n, 7, np.int32)
        pos, want = np.arange(PROMPT, PROMPT + n, dtype=np.int32), np.ones(n, bool)

        def step() -> None:
            one.decode(seqs, toks, pos, want)
            one.drop(0, PROMPT)

        out[f"one_seq_{n}_rows_ms"] = median_ms(step, 40)
    want128 = np.zeros(128, bool)
    want128[-1] = True

    def prefill() -> None:
        one.drop(0, 0)
        one.decode(np.zeros(128, np.int32), np.arange(128, dtype=np.int32) + 5, np.arange(128, dtype=np.int32),
                   want128)

    out["prefill_128_ms"] = median_ms(prefill, 12)
    one.close()
    for s in SEQS:
        ctx = runtime.Context(model, n_ctx=s * 256, n_seq_max=s, n_batch=512, threads=threads, kv_dtype="float16",
                              flash_attn=flash, unified=False)
        fill_prompts(ctx, s)
        pos = np.full(s, 96, np.int32)

        def decode(s: int = s, ctx: runtime.Context = ctx, pos: np.ndarray = pos) -> None:
            ctx.decode(np.arange(s, dtype=np.int32), np.full(s, 7, np.int32), pos.copy(), np.ones(s, bool))
            pos += 1

        out[f"seqs_{s}_ms"] = median_ms(decode, 30)
        ctx.close()
    model.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", nargs="?", default=str(DEFAULT))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare-lib", default=None, help="a folder of another llama.cpp build's libraries")
    ap.add_argument("--child", choices=("flash", "plain"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.file, args.threads, args.child == "flash")))
        return
    if not Path(args.file).exists():
        raise SystemExit(f"{args.file}: not found (benchmarks/vs_llamacpp.py writes it)")
    sides: dict[str, tuple[str, dict[str, str]]] = {"flash": ("flash", {}), "plain": ("plain", {})}
    if args.compare_lib:
        if not (Path(args.compare_lib) / "libllama.so").exists():
            raise SystemExit(f"--compare-lib {args.compare_lib}: no libllama.so there")
        sides["flash, --compare-lib"] = ("flash", {"LLAMA_CPP_LIB_PATH": args.compare_lib})
    res = in_children(__file__, args.file, args.threads, args.rounds, sides)
    names = list(sides)
    print(f"\n{Path(args.file).name}, f16 K and V, {args.threads} threads, {args.rounds} rounds (medians, ms)\n")
    print("| step | " + " | ".join(names) + " | " + " | ".join(f"{n} / flash" for n in names[1:]) + " |")
    print("|---" * (2 * len(names)) + "|")
    for key in res["flash"][0]:
        med = [statistics.median(x[key] for x in res[n]) for n in names]
        print(f"| {key} | " + " | ".join(f"{m:.3f}" for m in med) + " | "
              + " | ".join(f"{m / med[0]:.2f}" for m in med[1:]) + " |")


if __name__ == "__main__":
    main()
