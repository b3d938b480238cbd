#!/usr/bin/env python3
"""Train DSpark's embedded default model (and its draft) on the stdlib source.

Reproducible end to end: fixed seeds, a sorted file list, a hash-defined
held-out set and a data order that is a pure function of (seed, step).

Stages (``--stages``, default all of them, in this order):

* ``tokenizer`` - byte-level BPE (``tokenizers``) trained on the training files.
* ``main``      - a ~11.7M-parameter Llama causal LM trained from scratch with an
                  extra early-exit (LayerSkip-style) loss: the hidden state after
                  layer ``--exit-layers`` goes through the final norm and the
                  shared (tied) lm_head and its cross-entropy is added to the loss.
* ``draft``     - a ~2.4M-parameter Llama trained on the same token stream.
* ``eval``      - reloads the saved bf16 weights (cast to fp32), measures held-out
                  perplexity / top-1 next-token accuracy, writes the model cards
                  and greedy-generates a little text as a sanity check.

Outputs: ``core/dspark/assets/models/stdlib-llama`` and ``.../stdlib-llama-draft``
(Hugging Face format, bf16 safetensors). Checkpoints (fp32 + optimizer) are
kept in ``--ckpt-dir`` so an interrupted run resumes with ``--resume``.

The committed main model was trained from scratch and then continued
(``--main-init``, a fresh optimizer, 512-token windows throughout); the
commands are in the model cards. ``--seq-ul-every N`` makes every Nth main step a
sequence-level unlikelihood step on the model's own greedy continuations
(``scripts/unlikelihood.py``). ``--draft-init N --distil-weight W`` starts
the draft from the main model's first N layers, ``--draft-from DIR`` from a
saved draft; ``--distil-weight W`` distils it from the main model's
distribution. A draft alone (``--stages draft,eval``) trains beside the main
model in ``--out-dir``; without the main model's checkpoint in
``--ckpt-dir`` the eval stage leaves its card alone.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import shlex
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unlikelihood import seq_ul_loss  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MAIN_DIR = REPO / "core" / "dspark" / "assets" / "models" / "stdlib-llama"
DRAFT_DIR = REPO / "core" / "dspark" / "assets" / "models" / "stdlib-llama-draft"

EXCLUDED_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
MAX_FILE_BYTES = 200 * 1024
HELDOUT_PER_MILLE = 30  # sha256(relpath) % 1000 < 30  ->  ~3% of the files
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]  # ids 0, 1, 2, 3
BOS_ID, EOS_ID, UNK_ID, PAD_ID = 0, 1, 2, 3
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\\n' + message['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)
# The card's prompts; the third is the README's example.
SAMPLE_PROMPTS = ("def ", "import os\n", "def quick_sort(arr):", "class Stack:\n")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]

MAIN_ARCH = dict(hidden_size=384, intermediate_size=896, num_hidden_layers=6,
                 num_attention_heads=6, num_key_value_heads=2)
DRAFT_ARCH = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=1)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# --------------------------------------------------------------------------- data
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus(root: Path) -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath) / fn
            if p.is_symlink() or p.stat().st_size > MAX_FILE_BYTES:
                continue
            files.append(p.relative_to(root).as_posix())
    return sorted(files)


def held_stems(held: list[str]) -> set[str]:
    """The names of the held-out modules and their packages' folders: ``turtle``, ``statistics``, ``asyncio``'s
    ``futures`` ... (a test or demo of one of them would teach its identifiers and docstrings)."""
    return {Path(f).stem for f in held} - {"__init__"}


def about_held(rel: str, stems: set[str]) -> bool:
    """A file named after a held-out module, or in a folder that is: ``test/test_turtle.py``,
    ``test/test_asyncio/test_futures.py``, ``test/test_email/test_charset.py``."""
    parts = [Path(p).stem for p in Path(rel).parts]
    return any(p.removeprefix("test_") in stems for p in parts[1:])


def list_extra(root: Path, dirs: list[str], held: list[str]) -> list[str]:
    """Training-only files from stdlib folders the corpus leaves out (``test``, ``idlelib``...): more
    Python to learn from while the held-out set, drawn from ``list_corpus`` alone, stays the same. Files
    about a held-out module (its tests) are left out too."""
    stems = held_stems(held)
    files = []
    for d in dirs:
        if not (root / d).is_dir():
            raise SystemExit(f"--extra-train-dirs: {root / d} is not a folder")
        for p in sorted((root / d).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            if "__pycache__" in p.parts or p.is_symlink() or p.stat().st_size > MAX_FILE_BYTES or about_held(rel, stems):
                continue
            files.append(rel)
    return files


def is_heldout(rel: str) -> bool:
    h = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")
    return h % 1000 < HELDOUT_PER_MILLE


def read_text(root: Path, rel: str) -> str:
    return (root / rel).read_bytes().decode("utf-8", errors="replace")


# ---------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path, max_len: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [BOS_ID, EOS_ID, UNK_ID, PAD_ID]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                      special_tokens=[("<s>", BOS_ID)]),
    ])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", model_max_length=max_len, padding_side="left",
        clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    save_tokenizer(fast, out_dir)
    return fast


def save_tokenizer(fast, out_dir: Path):
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    # Make the files explicit and version-independent: chat template inside
    # tokenizer_config.json and a special_tokens_map.json (newer transformers
    # write neither by default).
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.setdefault("bos_token", "<s>")
    cfg.setdefault("eos_token", "</s>")
    cfg.setdefault("unk_token", "<unk>")
    cfg.setdefault("pad_token", "<pad>")
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja = out_dir / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
        indent=2) + "\n")


def encode_files(tok, texts: list[str]) -> torch.Tensor:
    """One stream: ``<s> file </s>`` per file, in the (sorted) file order."""
    ids: list[int] = []
    enc = tok.backend_tokenizer.encode_batch(texts)  # post-processor adds <s>
    for e in enc:
        ids.extend(e.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int32)


# -------------------------------------------------------------------------- model
def make_config(arch: dict, vocab_size: int, max_pos: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=max_pos, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.02,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        attention_bias=False, mlp_bias=False, hidden_act="silu", use_cache=True, **arch)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


class Batches:
    """Deterministic, resumable data order: batch ``s`` is a pure function of
    (seed, s). Each epoch cuts the stream into ``seq+1``-token windows at an
    epoch-specific offset and visits them in a seeded random permutation."""

    def __init__(self, stream: torch.Tensor, seq: int, bs: int, seed: int):
        self.stream, self.seq, self.bs, self.seed = stream, seq, bs, seed
        self.n_windows = (len(stream) - 1 - seq) // seq  # leave room for any offset
        self._cache: dict[int, tuple[int, torch.Tensor]] = {}

    def _epoch(self, e: int):
        if e not in self._cache:
            g = torch.Generator().manual_seed(self.seed * 100003 + e)
            offset = 0 if e == 0 else int(torch.randint(0, self.seq, (1,), generator=g))
            perm = torch.randperm(self.n_windows, generator=g)
            self._cache = {e: (offset, perm)}
        return self._cache[e]

    def get(self, step: int) -> torch.Tensor:
        rows = []
        for j in range(self.bs):
            i = step * self.bs + j
            e, k = divmod(i, self.n_windows)
            offset, perm = self._epoch(e)
            start = offset + int(perm[k]) * self.seq
            rows.append(self.stream[start:start + self.seq + 1])
        return torch.stack(rows).long()


def lr_at(progress: float, step: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor*peak``
    as ``progress`` (fraction of the run done) goes from 0 to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def losses(model, x: torch.Tensor, exit_layers: list[int], exit_stride: int = 1):
    """Returns (final CE, [CE at each early exit]) for next-token prediction.

    The early exits are scored on every ``exit_stride``-th position only: their
    lm_head is a fifth of the step's matmul work, and a sample of positions
    carries the same auxiliary signal."""
    inp, tgt = x[:, :-1], x[:, 1:]
    out = model.model(input_ids=inp, output_hidden_states=bool(exit_layers), use_cache=False)
    V = model.config.vocab_size
    logits = model.lm_head(out.last_hidden_state)  # last_hidden_state is already normed
    main = F.cross_entropy(logits.float().reshape(-1, V), tgt.reshape(-1))
    exits = []
    sel = slice(exit_stride - 1, None, exit_stride)
    for k in exit_layers:
        h = model.model.norm(out.hidden_states[k][:, sel])  # hidden_states[k] = output of layer k
        lg = model.lm_head(h)
        exits.append(F.cross_entropy(lg.float().reshape(-1, V), tgt[:, sel].reshape(-1)))
    return main, exits


def autocast(args):
    """bf16 autocast on CPUs with native bf16 dot products (AVX512-BF16 / AMX);
    master weights, optimizer state and the loss stay fp32."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp == "bf16")


def phase_shape(step: int, steps: int, args) -> tuple[int, int]:
    """(batch, seq) at ``step``: short windows for most of the run (attention
    costs less), the last ``--long-frac`` of the steps at ``--long-seq`` so the
    model learns the context the engine serves. Tokens per step stay equal."""
    if args.long_frac > 0 and step >= int(steps * (1 - args.long_frac)):
        return max(1, args.bs * args.seq // args.long_seq), args.long_seq
    return args.bs, args.seq


def distil_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temp: float) -> torch.Tensor:
    """KL(teacher || student) per position at temperature ``temp`` (scaled by temp^2 as in
    Hinton et al.): the draft learns the main model's whole next-token distribution, which is
    what greedy agreement and speculative acceptance reward, rather than the data's one token."""
    V = student_logits.shape[-1]
    s = F.log_softmax(student_logits.float().reshape(-1, V) / temp, -1)
    t = F.log_softmax(teacher_logits.float().reshape(-1, V) / temp, -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temp * temp


def prefix_model(src, layers: int):
    """A Llama made of ``src``'s embedding, first ``layers`` decoder layers and final norm (its
    early exit after layer ``layers`` as a model of its own): the distilled draft starts where
    the main model's exit head already agrees with it."""
    from transformers import LlamaForCausalLM

    cfg = src.config.__class__.from_dict(src.config.to_dict())
    cfg.num_hidden_layers = layers
    for k in [k for k in vars(cfg) if k.startswith("dspark_")]:
        delattr(cfg, k)
    cfg._attn_implementation = "sdpa"
    m = LlamaForCausalLM(cfg)
    sd = {k: v for k, v in src.state_dict().items()
          if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return m.float()


def train_model(name: str, arch: dict, stream: torch.Tensor, args, exit_layers: list[int],
                exit_weight: float, steps: int, max_minutes: float, vocab_size: int,
                held: torch.Tensor | None = None, init=None, teacher=None):
    """Train ``name`` from scratch (``arch``), or from ``init`` (a model: continued training
    with a fresh optimizer). With ``teacher`` the loss is ``--distil-weight`` x the KL to the
    teacher's distribution plus the rest x the data's cross-entropy."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if init is not None:
        model = init.float().train()
    else:
        cfg = make_config(arch, vocab_size, args.max_pos)
        cfg._attn_implementation = "sdpa"
        model = LlamaForCausalLM(cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    shapes: dict[tuple[int, int], Batches] = {}

    def batch_at(step: int) -> torch.Tensor:
        bs, seq = phase_shape(step, steps, args)
        if (bs, seq) not in shapes:
            shapes[(bs, seq)] = Batches(stream, seq, bs, args.seed)
        return shapes[(bs, seq)].get(step)

    ckpt = Path(args.ckpt_dir) / f"{name}.pt"
    start, elapsed_before, history = 0, 0.0, []
    if args.resume and ckpt.exists():
        st = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start, elapsed_before, history = st["step"], st["elapsed"], st["history"]
        if st.get("done"):
            log(f"[{name}] checkpoint is complete ({start} steps), skipping training")
            return model, st["stats"]
        log(f"[{name}] resumed at step {start}")

    def save(step, elapsed, done=False, stats=None):
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "elapsed": elapsed, "history": history, "done": done, "stats": stats}, tmp)
        os.replace(tmp, ckpt)

    log(f"[{name}] {n_params(model)/1e6:.2f}M params, {steps} steps x {args.bs}x{args.seq} tokens, "
        f"exits={exit_layers} w={exit_weight}")
    model.train()
    t0 = time.time() - elapsed_before
    step = start
    stopped_early = False
    aux_names = [f"exit{k}" for k in exit_layers] + (["kl"] if teacher is not None else [])
    run = {"loss": 0.0, "exit": [0.0] * len(aux_names), "n": 0}
    while step < steps:
        # Progress through the run: by steps, or by wall time when a time budget
        # is given and binds first (this machine is shared, so its speed varies).
        # With a budget the run ends when either is used up; the cosine schedule
        # always completes.
        progress = step / steps
        if max_minutes:
            progress = max(progress, (time.time() - t0) / (max_minutes * 60))
        if progress >= 1.0:
            log(f"[{name}] time budget of {max_minutes} min used up at step {step}; stopping")
            stopped_early = True
            break
        lr = lr_at(progress, step, args.lr, args.warmup, args.lr_floor)
        for gparam in opt.param_groups:
            gparam["lr"] = lr
        x = batch_at(step)
        ul_step = teacher is None and args.seq_ul_every and step % args.seq_ul_every == args.seq_ul_every - 1
        with autocast(args):
            if ul_step:  # the model's own greedy loops, penalised (scripts/unlikelihood.py)
                loss, rep = seq_ul_loss(model, x, args.seq_ul_prefix, args.seq_ul_new, args.seq_ul_n,
                                        args.seq_ul_count)
                loss = args.seq_ul_weight * loss
                run["ul"] = run.get("ul", 0.0) + loss.item()
                run["rep"] = run.get("rep", 0.0) + rep
                run["n_ul"] = run.get("n_ul", 0) + 1
            elif teacher is None:
                main, exits = losses(model, x, exit_layers, args.exit_stride)
                loss = main + exit_weight * sum(exits)
            else:
                with torch.no_grad():
                    t_logits = teacher(input_ids=x[:, :-1], use_cache=False).logits
                s_logits = model(input_ids=x[:, :-1], use_cache=False).logits
                main = F.cross_entropy(s_logits.float().reshape(-1, s_logits.shape[-1]), x[:, 1:].reshape(-1))
                exits = [distil_loss(s_logits, t_logits, args.distil_temp)]
                loss = (1 - args.distil_weight) * main + args.distil_weight * exits[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if not ul_step:
            run["loss"] += main.item(); run["n"] += 1
            for i, e in enumerate(exits):
                run["exit"][i] += e.item()
        if step % args.log_every == 0 or step == steps:
            el = time.time() - t0
            n_mle = max(run["n"], 1)
            rec = {"step": step, "loss": run["loss"] / n_mle,
                   "exit_loss": [v / n_mle for v in run["exit"]], "lr": lr, "elapsed_s": round(el, 1)}
            if run.get("n_ul"):  # unlikelihood steps: their loss, and the share of continuation tokens repeated
                rec["ul_loss"], rec["greedy_repeats"] = run["ul"] / run["n_ul"], run["rep"] / run["n_ul"]
            if held is not None and args.eval_every and step % args.eval_every == 0:
                rec["heldout"] = curve_point(model, held, args.eval_seq, exit_layers)
                model.train()
            history.append(rec)
            log(f"[{name}] step {step}/{steps} loss {rec['loss']:.3f} "
                + " ".join(f"{k} {v:.3f}" for k, v in zip(aux_names, rec["exit_loss"]))
                + (f" ul {rec['ul_loss']:.3f} repeats {rec['greedy_repeats']:.3f}" if "ul_loss" in rec else "")
                + f" lr {lr:.2e} {el/60:.1f} min, {step*args.bs*args.seq/el:.0f} tok/s"
                + (f" held-out ppl {rec['heldout']['full']['perplexity']:.1f}"
                   f" top1 {rec['heldout']['full']['top1_accuracy']:.3f}" if "heldout" in rec else ""))
            run = {"loss": 0.0, "exit": [0.0] * len(aux_names), "n": 0}
        if step % args.ckpt_every == 0 and step < steps:
            save(step, time.time() - t0)
    elapsed = time.time() - t0
    stats = {"steps": step, "planned_steps": steps, "stopped_by_time_budget": stopped_early,
             "tokens_seen": step * args.bs * args.seq, "train_seconds": round(elapsed, 1),
             "final_train_loss": history[-1]["loss"] if history else None,
             "epochs": step * args.bs * args.seq / len(stream), "params": n_params(model),
             "history": history}
    save(step, elapsed, done=True, stats=stats)
    log(f"[{name}] done: {step} steps in {elapsed/60:.1f} min")
    return model, stats


def curve_point(model, held: torch.Tensor, seq: int, exit_layers: list[int]) -> dict:
    """Held-out figures on the first 32 windows, for the training curve only
    (nothing is selected by it: the weights kept are the last step's)."""
    ev = evaluate(model, held[: 32 * seq + 1], seq, exit_layers)
    return {h: {k: round(v, 4) for k, v in d.items()} for h, d in ev.items()}


def save_hf(model, out_dir: Path, tok, extra: dict):
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    for k, v in extra.items():
        setattr(model.config, k, v)
    m = model.to(torch.bfloat16)
    m.config.dtype = torch.bfloat16
    m.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                           pad_token_id=PAD_ID, do_sample=False)
    m.save_pretrained(out_dir, safe_serialization=True)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "bfloat16"  # older readers look for this key
    cfg.setdefault("dtype", "bfloat16")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_tokenizer(tok, out_dir)
    model.float()


# --------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq: int, exit_layers: list[int],
             preds: dict[str, list[torch.Tensor]] | None = None) -> dict:
    """Non-overlapping windows of seq+1 tokens over the held-out stream; every
    token after the first of a window is predicted once."""
    model.eval()
    V = model.config.vocab_size
    heads = ["full"] + [f"exit{k}" for k in exit_layers]
    nll = {h: 0.0 for h in heads}
    hit = {h: 0 for h in heads}
    n = 0
    windows = [stream[i:i + seq + 1] for i in range(0, len(stream) - 1, seq)]
    windows = [w for w in windows if len(w) >= 2]
    full = [w for w in windows if len(w) == seq + 1]
    groups = [torch.stack(full[i:i + 8]) for i in range(0, len(full), 8)]
    groups += [w[None] for w in windows if len(w) != seq + 1]
    for x in groups:
        x = x.long()
        inp, tgt = x[:, :-1], x[:, 1:].reshape(-1)
        out = model.model(input_ids=inp, output_hidden_states=bool(exit_layers), use_cache=False)
        hs = {"full": out.last_hidden_state}
        for k in exit_layers:
            hs[f"exit{k}"] = model.model.norm(out.hidden_states[k])
        for h in heads:
            lg = model.lm_head(hs[h]).float().reshape(-1, V)
            nll[h] += F.cross_entropy(lg, tgt, reduction="sum").item()
            top = lg.argmax(-1)
            hit[h] += (top == tgt).sum().item()
            if preds is not None:
                preds.setdefault(h, []).append(top)
        n += tgt.numel()
    return {h: {"perplexity": math.exp(nll[h] / n), "nll": nll[h] / n, "top1_accuracy": hit[h] / n,
                "tokens": n} for h in heads}


@torch.no_grad()
def slice_check(model, path: Path, windows: int = 16, seq: int = 256) -> dict:
    """Perplexity and top-1 on the first held-out windows as dspark's own tests cut them
    (``dspark.llm.quantization.evaluate.heldout_windows``), by transformers in fp32: the
    engine's forward must reproduce these from the saved weights."""
    from dspark.llm.quantization.evaluate import heldout_windows

    ws = heldout_windows(path, seq_len=seq, max_windows=windows)
    x = torch.tensor(ws, dtype=torch.long)
    lg = model(input_ids=x[:, :-1]).logits.float().reshape(-1, model.config.vocab_size)
    tgt = x[:, 1:].reshape(-1)
    nll = F.cross_entropy(lg, tgt).item()
    return {"windows": windows, "seq_len": seq, "perplexity": round(math.exp(nll), 4),
            "top1": round((lg.argmax(-1) == tgt).float().mean().item(), 5), "tokens": tgt.numel()}


def load_saved(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    return tok, model.float().eval()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def strip_flags(argv: list[str]) -> list[str]:
    """The training command: drop flags that only select stages / resume."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--resume":
            continue
        if a in ("--stages", "--ckpt-dir", "--out-dir", "--continued-from", "--draft-continued-from"):
            skip = True
            continue
        if a.startswith(("--stages=", "--ckpt-dir=", "--out-dir=", "--continued-from=", "--draft-continued-from=")):
            continue
        out.append(a)
    return out


def repeat_run(text: str) -> int:
    """Longest run of one identical non-blank line (1 = no line repeats back to back)."""
    best = run = 0
    prev = None
    for line in text.splitlines():
        if not line.strip():
            continue
        run = run + 1 if line == prev else 1
        prev, best = line, max(best, run)
    return best


def repeated_phrase(text: str, times: int = 3, longest: int = 12) -> str | None:
    """The first run of words (up to ``longest``) said ``times`` times back to back ("a list of a list
    of a list of"), or None: the loop a small model falls into."""
    words = text.split()
    for n in range(1, longest + 1):
        for i in range(len(words) - times * n + 1):
            if all(words[i + k * n:i + (k + 1) * n] == words[i:i + n] for k in range(1, times)):
                return " ".join(words[i:i + n])
    return None


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fmt_pct(x):
    return f"{100*x:.2f}%"


def write_card(path: Path, kind: str, info: dict):
    d, s, ev, a = info["data"], info["stats"], info["eval"], info["args"]
    cfg = json.loads((path / "config.json").read_text())
    rows = "\n".join(
        f"| {h} | {v['perplexity']:.3f} | {fmt_pct(v['top1_accuracy'])} | {v['tokens']} |"
        for h, v in ev.items() if h != "slice")
    slice_md = (f"The engine's own tests re-measure the first {ev['slice']['windows']} held-out windows of "
                f"{ev['slice']['seq_len']} tokens (as `dspark.llm.quantization.evaluate.heldout_windows` cuts them): "
                f"perplexity {ev['slice']['perplexity']:.3f}, top-1 {fmt_pct(ev['slice']['top1'])} "
                "(recorded in `config.json` as `dspark_heldout_slice`)." if "slice" in ev else "")
    if kind == "main":
        title = "stdlib-llama — DSpark's embedded default model"
        blurb = ("A small Llama-architecture causal LM trained from scratch on the Python "
                 "standard library's own source code. It is the model DSpark ships and tests "
                 "with (no downloads needed). Its first layers were trained to predict the "
                 "next token on their own (LayerSkip-style early-exit loss), so a prefix of the "
                 "model can draft for the whole model (self-speculation); the exit layers are "
                 "recorded in `config.json` as `dspark_early_exit_layers`.")
        objective = (f"Next-token cross-entropy of the full model plus {a['exit_weight']} x the "
                     f"cross-entropy of the early exit(s) after layer(s) {info['exit_layers']} "
                     "(hidden state -> final RMSNorm -> shared tied lm_head).")
        if a.get("seq_ul_every"):
            objective += (f" Every {a['seq_ul_every']}th step instead: sequence-level unlikelihood (Welleck et al. "
                          f"2019, `scripts/unlikelihood.py`) on {a['seq_ul_count']} greedy continuations of "
                          f"{a['seq_ul_new']} tokens from {a['seq_ul_prefix']}-token prefixes of the step's "
                          f"windows: each continuation token that repeats a {a['seq_ul_n']}-gram of its row is "
                          "penalised by -log(1 - p), so greedy decoding falls into loops less often.")
    else:
        title = "stdlib-llama-draft — draft model for stdlib-llama"
        blurb = ("A much smaller Llama-architecture causal LM with the same tokenizer as "
                 "`stdlib-llama`, trained on the same data, for use as the separate draft "
                 "model in speculative decoding.")
        objective = "Plain next-token cross-entropy."
        if a.get("distil_weight"):
            objective = (f"Distilled from `stdlib-llama`: {a['distil_weight']} x the KL divergence from the main "
                         f"model's next-token distribution (temperature {a.get('distil_temp', 1.0)}) plus "
                         f"{1 - a['distil_weight']:.2g} x the data's cross-entropy, on every position.")
        if a.get("draft_init"):
            objective += (f" Initialised from the main model's embedding, first {a['draft_init']} decoder layers "
                          "and final norm (its early exit as a model of its own), so it starts where that exit "
                          "already agrees with the main model.")
        if a.get("draft_from"):
            objective += (f" Continued from the weights of the previous draft (`{Path(a['draft_from']).name}`, "
                          "same architecture" + (f": {a['draft_continued_from']}" if a.get("draft_continued_from") else "")
                          + ") with a fresh optimizer.")
    long_bs = max(1, a['bs'] * a['seq'] // a.get('long_seq', a['seq']))
    if a.get("long_frac", 0) >= 1.0:
        batches_line = f"Batches: {long_bs} x {a.get('long_seq', a['seq'])} tokens on every step."
    else:
        batches_line = (f"Batches: {a['bs']} x {a['seq']} tokens for the first {100 * (1 - a.get('long_frac', 0)):.0f}% "
                        f"of the steps, then\n  {long_bs} x {a.get('long_seq', a['seq'])} (same tokens per step) so "
                        "the last phase trains the longer context.")
    continued_line = ""
    if kind == "main" and a.get("main_init"):
        continued_line = (f"- Continued training: the weights start from `{a['main_init']}`: "
                          f"{info.get('continued_from', 'see git history')}; a fresh optimizer; the "
                          "steps, tokens and curve below are this run's.")
    extra_md = ""
    if d.get("n_extra_train_files"):
        extra_md = (f"\n  The training files include {d['n_extra_train_files']} training-only files (never held out) "
                    f"from the folders {', '.join('`' + x + '`' for x in a['extra_train_dirs'].split(','))}, leaving "
                    "out every file named after a held-out module or in a folder that is (its tests: "
                    "`test/test_turtle.py`, `test/test_asyncio/test_futures.py`, ...), so that no held-out "
                    "module's own tests were trained on. "
                    + ("The tokenizer was trained on them too." if "tokenizer" in a["stages"].split(",")
                       else "The tokenizer was trained earlier, without them."))
    exit_line = (f"- Early exit scored on every {a.get('exit_stride', 1)}th position "
                 f"(weight {a['exit_weight']})." if kind == "main" else "")
    curve_rows = "\n".join(
        f"| {h['step']} | {h['step'] * a['bs'] * a['seq']:,} | {h['loss']:.3f} | "
        f"{h['heldout']['full']['perplexity']:.2f} | {fmt_pct(h['heldout']['full']['top1_accuracy'])} |"
        for h in s.get("history", []) if "heldout" in h)
    samples_md = "\n\n".join(
        f"Prompt `{p!r}`:\n\n```python\n{t}\n```" for p, t in info.get("samples", []))
    text = f"""# {title}

{blurb}

Everything here was produced by `scripts/train_default_model.py` on CPU; the
figures below were measured by that script, not estimated.

## Data

- Source: the `.py` files of the CPython {d['python_version']} standard library
  (`sysconfig.get_paths()["stdlib"]`), excluding the directories
  {', '.join('`'+x+'`' for x in sorted(EXCLUDED_DIRS))} and files larger than
  {MAX_FILE_BYTES // 1024} KiB; sorted by relative path.
- Files: {d['n_files']} in all, {d['n_train_files']} for training
  ({d['train_bytes']/1e6:.2f} MB, {d['train_tokens']:,} tokens),
  {d['n_heldout_files']} held out ({d['heldout_bytes']/1e6:.2f} MB, {d['heldout_tokens']:,} tokens).{extra_md}
- Held-out rule: a file is held out iff
  `int.from_bytes(sha256(relpath.encode()).digest()[:8], "big") % 1000 < {HELDOUT_PER_MILLE}`
  (≈3% of files in expectation; with this stdlib it picks {d['n_heldout_files']} of {d['n_files']} files,
  {100*d['heldout_bytes']/(d['heldout_bytes']+d['train_bytes']):.1f}% of the bytes). The list is in
  `heldout_files.txt`{'' if kind == 'main' else ' of `stdlib-llama`'}; none of these files was seen in training
  (tokenizer included).
- Each file is encoded as `<s> file-tokens </s>` and the files are concatenated.

## Tokenizer

Byte-level BPE (`tokenizers`), vocabulary {info['vocab_size']}, special tokens
`<s>`=0, `</s>`=1, `<unk>`=2, `<pad>`=3, trained on the training files only.
The tokenizer prepends `<s>`. Loads with `transformers.AutoTokenizer`
(PreTrainedTokenizerFast); `tokenizer_config.json` carries a simple chat template.

## Architecture

`LlamaForCausalLM`: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers,
{cfg['num_attention_heads']} attention heads / {cfg['num_key_value_heads']} KV heads (GQA),
head dim {cfg['hidden_size'] // cfg['num_attention_heads']}, SwiGLU MLP {cfg['intermediate_size']},
RMSNorm, RoPE (theta 10000), tied input/output embeddings,
max positions {cfg['max_position_embeddings']} (trained on {a['seq']}-token windows).
**Parameters: {s['params']:,}** (tied weights counted once). Stored in bfloat16
(`model.safetensors`).

## Training

- Objective: {objective}
- AdamW (betas 0.9/0.95, weight decay {a['wd']} on matrices), peak lr {a['lr']},
  {a['warmup']} warm-up steps then cosine decay to {100 * a.get('lr_floor', 0.1):.0f}%, gradient clipping 1.0; fp32 master
  weights with {'bf16 autocast' if a.get('amp') == 'bf16' else 'fp32 compute'} on CPU ({info['threads']} threads).
- {batches_line}
{continued_line}
{exit_line}
- Steps: {s['steps']} (planned {s['planned_steps']}{', ended by the wall-time budget' if s['stopped_by_time_budget'] else ''});
  tokens seen: {s['tokens_seen']:,} ({s['epochs']:.2f} epochs of the training stream);
  final training loss (last logging interval, full model): {s['final_train_loss']:.3f}.
- Wall time: {s['train_seconds']/60:.1f} min on {info['machine']}, {s['tokens_seen'] / s['train_seconds']:.0f} tokens/s
  overall (held-out curve points included); `scripts/train_throughput.py` measures each configuration.
- Seed: {a['seed']} (model init; the data order is a pure function of seed and step).

### Held-out curve

Measured during training on the first 32 held-out windows of {a.get('eval_seq', a['seq'])} tokens (reporting only:
the weights kept are the last step's, nothing was selected by this curve).

| step | tokens seen | training loss | held-out perplexity | held-out top-1 |
|---|---|---|---|---|
{curve_rows}

## Held-out evaluation

Held-out files, concatenated as in training, cut into non-overlapping windows of
{a.get('eval_seq', a['seq'])}+1 tokens (stride {a.get('eval_seq', a['seq'])}; every token but a window's first is predicted
exactly once, with the window's preceding tokens as context); weights loaded from
this directory in bfloat16 and cast to float32; top-1 = greedy argmax equals the
actual next token.

| head | perplexity | top-1 next-token accuracy | tokens |
|---|---|---|---|
{rows}

{'`full` is the whole model; `exitK` is the early exit after layer K (final norm + lm_head).' if kind == 'main' else ''}

{info.get('agreement_md', '')}

{slice_md}

## Greedy completions ({info.get('sample_tokens', 40)} new tokens, from this directory)

{samples_md}

## Limitations

A tiny model trained on two CPU cores on ~10 MB of one code base: it produces
plausible-looking Python in the standard library's style, not correct programs,
and knows nothing else. It exists so that DSpark's runtime, speculative decoding
and quantization paths can be run and tested on a real, trained model offline.
Context beyond {a.get('long_seq', a['seq'])} tokens was never trained.

## Reproduce

```
{info['command']}
```

(from the repository root, with `transformers`, `tokenizers`, `safetensors` and CPU
torch installed; python {d['python_version']} — another Python version has a different
standard library and so gives different data). The wall-time budget
({a['main_max_minutes'] if kind == 'main' else a['draft_max_minutes']} min) {'was the binding limit, so the step count and the learning-rate schedule followed the machine speed (a shared 2-core machine); to repeat this exact run without timing dependence, pass `--main-steps`/`--draft-steps` equal to the steps above and a budget of 0 (the schedule then follows the step count instead of the clock, a slightly different schedule)' if s['stopped_by_time_budget'] else 'did not bind: the run is a deterministic function of the arguments and seed'}.
"""
    (path / "README.md").write_text(text)


# --------------------------------------------------------------------------- main
def main():
    global MAIN_DIR, DRAFT_DIR
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="tokenizer,main,draft,eval")
    ap.add_argument("--main-steps", type=int, default=4000)
    ap.add_argument("--draft-steps", type=int, default=2000)
    ap.add_argument("--main-max-minutes", type=float, default=0, help="wall-time budget; the lr schedule follows it when it binds (0 = none)")
    ap.add_argument("--draft-max-minutes", type=float, default=0, help="wall-time budget; the lr schedule follows it when it binds (0 = none)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256, help="window of the first (short) phase")
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--long-seq", type=int, default=512, help="window of the last phase")
    ap.add_argument("--long-frac", type=float, default=0.15, help="fraction of the steps at --long-seq")
    ap.add_argument("--eval-seq", type=int, default=512, help="held-out window")
    ap.add_argument("--eval-every", type=int, default=250, help="held-out curve point every N steps (0 = none)")
    ap.add_argument("--amp", choices=["bf16", "none"],
                    default="bf16" if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() else "none")
    ap.add_argument("--exit-stride", type=int, default=4, help="score the early exit on every Nth position")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lr-floor", type=float, default=0.1, help="the cosine ends at this fraction of --lr")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--main-init", default="",
                    help="continue the main model from this saved model directory (fresh optimizer)")
    ap.add_argument("--continued-from", default="",
                    help="what --main-init's weights were (their training, the commit), for the model card")
    ap.add_argument("--draft-init", type=int, default=0,
                    help="start the draft from the (new) main model's embedding and first N layers (0 = from scratch)")
    ap.add_argument("--draft-from", default="",
                    help="continue the draft from this saved model (e.g. the committed stdlib-llama-draft)")
    ap.add_argument("--draft-continued-from", default="", help="what --draft-from was, for the card")
    ap.add_argument("--distil-weight", type=float, default=0.0,
                    help="weight of the KL to the main model's distribution in the draft's loss (0 = plain CE)")
    ap.add_argument("--distil-temp", type=float, default=1.0)
    ap.add_argument("--seq-ul-every", type=int, default=0,
                    help="every Nth main step is a sequence-level unlikelihood step on the model's own greedy "
                         "continuations (scripts/unlikelihood.py; 0 = none)")
    ap.add_argument("--seq-ul-prefix", type=int, default=64, help="prefix tokens the continuations start from")
    ap.add_argument("--seq-ul-new", type=int, default=96, help="greedy tokens per continuation")
    ap.add_argument("--seq-ul-n", type=int, default=6, help="an n-gram seen before in the row marks a repeat")
    ap.add_argument("--seq-ul-count", type=int, default=16, help="continuations per unlikelihood step")
    ap.add_argument("--seq-ul-weight", type=float, default=1.0)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--exit-layers", default="2")
    ap.add_argument("--exit-weight", type=float, default=0.3)
    ap.add_argument("--max-pos", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--extra-train-dirs", default="",
                    help="comma-separated stdlib folders (test,idlelib,...) added to the training stream only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--ckpt-dir", default="/tmp/dspark_train_ckpt")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--sample-tokens", type=int, default=48, help="new tokens per greedy completion in the card")
    ap.add_argument("--out-dir", default=str(MAIN_DIR.parent),
                    help="where stdlib-llama/ and stdlib-llama-draft/ are written (the tokenizer is "
                         "read from the committed model when the tokenizer stage is skipped)")
    args = ap.parse_args()
    if args.draft_init and args.draft_from:
        ap.error("--draft-init and --draft-from both say where the draft starts: give one")
    committed = MAIN_DIR
    MAIN_DIR = Path(args.out_dir) / "stdlib-llama"
    DRAFT_DIR = Path(args.out_dir) / "stdlib-llama-draft"
    stages = set(args.stages.split(","))
    exit_layers = [int(x) for x in args.exit_layers.split(",") if x]
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    Path(args.ckpt_dir).mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    root = stdlib_root()
    files = list_corpus(root)
    heldout = [f for f in files if is_heldout(f)]
    train = [f for f in files if not is_heldout(f)]
    extra = list_extra(root, [d for d in args.extra_train_dirs.split(",") if d], heldout)
    train += extra
    train_texts = [read_text(root, f) for f in train]
    held_texts = [read_text(root, f) for f in heldout]
    log(f"stdlib {root}: {len(files)} files + {len(extra)} training-only, {len(train)} train, "
        f"{len(heldout)} held out")

    if "tokenizer" in stages:
        tok = train_tokenizer(train_texts, args.vocab_size, MAIN_DIR, args.max_pos)
        log(f"tokenizer trained: {len(tok)} tokens")
    else:
        tok = AutoTokenizer.from_pretrained(MAIN_DIR if (MAIN_DIR / "tokenizer.json").exists() else committed)
    MAIN_DIR.mkdir(parents=True, exist_ok=True)
    (MAIN_DIR / "heldout_files.txt").write_text("\n".join(heldout) + "\n")
    train_stream = encode_files(tok, train_texts)
    held_stream = encode_files(tok, held_texts)
    data = {"python_version": platform.python_version(), "stdlib": str(root),
            "n_files": len(files), "n_extra_train_files": len(extra), "n_train_files": len(train), "n_heldout_files": len(heldout),
            "train_bytes": sum(len(t.encode()) for t in train_texts),
            "heldout_bytes": sum(len(t.encode()) for t in held_texts),
            "train_tokens": len(train_stream), "heldout_tokens": len(held_stream)}
    log(f"data: {json.dumps(data)}")

    trained_len = args.long_seq if args.long_frac > 0 else args.seq  # the longest window trained
    extra_main = {"dspark_early_exit_layers": exit_layers, "dspark_early_exit_loss_weight": args.exit_weight,
                  "dspark_train_seq_len": trained_len, "dspark_role": "main"}
    extra_draft = {"dspark_role": "draft", "dspark_draft_for": "stdlib-llama", "dspark_train_seq_len": trained_len}

    if "main" in stages:
        init = load_saved(Path(args.main_init))[1] if args.main_init else None
        m, stats = train_model("main", MAIN_ARCH, train_stream, args, exit_layers, args.exit_weight,
                               args.main_steps, args.main_max_minutes, len(tok), held_stream, init=init)
        save_hf(m, MAIN_DIR, tok, extra_main)
        del m
    if "draft" in stages:
        teacher = init = None
        if args.distil_weight or args.draft_init:
            teacher = load_saved(MAIN_DIR)[1]
            for p_ in teacher.parameters():
                p_.requires_grad_(False)
            init = prefix_model(teacher, args.draft_init) if args.draft_init else None
            teacher = teacher if args.distil_weight else None
        if args.draft_from:
            init = load_saved(Path(args.draft_from))[1]
        m, stats = train_model("draft", DRAFT_ARCH, train_stream, args, [], 0.0,
                               args.draft_steps, args.draft_max_minutes, len(tok), held_stream,
                               init=init, teacher=teacher)
        del teacher
        save_hf(m, DRAFT_DIR, tok, extra_draft)
        del m

    if "eval" in stages:
        cmd = "python scripts/train_default_model.py " + shlex.join(strip_flags(sys.argv[1:]))
        main_preds: dict[str, torch.Tensor] = {}
        machine = (f"{os.cpu_count()} cores of an {cpu_name()} (torch {torch.__version__}, "
                   f"{args.threads} threads; the machine was shared with other jobs, so times are "
                   "indicative only)")
        for kind, path, layers in (("main", MAIN_DIR, exit_layers), ("draft", DRAFT_DIR, [])):
            if not (path / "config.json").exists():
                log(f"[{kind}] no model in {path}: not evaluated")
                continue
            ckpt = Path(args.ckpt_dir) / f"{kind}.pt"
            # Without this run's checkpoint (a draft trained beside the committed main model) the model is
            # evaluated for the agreement figures but its card, not this run's, is left as it is.
            stats = torch.load(ckpt, map_location="cpu", weights_only=False)["stats"] if ckpt.exists() else None
            tok2, model = load_saved(path)
            t = time.time()
            preds: dict[str, list[torch.Tensor]] = {}
            ev = evaluate(model, held_stream, args.eval_seq, layers, preds)
            log(f"[{kind}] held-out eval ({time.time()-t:.0f}s): {json.dumps(ev)}")
            flat = {h: torch.cat(v) for h, v in preds.items()}
            if kind == "main":
                main_preds = flat
            agreement = {(h if kind == "main" else "draft model"): (v == main_preds["full"]).float().mean().item()
                         for h, v in flat.items() if not (kind == "main" and h == "full")}
            for h, v in agreement.items():
                ev[h if kind == "main" else "full"]["greedy_agreement_with_main"] = v
            if stats is None:
                log(f"[{kind}] greedy agreement with the main model: {json.dumps(agreement)}; no checkpoint in "
                    f"{args.ckpt_dir}, so its card is left as it is")
                del model
                continue
            agreement_md = ("Greedy agreement with the main model (teacher-forced on the same held-out windows: "
                            "the share of positions where this head's argmax equals the full model's): "
                            + ", ".join(f"`{h}` {fmt_pct(v)}" for h, v in agreement.items()) + ".")
            # greedy completions from the saved directory
            samples = []
            for prompt in SAMPLE_PROMPTS:
                enc = tok2(prompt, return_tensors="pt")
                out = model.generate(**enc, max_new_tokens=args.sample_tokens, do_sample=False,
                                     pad_token_id=PAD_ID)
                text = tok2.decode(out[0], skip_special_tokens=True)
                samples.append((prompt, text))
                log(f"[{kind}] {prompt!r} -> {text!r} (longest run of one repeated line: {repeat_run(text)}; "
                    f"phrase said three times running: {repeated_phrase(text)!r})")
            if kind == "main":
                ev["slice"] = slice_check(model, path)
                log(f"[{kind}] engine-check slice: {ev['slice']}")
                cfg_path = path / "config.json"
                cfg = json.loads(cfg_path.read_text())
                cfg["dspark_heldout_slice"] = ev["slice"]
                cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            info = {"data": data, "stats": stats, "eval": ev, "args": vars(args), "exit_layers": layers,
                    "vocab_size": len(tok2), "threads": args.threads, "machine": machine,
                    # A continued draft is trained beside the main model already in --out-dir.
                    "command": cmd + (" --stages draft,eval" if kind == "draft" and args.draft_from else ""),
                    "continued_from": args.continued_from or "see git history",
                    "samples": samples, "sample_tokens": args.sample_tokens,
                    "agreement_md": agreement_md if agreement else ""}
            write_card(path, kind, info)
            summary = {k: v for k, v in info.items() if k not in ("args",)}
            summary["stats"] = {k: v for k, v in stats.items() if k != "history"}
            (Path(args.ckpt_dir) / f"{kind}_summary.json").write_text(json.dumps(summary, indent=2))
            del model
        for p in (MAIN_DIR, DRAFT_DIR):
            log(f"{p}: {dir_size(p)/1e6:.2f} MB")
        log(f"total: {(dir_size(MAIN_DIR) + dir_size(DRAFT_DIR))/1e6:.2f} MB")
    # the draft shares the tokenizer: keep its files identical to the main model's
    if DRAFT_DIR.exists():
        for f in TOKENIZER_FILES:
            if (MAIN_DIR / f).exists():
                shutil.copyfile(MAIN_DIR / f, DRAFT_DIR / f)


if __name__ == "__main__":
    main()
