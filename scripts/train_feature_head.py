"""Train the embedded model's feature-level draft head (EAGLE-style) on the main model's own states.

The main model (core/dspark/assets/models/stdlib-llama) is frozen; on the same training
stream it was trained on, it gives each position's final-normed hidden state u_i and its
distribution p_i. The head learns u_{i+1} from (u_i, embed(x_{i+1})) with

    loss = KL(p_{i+1} || softmax(W u^_{i+1})) + feat_w * smooth_l1(u^_{i+1}, u_{i+1})

plus the same loss one step further along its own prediction (u^_{i+1}, embed(x_{i+2}))
-> u_{i+2}, so that chained drafting stays close (``--unroll``). Checkpoints every
``--ckpt-every`` steps; ``--resume`` continues one. The held-out stage measures, on the
held-out files, the teacher-forced greedy agreement with the main model (the head's argmax
given the true u_i equals the main model's at i+1) and the chained agreement of the second
and third drafted tokens.

    .venv/bin/python scripts/train_feature_head.py --steps 900 --max-minutes 20
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "core"))

from train_default_model import (  # noqa: E402
    MAIN_DIR,
    Batches,
    encode_files,
    is_heldout,
    list_corpus,
    read_text,
    stdlib_root,
)

from dspark.llm.speculative.head.model import FeatureHead, save_head  # noqa: E402

HEAD_DIR = MAIN_DIR.parent / "stdlib-llama-head"


def log(*a: object) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


@torch.no_grad()
def teacher(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(u [B, T, H] final-normed hidden states, logits [B, T, V]) of the frozen main model."""
    u = model.model(input_ids=x).last_hidden_state
    return u, model.lm_head(u)


def step_loss(head: FeatureHead, W: torch.Tensor, u_in: torch.Tensor, e: torch.Tensor, u_tgt: torch.Tensor,
              logits_tgt: torch.Tensor, feat_w: float) -> tuple[torch.Tensor, torch.Tensor]:
    pred = head(u_in, e)
    V = W.shape[0]
    lp = F.log_softmax((pred @ W.T).reshape(-1, V), dim=-1)
    kl = F.kl_div(lp, F.log_softmax(logits_tgt.reshape(-1, V), dim=-1), log_target=True, reduction="batchmean")
    return kl + feat_w * F.smooth_l1_loss(pred, u_tgt), pred


def losses(head: FeatureHead, model, W: torch.Tensor, x: torch.Tensor, feat_w: float, unroll: int) -> torch.Tensor:
    u, logits = teacher(model, x)
    emb = model.model.embed_tokens.weight
    total = torch.zeros(())
    u_in = u[:, :-1]
    for j in range(unroll):
        T = u.shape[1] - 1 - j
        e = emb[x[:, 1 + j:1 + j + T]]
        loss, pred = step_loss(head, W, u_in[:, :T], e, u[:, 1 + j:1 + j + T], logits[:, 1 + j:1 + j + T], feat_w)
        total = total + loss * (0.5 ** j)
        u_in = pred
    return total


def draft_vocab(train: torch.Tensor, vocab_size: int, n: int) -> torch.Tensor:
    """The ``n`` most frequent token ids of the training stream, most frequent first (FR-Spec)."""
    counts = torch.bincount(train.long(), minlength=vocab_size)
    return torch.argsort(counts, descending=True, stable=True)[:n]


@torch.no_grad()
def agreement(head: FeatureHead, model, held: torch.Tensor, seq: int, windows: int, depth: int = 3,
              vocab: torch.Tensor | None = None) -> list[float]:
    """Per chained depth d (1 = teacher-forced): share of positions where the head's argmax after
    d steps along its own predictions equals the main model's (the head's argmax taken among
    ``vocab`` when given, as it drafts)."""
    W = model.lm_head.weight
    ids = vocab if vocab is not None else torch.arange(W.shape[0])
    W = W[ids]
    emb = model.model.embed_tokens.weight
    hits = [0] * depth
    n = [0] * depth
    for w in range(windows):
        x = held[w * seq:(w + 1) * seq + 1].long()[None]
        if x.shape[1] < seq + 1:
            break
        u, logits = teacher(model, x)
        best = logits.argmax(-1)
        u_in = u[:, :-1]
        for d in range(depth):
            T = u.shape[1] - 1 - d
            # chained drafting feeds the head's own tokens after the first: teacher tokens here, the
            # head's own argmax agreeing is what the count measures
            pred = head(u_in[:, :T], emb[x[:, 1 + d:1 + d + T]])
            got = ids[(pred @ W.T).argmax(-1)]
            hits[d] += int((got == best[:, 1 + d:1 + d + T]).sum())
            n[d] += T
            u_in = pred
    return [h / max(m, 1) for h, m in zip(hits, n)]


def write_card(out: Path) -> None:
    """The head's README.md, from its config.json (so --eval-only keeps it in step)."""
    cfg = json.loads((out / "config.json").read_text())
    tr, ag = cfg.get("dspark_train", {}), cfg["dspark_heldout_agreement"]
    pct = lambda x: f"{100 * x:.2f}%"  # noqa: E731
    curve = "\n".join(f"| {c['step']} | {pct(c['agreement'][0])} | {pct(c['agreement'][1])} | {pct(c['agreement'][2])} |"
                      for c in cfg.get("dspark_curve", []))
    (out / "README.md").write_text(f"""# stdlib-llama-head: a feature-level draft head for stdlib-llama

An EAGLE-style draft head for the embedded model `stdlib-llama`. It never sees text on its own: from
the main model's final-normed hidden state u_i at position i and the embedding of token x_(i+1), it
predicts u_(i+1), attending over the {cfg['window']} rows before it; the main model's own (tied) LM head,
restricted to the {ag['draft_vocabulary'] or 'whole'} most frequent training tokens (FR-Spec), turns
that into a drafted token, and drafting k tokens chains it on its own predictions. The engine gives it
the main model's rows (`DraftRequest.target_rows`, plugin API 1.9); compiled targets give logits, from
which u is solved by least squares (the LM head is linear and has full column rank). Offered by the
built-in drafters plugin as `feature-head:stdlib-llama-head` when `speculative_decoding.draft_head` is `auto` (off by default: see docs/benchmarks.md).

## Architecture

`fuse(cat(norm(u_i), norm(embed(x_(i+1)))))` (Linear 2H -> H), then x + windowed causal attention
({cfg['hidden_size'] // 64} heads of 64, RoPE, window {cfg['window']}), then {cfg['num_blocks']} x (x + SwiGLU({cfg['intermediate_size']})),
then RMSNorm; hidden {cfg['hidden_size']}. Stored in bfloat16 (`head.safetensors`, with `draft_vocab`).

## Training

The main model frozen, on its own training stream (the standard library's training files, as in
`stdlib-llama`'s card), 4 x 512-token windows a step; loss = KL(main model's distribution at i+1 ||
head's) + {tr.get('feat_w')} x smooth-L1(u^_(i+1), u_(i+1)), and the same one step further along the head's
own prediction (weight 0.5). AdamW, peak lr {tr.get('lr')}, cosine to 5%. Steps: {tr.get('steps')}
({tr.get('tokens', 0):,} tokens), {tr.get('minutes')} min on 2 cores (2 threads, float32).

## Held-out agreement with the main model

The {ag['windows']} first held-out windows of {ag['seq']} tokens (files the main model never saw). Teacher-forced:
the head given the main model's true u_i and the true next token; its argmax (among the draft
vocabulary) equals the main model's argmax at i+1. Chained d: the head's own predictions fed back d - 1 times.

| teacher-forced | chained 2 | chained 3 | teacher-forced, whole vocabulary |
|---|---|---|---|
| {pct(ag['teacher_forced'])} | {pct(ag['chained_2'])} | {pct(ag['chained_3'])} | {pct(ag['teacher_forced_full_vocabulary'])} |

### Curve (8 held-out windows, draft vocabulary not applied)

| step | teacher-forced | chained 2 | chained 3 |
|---|---|---|---|
{curve}

## Reproduce

```
{tr.get('command', '')}
```
""")


def _agreement_record(a_full: list[float], a: list[float], args: argparse.Namespace) -> dict:
    return {"teacher_forced": a[0], "chained_2": a[1], "chained_3": a[2],
            "teacher_forced_full_vocabulary": a_full[0], "draft_vocabulary": args.draft_vocab or None,
            "windows": args.eval_windows, "seq": args.seq}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--max-minutes", type=float, default=0)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--inner", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--window", type=int, default=8, help="rows each row attends over (0 = no attention)")
    ap.add_argument("--feat-w", type=float, default=0.5)
    ap.add_argument("--unroll", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--ckpt", default="/tmp/dspark_head_ckpt.pt")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--out-dir", default=str(HEAD_DIR))
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--draft-vocab", type=int, default=2048,
                    help="draft among the N most frequent training tokens (0 = the whole vocabulary)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(MAIN_DIR, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(MAIN_DIR)
    root = stdlib_root()
    files = list_corpus(root)
    train = encode_files(tok, [read_text(root, f) for f in files if not is_heldout(f)])
    held = encode_files(tok, [read_text(root, f) for f in files if is_heldout(f)])
    H = model.config.hidden_size
    head = FeatureHead(H, args.inner, args.blocks, args.window)
    vocab = draft_vocab(train, model.config.vocab_size, args.draft_vocab) if args.draft_vocab else None
    if args.eval_only:  # re-measure a saved head and give it this run's draft vocabulary
        from dspark.llm.speculative.head.model import load_head

        head, _ = load_head(args.out_dir)
        cfg = json.loads((Path(args.out_dir) / "config.json").read_text())
        a_full = agreement(head, model, held, args.seq, args.eval_windows)
        a = agreement(head, model, held, args.seq, args.eval_windows, vocab=vocab)
        log(f"agreement (teacher-forced, chained 2, 3): full vocabulary {a_full}, draft vocabulary {a}")
        extra = {k: v for k, v in cfg.items() if k.startswith("dspark_") and k not in ("dspark_role", "dspark_head_for")}
        extra["dspark_heldout_agreement"] = _agreement_record(a_full, a, args)
        save_head(head, Path(args.out_dir), MAIN_DIR.name, extra, vocab)
        write_card(Path(args.out_dir))
        return
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    batches = Batches(train, args.seq, args.bs, args.seed)
    start, curve, spent = 0, [], 0.0
    if args.resume and Path(args.ckpt).exists():
        ck = torch.load(args.ckpt, weights_only=False)
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["opt"])
        start, curve, spent = ck["step"], ck["curve"], ck["spent"]
        log(f"resumed at step {start}")
    W = model.lm_head.weight
    t0 = time.time() - spent
    budget = args.max_minutes * 60 or math.inf
    step = start
    for step in range(start, args.steps):
        elapsed = time.time() - t0
        if elapsed > budget:
            log(f"wall-time budget reached at step {step}")
            break
        progress = max(step / args.steps, elapsed / budget)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = losses(head, model, W, batches.get(step), args.feat_w, args.unroll)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 25 == 0:
            log(f"step {step} loss {loss.item():.4f} lr {lr:.2e}")
        if (step + 1) % args.ckpt_every == 0:
            a = agreement(head.eval(), model, held, args.seq, 8)
            head.train()
            curve.append({"step": step + 1, "agreement": a})
            log(f"step {step + 1} held-out agreement (8 windows) {a}")
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step + 1, "curve": curve,
                        "spent": time.time() - t0}, args.ckpt)
    head.eval()
    a_full = agreement(head, model, held, args.seq, args.eval_windows)
    a = agreement(head, model, held, args.seq, args.eval_windows, vocab=vocab)
    minutes = (time.time() - t0) / 60
    log(f"final agreement over {args.eval_windows} held-out windows (teacher-forced, chained 2, 3): "
        f"full vocabulary {a_full}, draft vocabulary {a}")
    save_head(head, Path(args.out_dir), MAIN_DIR.name, {
        "dspark_train": {"steps": step + 1, "tokens": (step + 1) * args.bs * args.seq, "minutes": round(minutes, 1),
                         "command": " ".join([".venv/bin/python", "scripts/train_feature_head.py", *sys.argv[1:]]),
                         "lr": args.lr, "window": args.window, "feat_w": args.feat_w, "unroll": args.unroll,
                         "seed": args.seed},
        "dspark_heldout_agreement": _agreement_record(a_full, a, args),
        "dspark_curve": curve}, vocab)
    write_card(Path(args.out_dir))
    log(f"saved {args.out_dir}")


if __name__ == "__main__":
    main()
