"""Which target runs the engine's decoder: the plugins bid, the engine measures, the fastest runs.

Every device-driving plugin is asked ``dspark_decoder_bid`` for every device it
reported. Bids that fit the device's memory are compiled one at a time, checked against
the torch runner on a short probe scenario (a bid is a promise: a decoder whose
logits are wrong is charged to its plugin and dropped), timed beside the torch
runner at the engine's step shapes (timing.py) and let go before the next is
compiled. Timings are cached on disk per model fingerprint, runtime version and
threads, so a warm start only compiles and checks the winner. The ranked list
is the failover order (the torch runner last); a failover target is compiled
when a failover reaches it. Once a compiled decoder wins, the torch runner's
weights go too (read from disk again if a failover must run it): the weights
are held once, in the form that runs.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dspark.host import cache as disk
from dspark.host import hook_threads, hostinfo, progress
from dspark.host.log import get_logger
from dspark.llm.decoding import stored
from dspark.llm.decoding.conformance import PROBE_SCENARIO, probe_blocks, record, replay
from dspark.llm.decoding.runner import REFERENCE, DecoderRunner, Target
from dspark.llm.decoding.spec import SpecWeights, float_runner, make_spec
from dspark.llm.decoding.timing import (CONTEXT, Bench, Contention, averaged, close_calls, contention_now, retime,
                                       retime_enabled, scores, shapes, time_targets, was_busy)
from dspark.llm.device_map import chain as ranges
from dspark.sdk.decoder import is_sequence

if TYPE_CHECKING:
    from dspark.host.inventory import Inventory
    from dspark.host.plugin_manager import PluginHost
    from dspark.llm.config import EngineConfig
    from dspark.llm.runner.model import ModelRunner
    from dspark.sdk.decoder import CompiledDecoder, DecoderSpec, SequenceDecoder
    from dspark.types import DecoderBid, Device, QuantSpec

log = get_logger("dspark.llm.decoder")
_NAMESPACE = "decoder-timings-v6"  # v6: with the other processes' share of the cores (busy); v5: settled blocks


@dataclass
class DecoderChoice:
    """What runs the model and why: every bid (declined ones with their reason), the timings, the winner."""

    chosen: str
    reason: str
    ranked: list[dict[str, Any]] = field(default_factory=list)  # label, runtime, score, step_ms, best first
    declined: list[dict[str, str]] = field(default_factory=list)  # label, reason
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "reason": self.reason, "ranked": self.ranked, "declined": self.declined,
                "seconds": round(self.seconds, 3)}


def _wanted(choice: str, bid: DecoderBid) -> bool:
    """``choice``: 'auto', or a comma-separated list of PLUGIN or PLUGIN@DEVICE."""
    if choice == "auto":
        return True
    for one in choice.split(","):
        plugin, _, device = one.partition("@")
        if bid.plugin == plugin and (not device or bid.device_id == device):
            return True
    return False


def _fits(bid: DecoderBid, device: Device, max_tokens: int) -> str | None:
    need = bid.weight_bytes + bid.kv_bytes_per_token * max_tokens
    free = device.memory_free_bytes
    if free is not None and need > free:
        return f"needs {need / 2**20:.0f} MiB (weights and KV for {max_tokens} tokens), {free / 2**20:.0f} MiB free"
    return None


def collect_bids(spec: DecoderSpec, host: PluginHost, inv: Inventory) -> list[tuple[DecoderBid, Device]]:
    out = []
    for dev in inv.drivers():
        bid = host.call(dev.plugin, "dspark_decoder_bid", decoder=spec, device=dev)
        if bid is not None:
            out.append((bid, dev))
    return out


def _fake_quant_reference(path: Path, dtype: torch.dtype, quant: dict[str, QuantSpec]) -> ModelRunner:
    """The float checkpoint with the plan's weights quantized and dequantized as the canonical rounding does:
    what a plugin running the plan natively should match (the engine's own kernels may have kept some float)."""
    from dspark.llm.quantization.fake import fake_linear, quantize_rows_int8
    from dspark.llm.runner.layout import EMBED

    ref = float_runner(path, dtype)
    for name, q in quant.items():
        if name == EMBED:
            ref.set_embedding_int8(*quantize_rows_int8(ref.embed))
            continue
        group = None if q.granularity == "per_channel" else q.group_size
        ref.set_linear(name, fake_linear(ref.weight_t(name), q.weight_bits, group, q.activations == "dynamic_int8"))
    return ref


def _probe(decoder: CompiledDecoder | SequenceDecoder, reference: ModelRunner, spec: DecoderSpec,
           precision: str | None = None, recorded: Callable[[], None] | None = None) -> str | None:
    """Why the decoder's logits cannot be trusted, or None (float32: rounding only; half precision or
    quantized: a few flips; a broken decoder is far off both). ``precision``: what the bid said it computes
    in (a BF16 GGUF file run as stored computes in bfloat16 whatever dtype the engine chose).
    ``recorded``: called once the reference's part is done, before the decoder's first step."""
    bs = 16 if is_sequence(decoder) else decoder.block_size  # type: ignore[union-attr]
    blocks = probe_blocks(bs)
    transcript = record(reference, bs, num_blocks=blocks, **PROBE_SCENARIO)
    if recorded is not None:
        recorded()
    r = replay(decoder, transcript, reference.cfg, reference.dtype, num_blocks=blocks)
    return r.why_not(exact(spec, precision))


def exact(spec: DecoderSpec, precision: str | None) -> bool:
    """Float32 on both sides: the probe allows rounding only."""
    return (spec.dtype == "float32" and not spec.quantization and "gguf_stored" not in spec.features
            and precision in (None, "float32"))


def _probe_here(t: Target, spec: DecoderSpec) -> str | None:
    """The probe of a stored file's decoder whose plugin lives in this process only, the reference loaded here
    as a probe's child loads it: the file dequantized at use, within its memory budget (gguf.reference), and
    let go after the probe (the torch runner proper loads only for a failover)."""
    from dspark.llm.gguf.reference import reference_runner

    assert t.compiled is not None
    try:
        return _probe(t.compiled, reference_runner(spec.path, spec.dtype), spec, t.precision)
    except Exception as exc:
        return f"the probe step raised {type(exc).__name__}: {exc}"


def _admit(t: Target, reference: ModelRunner, spec: DecoderSpec, host: PluginHost,
           declined: list[dict[str, str]], load_reference: Callable[[], ModelRunner] | None = None,
           recorded: Callable[[], None] | None = None) -> bool:
    """Run the probe scenario on ``t``; a wrong or failing decoder is charged to its plugin and left out."""
    assert t.compiled is not None
    try:
        if getattr(reference, "is_weightless", False):
            bad = stored.probe_isolated(t, spec, None if load_reference is None else functools.partial(
                _probe_here, t, spec), host)
        else:
            bad = _probe(t.compiled, reference, spec, t.precision, recorded)
    except Exception as exc:
        bad = f"the probe step raised {type(exc).__name__}: {exc}"
    if bad:
        declined.append({"label": t.label, "reason": bad})
        part = getattr(t.compiled, "failed_part", None)
        plugin, device = (part.plugin, part.device.id) if part is not None else (t.plugin, t.device_id)
        if plugin is not None:
            host.charge(plugin, "decoder.probe", bad, device=device)
    return not bad


def _split(host: PluginHost, inv: Inventory, runner: ModelRunner, spec: DecoderSpec,
           short: list[tuple[DecoderBid, Device]], max_tokens: int, declined: list[dict[str, str]]) -> Target | None:
    dtype = str(runner.dtype).replace("torch.", "")
    placed = ranges.map_ranges(host, inv, runner.cfg, spec, short, max_tokens, dtype)
    if isinstance(placed, str):
        declined.append({"label": "layer ranges", "reason": placed})
        return None
    devices = {d: dev for d, (_, dev) in ranges.first_per_device(short).items()}
    chain = ranges.build(host, spec, placed, devices)
    if isinstance(chain, str):
        declined.append({"label": "layer ranges", "reason": chain})
        return None
    hand = {n: ranges.handover_s(spec, placed, devices, t) * 1e3 for n, t in (("decode_b1", 1), ("prefill_128", 128))}
    runtimes = " + ".join(dict.fromkeys(devices[s.device_id].runtime for s in placed.stages()))
    return Target(chain.describe(), runtimes, chain, None, None, exit_layers=True, any_block=False,
                  note="hidden state handed over: " + ", ".join(f"{k} {v:.3f} ms" for k, v in hand.items()),
                  device_map=placed, weight_bytes=placed.weight_bytes())


def choose_decoder(runner: ModelRunner, path: Path, cfg: EngineConfig, *, host: PluginHost, inv: Inventory,
                   quantization: dict[str, QuantSpec] | None = None,
                   stored: bool = False,
                   load_reference: Callable[[], ModelRunner] | None = None,
                   prepare_reference: Callable[[ModelRunner], None] | None = None,
                   ) -> tuple[ModelRunner | DecoderRunner, DecoderChoice]:
    """The runner the engine should use, and why. ``cfg.decoder``: 'auto', or 'PLUGIN[@DEVICE]'.
    ``stored``: a quantized GGUF file, offered only to decoders that run it as stored (``gguf_stored``).
    ``runner`` may be weightless (``ModelRunner.weightless``): then the targets are probed in a process of
    their own, not timed against the torch runner (the file's size is the point: it runs as stored), and
    ``load_reference`` loads the torch runner if a failover ever needs it. ``prepare_reference`` readies
    the torch runner before it is timed (its packed copies: timed as it would run)."""
    t0 = time.perf_counter()
    spec = make_spec(runner, path, max_num_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_batch_size,
                     quantization=quantization, extra_features=frozenset({"gguf_stored"}) if stored else frozenset())
    max_tokens = cfg.max_total_tokens or 8192
    declined: list[dict[str, str]] = []
    candidates: list[tuple[DecoderBid, Device]] = []
    short: list[tuple[DecoderBid, Device]] = []  # bid, but the device's memory cannot hold the whole model
    for bid, dev in collect_bids(spec, host, inv):
        label = f"{bid.plugin}@{bid.device_id}"
        if not _wanted(cfg.decoder, bid):
            continue
        small = None if bid.declined else _fits(bid, dev, max_tokens)
        if not bid.declined and bid.max_seqs is not None and bid.max_seqs < cfg.max_batch_size:
            declined.append({"label": label, "reason": f"holds at most {bid.max_seqs} sequences; the engine's "
                                                       f"max_batch_size is {cfg.max_batch_size}"})
            continue
        if bid.declined or small:
            declined.append({"label": label, "reason": bid.declined or small or ""})
            if small:
                short.append((bid, dev))
        else:
            candidates.append((bid, dev))
    reference = runner if not quantization or not (candidates or short) else _fake_quant_reference(
        path, runner.dtype, quantization)
    weightless = getattr(runner, "is_weightless", False)
    # Compiled only while needed: one at a time while timed, then the winner; the others are compiled again
    # only if a failover reaches them, so no fallback holds a copy of the weights meanwhile.
    targets = [_pending(bid, dev, host, spec) for bid, dev in candidates]
    ref = Target(REFERENCE, f"torch {torch.__version__}")
    from dspark.llm.runner.model import ModelRunner

    load_reference = load_reference or (lambda: ModelRunner.from_pretrained(str(path), runner.dtype))
    slower: list[Target] = []  # measured slower than the torch runner: neither run nor are failover targets
    if weightless and cfg.decoder == "auto" and len(targets) > 1:  # several run it as stored: the fastest
        timed = _time(targets, ref, runner, runner, spec, cfg, host, declined, load_reference=load_reference)
        targets = sorted(timed, key=lambda t: t.score)
        why = "runs the quantized GGUF file as stored, measured fastest of those that do ({}; the torch " \
              "runner, which would hold it dequantized, is the fallback, loaded from the file if it must run)"
    elif weightless:  # the torch runner would hold the file dequantized: fallback only
        why = "runs the quantized GGUF file as stored ({}; the torch runner, which would hold it dequantized, " \
              "is the fallback, loaded from the file if it must run)"
    elif cfg.decoder == "auto":
        timed = _time(targets, ref, runner, reference, spec, cfg, host, declined, prepare_reference)
        targets = sorted([t for t in timed if t.score < ref.score], key=lambda t: t.score)
        slower = [t for t in timed if t.score >= ref.score]
        why = "measured fastest ({})"
    else:  # asked for by name: no race, the torch runner only as the fallback
        why = f"decoder={cfg.decoder!r} asked for it" + " ({})"
    early = None if weightless or quantization or reference is not runner else functools.partial(
        _let_go, runner, spec, load_reference)
    first = None
    while targets:  # the best that compiles and keeps its promise runs
        t = targets[0]
        if _ready(t, reference, spec, host, declined, load_reference, early):
            first = t
            break
        targets.pop(0)
    if first is None and early is not None and runner.is_weightless:  # let go for a target that then failed
        runner = reference = load_reference()
    if first is None and not slower and len(short) > 1:  # no device holds it: layer ranges over several
        chain = _split(host, inv, runner, spec, short, max_tokens, declined)
        if chain is not None and _admit(chain, reference, spec, host, declined):
            first = chain
            targets = [chain]
    if first is None and slower:  # every target measured slower than the torch runner
        ranked = sorted([*slower, ref], key=lambda t: t.score)
        rows = [_row(t) for t in ranked]
        choice = DecoderChoice(REFERENCE, "measured fastest ({})".format(_beat(ref, ranked)), rows, declined,
                               time.perf_counter() - t0)
        _log(choice)
        return runner, choice
    if first is None:
        why = "no plugin bid on the decoder" if not declined else "every bid was declined"
        choice = DecoderChoice(REFERENCE, why, [{"label": REFERENCE, "runtime": ref.runtime}], declined,
                               time.perf_counter() - t0)
        _log(choice)
        return runner, choice
    ranked = sorted([*targets, *slower, ref], key=lambda t: t.score) if cfg.decoder == "auto" and not weightless \
        else [*targets, ref]
    rows = [_row(t) for t in ranked]
    if ranked[0].is_reference:
        choice = DecoderChoice(REFERENCE, why.format(_beat(ranked[0], ranked)), rows, declined,
                               time.perf_counter() - t0)
        _log(choice)
        return runner, choice
    # The block tables' page size: the winner's (a per-sequence winner has none: the engine's own).
    block = cfg.page_size if first.keeps_kv else first.compiled.block_size  # type: ignore[union-attr]
    for t in ranked:  # a bid of block_size=None takes the winner's layout (failover keeps the block tables)
        if t.any_block and t is not first and not t.keeps_kv:
            t.block = block
            if t.compiled is not None:
                t.compiled.block_size = block
    chain = [t for t in ranked if t.is_reference or t.keeps_kv
             or (t.compiled.block_size if t.compiled is not None else t.block) == block]
    chain = chain[: chain.index(next(t for t in chain if t.is_reference)) + 1]
    choice = DecoderChoice(first.label, why.format(_beat(first, ranked)), rows, declined,
                           time.perf_counter() - t0)
    _log(choice)
    if not weightless and not runner.is_weightless:
        # The winner holds the weights in the form it runs: the torch runner's copy goes (when the probe has
        # not let it go already), in place, so every holder of the runner lets go; a failover target compiles
        # from the file, and the torch runner is read from disk again only if a failover must run it (a
        # quantization plan's: the file read and the same plan applied, ``load_reference``), and so does the
        # float checkpoint a plan's target was compiled from.
        _let_go(runner, spec, load_reference)
    return DecoderRunner(runner, chain, host=host, max_seqs=cfg.max_batch_size, reference_loader=load_reference), choice


def _let_go(runner: ModelRunner, spec: DecoderSpec, load: Callable[[], ModelRunner]) -> None:
    """The torch runner's weights go before a would-be winner's first step (where a runtime packs its own
    copy, so both would be held at the peak), once the probe has recorded what the runner computes; read
    from disk again if that target fails its probe after all."""
    if isinstance(spec.weights_fn, SpecWeights):
        spec.weights_fn.from_disk(load)
    runner.drop_weights()
    gc.collect()  # the runner's ops refer to it: a cycle
    hostinfo.return_freed_memory()


def _pending(bid: DecoderBid, dev: Device, host: PluginHost, spec: DecoderSpec) -> Target:
    """A target for ``bid``, compiled when first needed (:meth:`Target.ensure`)."""
    def make() -> Any:
        return host.call(bid.plugin, "dspark_compile_decoder", decoder=spec, device=dev)

    return Target(f"{bid.plugin}@{bid.device_id}", bid.runtime, None, bid.plugin, dev.id,
                  exit_layers=bid.exit_layers, note=bid.note, any_block=bid.block_size is None or bid.kv == "sequence",
                  make=make, kv=bid.kv, block=bid.block_size, precision=bid.precision, weight_bytes=bid.weight_bytes)


def _ready(t: Target, reference: ModelRunner, spec: DecoderSpec, host: PluginHost, declined: list[dict[str, str]],
           load_reference: Callable[[], ModelRunner] | None = None,
           recorded: Callable[[], None] | None = None) -> bool:
    """Compile ``t`` (when it is not) and probe it (when not done in this process); a failure is declined
    and charged to its plugin. ``recorded``: as :func:`_probe`'s."""
    try:
        if t.compiled is None:
            progress.step(f"{spec.name}: compiling {t.label}", target=t.label)
        t.ensure()
    except Exception as exc:
        why = f"{exc}" if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}"
        declined.append({"label": t.label, "reason": why + " (reported to the plugin)"})
        if t.plugin is not None:
            host.charge(t.plugin, "dspark_compile_decoder", why, device=t.device_id)
        return False
    if t.admitted:
        return True
    progress.step(f"{spec.name}: checking {t.label}'s outputs", target=t.label)
    t.admitted = _admit(t, reference, spec, host, declined, load_reference, recorded)
    if not t.admitted:
        t.release()
    return t.admitted


def _row(t: Target) -> dict[str, Any]:
    """A ranked target as the choice reports it (``busy``: other processes' share of the cores while it was
    timed, where known)."""
    return {"label": t.label, "runtime": t.runtime, "score": round(t.score, 3), "step_ms": t.step_ms,
            **({"busy": t.busy} if t.busy is not None else {}), **({"note": t.note} if t.note else {})}


def _beat(first: Target, ranked: list[Target]) -> str:
    if not first.step_ms:
        return "then " + ", ".join(t.label for t in ranked if t is not first)
    others = [f"{t.label} x{t.score / first.score:.2f}" for t in ranked if t is not first and t.step_ms]
    return "beat " + ", ".join(others) if others else "alone"


def _key(t: Target, spec: DecoderSpec, shape_names: list[str], host: PluginHost) -> dict[str, Any]:
    """A target's timings are kept per model, runtime, threads and shapes, per version of the plugin
    that compiled it (and of dspark, whose decoder definition it runs): a new release is timed again; and
    per host CPU (model, usable cores, ISA): a cache directory carried to another machine is not trusted."""
    rec = host.records.get(t.plugin or "")
    return {"fingerprint": spec.fingerprint, "target": t.label, "runtime": t.runtime,
            "threads": torch.get_num_threads(),
            "shapes": shape_names, "context": CONTEXT, "plugin_version": rec.version if rec is not None else "",
            "dspark": stored.dspark_version(), "host": hostinfo.fingerprint()}


def _time(targets: list[Target], ref: Target, runner: ModelRunner, reference: ModelRunner, spec: DecoderSpec,
          cfg: EngineConfig, host: PluginHost, declined: list[dict[str, str]],
          prepare_reference: Callable[[ModelRunner], None] | None = None,
          load_reference: Callable[[], ModelRunner] | None = None) -> list[Target]:
    """Fill ``step_ms`` and ``score`` of every target that is admitted, and the reference's; returns those.
    Each target is timed in turn beside the torch runner (scored by its own times relative to the torch
    runner's fastest: timing.scores) and let go before the next is compiled, so only one plugin's copy of
    the weights is held at a time. A warm start reads the timings from the disk cache and compiles nothing.
    A weightless runner (a quantized GGUF file run as stored) has no torch runner to time beside: each
    target is timed alone and scored relative to the fastest. Targets timed at this start whose scores are
    close to the best are timed again in the other order (timing.CLOSE)."""
    weightless = getattr(runner, "is_weightless", False)
    sl = shapes(cfg.max_batch_size, min(128, cfg.max_num_batched_tokens))
    names = [s.name for s in sl]
    out = []
    vocab = runner.cfg.vocab_size
    ctx = min(CONTEXT, runner.cfg.max_position_embeddings - 130)
    max_seqs = max(s.seqs for s in sl)
    ref_bench: Bench | None = None
    refs: list[dict[str, float]] = []  # the torch runner's times, one per target timed beside it

    def time_now(t: Target) -> dict[str, Any] | bool:
        """``t`` timed now: in a process of its own (a weightless runner, where its plugin can run there) or
        here beside the torch runner; False when it failed (declined)."""
        nonlocal ref_bench
        if weightless:
            progress.step(f"{spec.name}: checking and timing {t.label} in a process of its own", target=t.label)
            got = stored.time_isolated(t, spec, cfg, host, declined)
            if got is not None:
                return got
        if not _ready(t, reference, spec, host, declined, load_reference):
            return False
        if ref_bench is None and not weightless:
            if prepare_reference is not None:
                prepare_reference(runner)
            ref_bench = Bench(runner.step, lambda n: runner.make_cache(n, 16), 16, max_seqs=max_seqs,
                              context=ctx, max_rows=130, vocab=vocab)
        dr = DecoderRunner(runner, [t], step_timeout_s=None, max_seqs=max_seqs)
        bs = 16 if t.keeps_kv else t.compiled.block_size  # type: ignore[union-attr]
        bench = Bench(dr.step, lambda n, dr=dr, bs=bs: dr.make_cache(n, bs), bs, max_seqs=max_seqs,
                      context=ctx, max_rows=130, vocab=vocab,
                      greedy=dr.greedy_steps if dr.offers_greedy_steps() else None)
        hook_threads.retire_idle()  # the compile's leftover OpenMP team (a conversion) would slow what is timed
        benches = {t.label: bench} if ref_bench is None else {t.label: bench, REFERENCE: ref_bench}
        progress.step(f"{spec.name}: timing {t.label}", target=t.label)
        with Contention() as busy:
            timed = time_targets(benches, sl)
        del dr, bench
        t.release()  # compiled again if it wins, or if a failover reaches it
        hostinfo.return_freed_memory()
        return {"step_ms": timed[t.label], "reference_ms": timed.get(REFERENCE), "busy": busy.share}

    now: list[float] = []  # the machine's contention at this start: looked at once, when a cached timing was busy

    def stale(cached: dict[str, Any]) -> bool:
        """Cached timings taken on a busy machine, and this start finds it quieter: timed again (timing.retime)."""
        if not was_busy(cached.get("busy")) or not retime_enabled():
            return False
        if not now:
            now.append(contention_now())
        return retime(cached["busy"], now[0])

    fresh: list[Target] = []  # timed at this start, one after the other
    for t in targets:
        cached = disk.load(_NAMESPACE, _key(t, spec, names, host))
        if cached is not None and stale(cached):
            log.info("llm.decoder.retime", target=t.label, busy_then=cached["busy"], busy_now=now[0])
            cached = None
        if cached is None:
            cached = time_now(t)
            if cached is False:
                continue
            disk.store(_NAMESPACE, _key(t, spec, names, host), cached)
            fresh.append(t)
            if was_busy(cached.get("busy")):
                log.warning("llm.decoder.timed_busy", target=t.label, busy=cached["busy"],
                            note="other processes held this share of the cores while it was timed; "
                                 "a start on a quieter machine times it again")
        t.step_ms = dict(cached["step_ms"])
        t.busy = cached.get("busy")
        if cached["reference_ms"] is not None:
            refs.append(dict(cached["reference_ms"]))
        out.append(t)
    ref.score = 1.0
    by_target, ref_ms = scores({t.label: t.step_ms for t in out}, refs, sl, cfg.speculative.active)
    near = set(close_calls(by_target))
    close = [t for t in reversed(fresh) if t.label in near]
    if len(close) > 1:  # timed one after the other, and close: again in the other order (timing.CLOSE)
        for t in close:
            again = time_now(t)
            if not isinstance(again, dict):  # failed this time: declined and charged
                out.remove(t)
            else:
                t.step_ms = averaged(t.step_ms, again["step_ms"])
                if again["reference_ms"] is not None:
                    refs.append(dict(again["reference_ms"]))
                shares = [b for b in (t.busy, again.get("busy")) if b is not None]
                t.busy = max(shares) if shares else None  # the mean carries the busier timing's share
                disk.store(_NAMESPACE, _key(t, spec, names, host), {**again, "step_ms": t.step_ms, "busy": t.busy})
        by_target, ref_ms = scores({t.label: t.step_ms for t in out}, refs, sl, cfg.speculative.active)
    for t in out:
        t.score = by_target[t.label]
    if ref_ms is not None:
        ref.step_ms = ref_ms
    return out


def _log(choice: DecoderChoice) -> None:
    log.info("llm.decoder.choice", chosen=choice.chosen, reason=choice.reason,
             ranked=[(r["label"], r.get("score"), r.get("step_ms")) for r in choice.ranked],
             declined=[(d["label"], d["reason"]) for d in choice.declined], seconds=round(choice.seconds, 2))
