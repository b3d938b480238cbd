"""The engine's runner when a plugin's compiled decoder runs the model: the torch runner's interface
over a ranked list of targets, with failover.

The engine keeps calling ``runner.step(cache, chunks)`` as it does on the torch
runner; this runner turns the chunks into a :class:`~dspark.sdk.decoder.StepBatch`
over the engine's block tables and runs the current target. A target whose step
raises or hangs is reported and charged to its plugin; the runner moves to the
next target (the torch runner is always last), rebuilds every live sequence's
KV there by recomputing it from the tokens it has recorded, and runs the step
again, so no request fails. The block size is the first target's; every later
target takes it (the torch runner and the plugins that bid ``block_size=None``
run any).

A target that keeps its KV per sequence (API 1.8, ``SequenceDecoder``) gets no
block tables: the engine's cache still counts each sequence's tokens and pages
(the scheduler admits and preempts on them), and each step this runner tells the
target what changed since its last step: the positions the engine dropped
(rejected drafts, preemption, finished requests) and the new rows.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dspark.host import hook_threads
from dspark.host.log import get_logger
from dspark.llm.decoding.batch import SeqKV, build_batch, build_seq_batch, split_logits
from dspark.llm.decoding.watchdog import watchdog
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.runner.model import ModelRunner
from dspark.llm.runner.rope import longrope_splits, longrope_switch, rope_positions, run_split
from dspark.llm.runner.types import ModelConfig, SeqChunk, StepObservers
from dspark.sdk.decoder import is_sequence

if TYPE_CHECKING:
    from dspark.host.plugin_manager import PluginHost
    from dspark.sdk.decoder import CompiledDecoder

log = get_logger("dspark.llm.decoder")

REFERENCE = "torch"
_RECOMPUTE_CHUNK = 256  # tokens per recompute step when a sequence's KV is rebuilt on another target


@dataclass
class Target:
    """One way to run the whole model: a plugin's compiled decoder on a device, or the torch runner."""

    label: str  # "cpu@cpu" (plugin@device), or "torch"
    runtime: str
    compiled: CompiledDecoder | None = None  # None: the torch runner
    plugin: str | None = None
    device_id: str | None = None
    step_ms: dict[str, float] = field(default_factory=dict)  # measured per step shape
    busy: float | None = None  # other processes' share of the cores while step_ms was measured (None: unknown)
    exit_layers: bool = True
    note: str = ""
    score: float = 1.0  # a nominal request's time relative to the torch runner's (timing.score)
    any_block: bool = False  # its bid took any KV block size: the engine may set compiled.block_size
    # A target compiled only when it must run (a failover target, one timed and released): compiles it.
    make: Callable[[], Any] | None = field(default=None, repr=False)
    kv: str = "paged"  # its bid's KV mode ("sequence": API 1.8), known before it is compiled
    block: int | None = None  # the KV block size it runs with: its bid's, or the one the engine gave it
    admitted: bool = False  # it passed the probe scenario in this process
    precision: str | None = None  # what its bid said it computes in
    device_map: Any = None  # layer ranges on several devices (a DeviceMap); None: the whole model on device_id
    weight_bytes: int = 0  # what its bid said its weights take (DecoderBid.weight_bytes; a chain: its pieces')

    @property
    def is_reference(self) -> bool:
        return self.compiled is None and self.make is None

    @property
    def keeps_kv(self) -> bool:
        """The target keeps the KV per sequence itself (API 1.8): no block layout to agree on."""
        if self.compiled is None:
            return self.make is not None and self.kv == "sequence"
        return is_sequence(self.compiled)

    def ensure(self) -> None:
        """Compile a target held uncompiled, checking what its bid promised; raises when it cannot."""
        if self.compiled is not None or self.make is None:
            return
        compiled = self.make()
        if compiled is None:
            raise RuntimeError("bid on the decoder, then did not compile")
        if (self.kv == "sequence") != is_sequence(compiled):
            raise RuntimeError(f"bid kv={self.kv!r}, then compiled a decoder of the other mode")
        if self.any_block and self.block is not None and not is_sequence(compiled):
            compiled.block_size = self.block
        self.compiled = compiled

    def release(self) -> None:
        """Let go of the compiled decoder (and the weights it holds); :meth:`ensure` compiles it again."""
        if self.make is not None:
            self.compiled = None


class DecoderRunner:
    """What the engine steps when compiled decoders run the model: the torch runner's executor surface
    (``cfg``, ``dtype``, ``make_cache``, ``step``, ``head``, ``padded_rows``, ``block_size``,
    ``weight_bytes``) over ``targets`` (best first), with failover."""

    def __init__(self, reference: ModelRunner, targets: list[Target], *, host: PluginHost | None = None,
                 step_timeout_s: float | None = 60.0,
                 on_failover: Callable[[Target, Target, str], None] | None = None,
                 max_seqs: int = 256, failover: bool = True,
                 reference_loader: Callable[[], ModelRunner] | None = None) -> None:
        """``max_seqs``: the most sequences a cache holds at once (what a per-sequence target is asked to
        hold); ``failover=False``: a target's fault is raised, not worked around (conformance checks);
        ``reference_loader``: loads the torch runner's weights when ``reference`` is weightless (a quantized
        GGUF file run as stored) and a failover reaches it."""
        if not targets or not targets[-1].is_reference:
            targets = [*[t for t in targets if not t.is_reference], Target(REFERENCE, "torch")]
        self.reference = reference
        self.targets = targets
        self.current = targets[0]
        self.host = host
        self.step_timeout_s = step_timeout_s
        self.on_failover = on_failover
        self.max_seqs = max_seqs
        self.failover_enabled = failover
        self.reference_loader = reference_loader
        self.failovers: list[dict[str, Any]] = []
        self.observers = StepObservers()  # told each step's time (the reference's own steps included), when any listen
        self._caches: weakref.WeakSet[PagedKVCache] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._no_end_run: set[str] = set()  # targets whose end_run raised (not asked again)

    # -- what the engine reads off a runner (the model executor's surface) -------------------
    # Named one by one: the model's config, dtype and weights are the torch runner's; anything else of
    # the torch runner is ``self.reference``'s, asked for by that name.
    @property
    def cfg(self) -> ModelConfig:
        return self.reference.cfg

    @property
    def dtype(self) -> torch.dtype:
        return self.reference.dtype

    @property
    def is_weightless(self) -> bool:
        """The torch runner holds no weights (a quantized GGUF file run as stored by the target)."""
        return bool(getattr(self.reference, "is_weightless", False))

    def weight_bytes(self) -> int:
        """The torch runner's weights while it holds them; once a compiled decoder holds the model (the torch
        runner let go of its copy, or never loaded one), what the running target's bid said its weights take."""
        if not self.is_weightless:
            return int(self.reference.weight_bytes())
        return int(self.current.weight_bytes)

    @property
    def block_size(self) -> int | None:
        t = self.targets[0]
        return None if t.compiled is None or t.keeps_kv else t.compiled.block_size

    def padded_rows(self, n: int) -> int:
        return n if self.current.compiled is not None else self.reference.padded_rows(n)

    def head(self, hn: torch.Tensor) -> torch.Tensor:
        # A compiled target returns logits for hidden_only chunks too (it has no separate head call).
        return hn if self.current.compiled is not None else self.reference.head(hn)

    def make_cache(self, num_pages: int, page_size: int = 16) -> PagedKVCache:
        """Block tables on the host; K/V memory on the current target (torch tensors only for torch)."""
        if self.current.compiled is None:
            cache = self.reference.make_cache(num_pages, page_size)
        else:
            c = self.reference.cfg
            cache = PagedKVCache(num_layers=c.num_hidden_layers, num_pages=num_pages, page_size=page_size,
                                 kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=self.reference.dtype,
                                 device="meta")
            cache.device_kv = (self.current.label, self._allocate(self.current, num_pages, page_size))
        self._caches.add(cache)
        return cache

    def _allocate(self, target: Target, num_pages: int, page_size: int) -> Any:
        assert target.compiled is not None
        if target.keeps_kv:
            return SeqKV(target.compiled.allocate(num_pages * page_size, self.max_seqs))
        return target.compiled.allocate(num_pages)

    # -- stepping -------------------------------------------------------------------------------
    def step(self, cache: PagedKVCache, chunks: list[SeqChunk], exit_layer: int | None = None) -> list[torch.Tensor]:
        if not self.observers:
            return self._step_chunks(cache, chunks, exit_layer)
        with self.observers.timed("draft" if exit_layer is not None else "forward"):
            return self._step_chunks(cache, chunks, exit_layer)

    def _step_chunks(self, cache: PagedKVCache, chunks: list[SeqChunk], exit_layer: int | None) -> list[torch.Tensor]:
        with self._lock:
            while True:
                target = self.current
                if target.compiled is None:
                    out = self.reference.step(cache, chunks, exit_layer)
                    self._record(cache, chunks, advanced=True)
                    return out
                if exit_layer is not None and not target.exit_layers:
                    raise NotImplementedError(f"{target.label} runs no early exit")
                try:
                    return self._compiled_step(target, cache, chunks, exit_layer)
                except NotImplementedError:  # a step shape the target does not offer (an early exit): not a fault
                    raise
                except Exception as exc:  # a plugin's fault: report, move on, recompute, run the step again
                    if not self.failover_enabled:
                        raise
                    self._failover(target, f"{type(exc).__name__}: {exc}")

    def _compiled_step(self, target: Target, cache: PagedKVCache, chunks: list[SeqChunk],
                       exit_layer: int | None) -> list[torch.Tensor]:
        """One step on ``target``; for LongRoPE (a paged target), split at the switch and recomputed across
        it as the torch runner does (runner/rope.py), a long-mode row reading RoPE row ``position +
        max_position_embeddings`` (``StepBatch.rope_positions``)."""
        orig = getattr(self.reference, "longrope_orig", None)
        if orig is None or target.keeps_kv:  # a runtime keeping its own KV runs its own RoPE
            return self._compiled_once(target, cache, chunks, exit_layer)
        splits = longrope_splits(chunks, cache.seq_lens, orig)
        if splits:  # the rows before the switch first, in short mode
            return run_split(chunks, splits, lambda part: self._compiled_step(target, cache, part, exit_layer))
        modes = longrope_switch(cache, chunks, orig,
                                lambda prefix, long: self._compiled_once(target, cache, [prefix], None, [long]))
        return self._compiled_once(target, cache, chunks, exit_layer, modes)

    def _compiled_once(self, target: Target, cache: PagedKVCache, chunks: list[SeqChunk], exit_layer: int | None,
                       long_modes: list[bool] | None = None) -> list[torch.Tensor]:
        assert target.compiled is not None
        if cache.device_kv is None:
            raise RuntimeError(f"cache holds its K/V in torch tensors, not on {target.label}")
        label, kv = cache.device_kv
        if label != target.label:
            raise RuntimeError(f"cache belongs to {label}, not {target.label}")
        batch: Any = build_seq_batch(cache, kv, chunks, exit_layer) if target.keeps_kv else build_batch(
            cache, chunks, exit_layer)
        if long_modes is not None:
            batch.rope_positions = rope_positions(batch.positions, chunks, long_modes,
                                                  self.reference.cfg.max_position_embeddings)
        kv_of_seqs = kv
        if target.keeps_kv:
            kv = kv.store
        raw = self._call_step(target, kv, batch)
        logits = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.asarray(raw))
        if logits.dtype != torch.float32:
            logits = logits.float()
        want = len(batch.logit_rows)
        if logits.dim() != 2 or logits.shape[0] != want or logits.shape[1] != self.reference.cfg.vocab_size:
            raise ValueError(f"step returned logits of shape {tuple(logits.shape)}, expected "
                             f"({want}, {self.reference.cfg.vocab_size})")
        self._record(cache, chunks)
        for ch in chunks:
            cache.set_len(ch.seq_id, cache.seq_lens.get(ch.seq_id, 0) + len(ch.token_ids))
        if target.keeps_kv:
            kv_of_seqs.advanced(chunks, cache)
        return split_logits(chunks, logits)  # type: ignore[return-value]

    def _call_step(self, target: Target, kv: Any, batch: Any, *extra: Any, method: str = "step") -> Any:
        """The compiled step (or ``method``) under the step's deadline: a decoder that can cancel a step (API
        1.11) runs on this thread with the watchdog armed; any other runs on a watchdog thread, abandoned if it
        does not return in time."""
        compiled: Any = target.compiled
        fn = getattr(compiled, method)
        timeout = self.step_timeout_s
        if timeout is None:
            return fn(kv, batch, *extra)
        cancel = getattr(compiled, "cancel", None)
        if cancel is not None:
            token = watchdog.arm(timeout, cancel, target.label)
            try:
                raw = fn(kv, batch, *extra)
            except Exception:
                if watchdog.disarm(token):
                    raise TimeoutError(f"step did not return within {timeout:g} s (cancelled)") from None
                raise
            if watchdog.disarm(token):  # it returned, but only after its deadline
                raise TimeoutError(f"step did not return within {timeout:g} s")
            return raw
        try:
            return hook_threads.call_with_timeout(fn, [kv, batch, *extra], timeout, f"{target.label}.{method}")
        except hook_threads.CallTimeout:
            raise TimeoutError(f"step did not return within {timeout:g} s") from None

    # -- several greedy steps in one call (API 1.13) ----------------------------------------------
    def end_run(self) -> None:
        """End the greedy run in progress after its step in flight (API 1.15), from any thread; nothing when
        none runs or the current target cannot end one early. A target whose ``end_run`` raises is charged
        and not asked again: its runs then end at their budget, as a decoder's without it."""
        target = self.current
        end = getattr(target.compiled, "end_run", None)
        if end is None or target.label in self._no_end_run:
            return
        try:
            end()
        except Exception as exc:  # the caller is a request's arrival: it must not fail for the plugin's fault
            self._no_end_run.add(target.label)
            reason = f"end_run: {type(exc).__name__}: {exc}"
            log.error("llm.decoder.end_run_failed", target=target.label, reason=reason)
            self._charge(target.plugin, "decoder.end_run", reason, target.device_id)

    def offers_greedy_steps(self) -> bool:
        """The current target runs greedy runs (API 1.13); a paged one not while LongRoPE may switch modes
        mid-run (its long rows are the engine's to lay out)."""
        t = self.current
        if t.compiled is None or not hasattr(t.compiled, "greedy_steps"):
            return False
        return t.keeps_kv or getattr(self.reference, "longrope_orig", None) is None

    def greedy_steps(self, cache: PagedKVCache, chunks: list[SeqChunk], limits: list[int],
                     stop_ids: frozenset[int]) -> list[list[int]] | None:
        """Greedy decoding of up to ``limits[i]`` tokens for decode chunk ``i`` (one token each) in one call to
        the current target (its ``greedy_steps``), the cache moved as that many steps move it. Returns each
        chunk's tokens; None when the target offers no such call, or failed (it is then failed over): the
        caller runs a plain step. A run the pages cannot hold is shortened to what they hold (a decoder that
        cannot run more steps now returns one)."""
        if not self.observers:
            return self._greedy_steps(cache, chunks, limits, stop_ids)
        t0 = time.perf_counter()
        toks: list[list[int]] | None = None
        try:
            toks = self._greedy_steps(cache, chunks, limits, stop_ids)
            return toks
        finally:  # each step of the run its share: the observers see forward steps, as without runs
            self.observers.report("forward", time.perf_counter() - t0, max(map(len, toks)) if toks else 1)

    def _greedy_steps(self, cache: PagedKVCache, chunks: list[SeqChunk], limits: list[int],
                      stop_ids: frozenset[int]) -> list[list[int]] | None:
        with self._lock:
            target = self.current
            if not self.offers_greedy_steps() or cache.device_kv is None or cache.device_kv[0] != target.label:
                return None
            kv = cache.device_kv[1]
            lims = []
            for ch, lim in zip(chunks, limits):
                s = cache.seq_lens.get(ch.seq_id, 0)
                while lim > 1 and not cache.can_grow(ch.seq_id, s + lim):
                    lim -= 1
                cache.reserve(ch.seq_id, s + lim)
                lims.append(lim)
            keeps = target.keeps_kv
            batch = build_seq_batch(cache, kv, chunks) if keeps else build_batch(cache, chunks)
            try:
                raw = self._call_step(target, kv.store if keeps else kv, batch, np.asarray(lims, np.int64), stop_ids,
                                      method="greedy_steps")
                toks = _greedy_tokens(raw, lims, self.reference.cfg.vocab_size)
            except Exception as exc:
                for ch in chunks:  # the pages reserved past each sequence's length go back
                    cache.truncate(ch.seq_id, 0)
                if not self.failover_enabled:
                    raise
                self._failover(target, f"greedy_steps: {type(exc).__name__}: {exc}")
                return None
            fed = [SeqChunk(ch.seq_id, [*ch.token_ids, *t[:-1]]) for ch, t in zip(chunks, toks)]
            self._record(cache, fed)
            for ch in fed:
                cache.set_len(ch.seq_id, cache.seq_lens.get(ch.seq_id, 0) + len(ch.token_ids))
                cache.truncate(ch.seq_id, 0)
            if keeps:
                kv.advanced(fed, cache)
            return toks

    @staticmethod
    def _record(cache: PagedKVCache, chunks: list[SeqChunk], *, advanced: bool = False) -> None:
        """Keep each sequence's cached tokens, what a failover recomputes (set_len and truncate trim
        them). ``advanced``: the lengths already include the chunks (the torch runner moved them)."""
        for ch in chunks:
            n = len(ch.token_ids)
            start = cache.seq_lens.get(ch.seq_id, 0) - (n if advanced else 0)
            have = cache.tokens.setdefault(ch.seq_id, [])
            del have[start:]
            have.extend(ch.token_ids)

    # -- failover -------------------------------------------------------------------------------
    def _charge(self, plugin: str | None, hook: str, reason: str, device: str | None) -> None:
        """A plugin's fault, charged to it on the engine's plugin host (none: a runner built without one)."""
        if self.host is not None and plugin is not None:
            self.host.charge(plugin, hook, reason, device=device)

    def _failover(self, failed: Target, reason: str) -> None:
        i = self.targets.index(failed)
        part = getattr(failed.compiled, "failed_part", None)  # a chain of ranges: the range that failed
        plugin, device = (part.plugin, part.device.id) if part is not None else (failed.plugin, failed.device_id)
        self._charge(plugin, "decoder.step", reason, device)
        t0 = time.perf_counter()
        nxt = self.targets[i + 1]
        while not nxt.is_reference:  # a target held uncompiled is compiled now; one that cannot is passed over
            try:
                nxt.ensure()
                break
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                log.error("llm.decoder.failover_compile", target=nxt.label, reason=why)
                self._charge(nxt.plugin, "dspark_compile_decoder", why, nxt.device_id)
                i += 1
                nxt = self.targets[i + 1]
        log.error("llm.decoder.failover", failed=failed.label, reason=reason, next=nxt.label)
        self.failovers.append({"from": failed.label, "to": nxt.label, "reason": reason, "time": time.time()})
        failed.release()
        if nxt.is_reference and getattr(self.reference, "is_weightless", False):
            if self.reference_loader is None:
                raise RuntimeError(f"{failed.label} failed ({reason}) and the torch runner has no weights to run")
            self.reference = self.reference_loader()  # held once more only now that it must run
            log.info("llm.decoder.reference_loaded", ms=round((time.perf_counter() - t0) * 1e3, 1))
        self.current = nxt
        seqs = sum(self._rebuild(c, nxt) for c in list(self._caches))
        log.info("llm.decoder.recomputed", target=nxt.label, sequences=seqs,
                 ms=round((time.perf_counter() - t0) * 1e3, 1))
        if self.on_failover is not None:
            self.on_failover(failed, nxt, reason)

    def _rebuild(self, cache: PagedKVCache, target: Target) -> int:
        """Give ``cache`` K/V memory on ``target`` and recompute every sequence's cached tokens into it."""
        if target.compiled is None:
            c = self.reference.cfg
            shape = (cache.allocator.num_pages, cache.page_size, c.num_key_value_heads, c.head_dim)
            cache.k = [torch.zeros(shape, dtype=self.reference.dtype) for _ in range(c.num_hidden_layers)]
            cache.v = [torch.zeros(shape, dtype=self.reference.dtype) for _ in range(c.num_hidden_layers)]
            cache.device_kv = None
        else:
            cache.device_kv = (target.label, self._allocate(target, cache.allocator.num_pages, cache.page_size))
        lens = dict(cache.seq_lens)
        rebuilt = 0
        for seq_id, n in lens.items():
            toks = cache.tokens.get(seq_id, [])[:n]
            if n == 0:
                continue
            if len(toks) != n:
                raise RuntimeError(f"sequence {seq_id}: {len(toks)} recorded tokens for {n} cached")
            cache.set_len(seq_id, 0)
            cache.tokens[seq_id] = []
            for a in range(0, n, _RECOMPUTE_CHUNK):
                part = SeqChunk(seq_id, toks[a : a + _RECOMPUTE_CHUNK])
                if target.compiled is None:
                    self.reference.step(cache, [part])
                    self._record(cache, [part], advanced=True)
                else:
                    self._compiled_step(target, cache, [part], None)
            rebuilt += 1
        return rebuilt


def _greedy_tokens(raw: Any, limits: list[int], vocab: int) -> list[list[int]]:
    """Each row's tokens of a ``greedy_steps`` result, checked against what was asked: a row of at least one
    and at most its limit, token ids in the vocabulary, -1 only after the last."""
    a = np.asarray(raw)
    if a.ndim != 2 or a.shape[0] != len(limits) or a.shape[1] < max(limits):
        raise ValueError(f"greedy_steps returned shape {a.shape}, expected ({len(limits)}, {max(limits)})")
    out = []
    for i, lim in enumerate(limits):
        row = a[i, :lim].tolist()
        n = row.index(-1) if -1 in row else lim
        toks = row[:n]
        if not toks or any(not 0 <= t < vocab for t in toks) or any(t != -1 for t in row[n:]):
            raise ValueError(f"greedy_steps row {i}: {row} is not 1 to {lim} token ids followed by -1")
        out.append(toks)
    return out
