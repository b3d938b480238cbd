"""The synchronous engine: requests in, one scheduler step at a time, outputs out."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dspark.host.log import get_logger
from dspark.llm.assembly import EngineParts, build_parts
from dspark.llm.config import EngineConfig
from dspark.llm.decoding.runs import CLOSED_RUN_MS, MAX_RUN, RunLength, is_decode, run_limits, stop_ids
from dspark.llm.detokenize import Detokenizer
from dspark.llm.logits import (
    LogprobsPrefix,
    argmax_rows,
    as_batch,
    TokenLogprobs,
    batch_logprobs,
    process,
    process_batch,
    token_logprobs,
)
from dspark.llm.runner.types import SeqChunk, Work
from dspark.llm.outputs import EngineLayout, EngineStats, RequestOutput, Usage
from dspark.llm.sampling import SamplingParams, sample, sample_rows
from dspark.llm.scheduler import ScheduledChunk, Scheduler, Sequence, Status

log = get_logger("dspark.llm.engine")

if TYPE_CHECKING:
    from dspark.host.inventory import Inventory
    from dspark.host.plugin_manager import PluginHost


class LLMEngine:
    """The engine core: requests in, one scheduler step at a time, outputs out. ``LLMEngine(parts)`` assembles
    what :func:`~dspark.llm.assembly.build_parts` built; :meth:`from_model` does both."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.model_path, self.config = parts.model_path, parts.config
        self.max_model_len = parts.config.max_model_len or 0
        self.runner, self.cache, self.spec = parts.runner, parts.cache, parts.spec
        self.device_map, self.dense_offload = parts.device_map, parts.dense_offload
        self.dense_offload_decision, self.decoder_choice = parts.dense_offload_decision, parts.decoder_choice
        self.quant_kernels = parts.quant_kernels
        self.packed_linear = parts.packed_linear
        self.tokenizer, self.inputs = parts.tokenizer, parts.inputs
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_ids = set(parts.inputs.eos_ids)
        self.scheduler = Scheduler(self.config, self.cache)
        self._seqs: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self._default_gen = parts.default_gen
        self._steps, self._step_ms, self._forward_ms = 0, 0.0, 0.0  # where step time goes (stats())
        self._forward_steps = 0  # the decoder's forward passes: a greedy run of n steps counts n
        self._run = RunLength(self.config.decode_run_ms)  # greedy steps per decoder call (decoding/runs.py)
        self.load_seconds = parts.load_seconds
        ref = getattr(self.runner, "reference", self.runner)
        log.info("llm.engine.loaded", model=str(self.model_path), seconds=round(self.load_seconds, 2),
                 decoder=getattr(getattr(self.runner, "current", None), "label", "torch"),
                 torch_weights="not loaded (the decoder holds the file's own)" if getattr(ref, "is_weightless", False)
                 else "loaded")

    @classmethod
    def from_model(cls, model: str | Path, *, dtype: str | torch.dtype = "auto", config: EngineConfig | None = None,
                   plugin_host: PluginHost | None = None, **config_kw: Any) -> LLMEngine:
        """Build and assemble an engine for ``model``: ``config`` or the engine keyword arguments
        (:class:`~dspark.llm.config.EngineConfig`); ``plugin_host``: the plugins this engine uses for
        placement, quantization, dense offload, decoders and drafters, by default every installed plugin,
        loaded on first need."""
        return cls(build_parts(model, dtype=dtype, config=config, plugin_host=plugin_host, **config_kw))

    @property
    def gguf(self) -> Any:
        """The GGUF file's model (``dspark.llm.gguf``), None for other formats."""
        return self.parts.gguf

    @property
    def quant_plan(self) -> Any:
        """The quantization plan the model runs (``dspark.llm.quantization.QuantPlan``), None when float."""
        return self.parts.quant_plan

    @property
    def plugin_host(self) -> PluginHost:
        """The engine's one plugin host: the caller's, or every installed plugin, loaded on first need."""
        return self.parts.devices.host

    @property
    def inventory(self) -> Inventory:
        """The devices the engine's plugin host reports, probed once, on first need."""
        return self.parts.devices.inventory

    # -- requests -------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt``, checked (:meth:`InputProcessor.encode`)."""
        return self.inputs.encode(prompt)

    def make_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                      priority: int = 0) -> Sequence:
        """Validate and tokenize (:meth:`InputProcessor.make_sequence`); pure, so callers on other threads
        may use it."""
        return self.inputs.make_sequence(request_id, prompt, params, priority)

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self._seqs:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        seq.arrival = next(self._arrival)
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        self.add_sequence(self.make_sequence(request_id, prompt, params, priority))

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        if self.spec is not None:
            self.spec.release(request_id, seq.all_ids)
        return self._output(seq)

    def end_run(self) -> None:
        """End the greedy run in progress, if any, after its step in flight (API 1.15): a request arrived. The
        one engine method another thread may call while this one steps (AsyncLLMEngine does)."""
        end = getattr(self.runner, "end_run", None)  # the torch runner runs no greedy runs
        if end is not None:
            end()

    def abort_all(self) -> None:
        for rid in list(self._seqs):
            self.abort(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping -------------------------------------------------------------
    def step(self, finished_only: bool = False, closed: bool = False) -> list[RequestOutput]:
        """Run one scheduler iteration; returns an output for every request that got a new token, or with
        ``finished_only`` for those that finished (a caller that only wants final results, as
        ``LLM.generate``, skips building the others: a tenth of a millisecond a step at 32 requests; a
        request's first output then carries all its text in ``delta``). ``closed``: the caller adds no
        request until the ones it holds have finished (``LLM.generate``), so no arrival waits on a greedy
        run and a run takes what fits in :data:`~dspark.llm.decoding.runs.CLOSED_RUN_MS`, not ``decode_run_ms``.

        The one step loop, with or without speculation: the speculative decoder (when on) proposes
        drafts for the scheduled sequences and verifies them in the same target forward; only here
        are tokens appended, stops checked and outputs emitted."""
        planned = self.scheduler.schedule()
        if not planned:
            return []
        t0 = time.perf_counter()
        spec = self.spec
        # A lone greedy request under DeepSpec: (lookup, k, steps), a copy run of k drafted tokens a step, or
        # with k 0 a greedy run.
        stretch_ms = 0.0 if spec is None else min(self._run.budget_ms, self.config.speculative.stretch_ms)
        run_ms = max(CLOSED_RUN_MS, self._run.budget_ms) if closed else self._run.budget_ms
        lone = spec.lone_plan(planned, stretch_ms, run_ms) if spec is not None and not self.scheduler.waiting \
            else None
        if lone is not None:
            src, k, n = lone[0], lone[1], min(lone[2], MAX_RUN)
            ran = self._step_copy(planned[0], src, k, n, t0, finished_only) if k \
                else self._greedy_run(planned, n, t0, finished_only)
            if ran is not None:
                return ran
        cap = None if spec is None else spec.run_steps(len(planned))  # with speculation: runs in stretches it leaves
        if spec is None or cap:
            n = self._run.steps(max(CLOSED_RUN_MS, self._run.budget_ms) if closed
                                else None if spec is None or spec.owes_plain(len(planned)) else stretch_ms)
            ran = self._greedy_run(planned, n if cap is None else min(cap, n), t0, finished_only)
            if ran is not None:
                return ran
        # Plain steps DeepSpec asked for (nothing to draft, proposals that yield less than plain decoding here,
        # speculative/runs/pays.py) go one at a time where no run can go.
        plain_only = spec is not None and bool(cap)
        prop = spec.propose(planned) if spec is not None and not plain_only else None
        chunks = [self._chunk(p) for p in planned]
        if spec is not None and prop is not None:
            chunks = [spec.chunk(prop, p, ch) for p, ch in zip(planned, chunks)]
        t_fwd = time.perf_counter()
        logits = self.runner.step(self.cache, chunks)
        fwd_ms = (time.perf_counter() - t_fwd) * 1e3
        self._forward_ms += fwd_ms
        if all(is_decode(p) for p in planned) and all(len(ch.token_ids) == 1 for ch in chunks):
            self._run.observe(fwd_ms)  # a plain decode step's time, speculative or not: a run's length
        if spec is not None and prop is not None:
            spec.verify(prop, chunks, logits, t_fwd)  # first: it times the forward
        drafted = [bool(prop is not None and prop.draft(p.seq)) for p in planned]
        for i in [i for i, ch in enumerate(chunks) if ch.all_logits and not drafted[i]]:
            logits[i] = self._prompt_logprobs(planned[i].seq, logits[i])
        picks: dict[int, int] = {}
        if prop is None:
            # Greedy rows take one batched argmax (the same pick as sample() makes row by row; numpy's, a
            # fifth of torch's dispatch for one row). With speculation every row samples in turn, keeping
            # the order the shared generator is drawn in.
            plain = [i for i, p in enumerate(planned) if p.completes and p.seq.plain]
            greedy = [i for i in plain if planned[i].seq.params.greedy]
            if greedy:
                picks = dict(zip(greedy, argmax_rows([logits[i] for i in greedy])))
            drawn = [i for i in plain if not planned[i].seq.params.greedy]
            if drawn:  # sampled rows as one batch (sample_rows), each from its own generator
                seqs = [planned[i].seq for i in drawn]
                picks.update(zip(drawn, sample_rows(as_batch([logits[i] for i in drawn]), [s.params for s in seqs],
                                                    [s.generator or self._default_gen for s in seqs])))
            picks.update(self._sample_processed(planned, logits))
        outputs = []
        for i, (p, lg) in enumerate(zip(planned, logits)):
            seq = p.seq
            if drafted[i]:
                assert spec is not None and prop is not None
                v = spec.accept(prop, i, seq, lg)
                spec.note_rows(seq.request_id, lg[: v.accepted + 1])  # the rows of the tokens appended
                seq.num_computed += 1 + v.accepted
                self._append(seq, v.tokens, v.logprobs)
                finished = seq.status is Status.FINISHED
                if not finished:
                    self.cache.truncate(seq.request_id, v.rejected)  # the rejected draft's KV rows
                spec.settle(prop, seq, v, finished)
            else:
                completes = p.completes  # before num_computed moves
                seq.num_computed += p.num_tokens
                if not completes:
                    continue  # mid-prompt chunk: nothing to sample yet
                if spec is not None:
                    spec.note_rows(seq.request_id, lg[None])
                tok = picks[i] if i in picks else self._sample(seq, lg)
                self._append(seq, [tok])
                if prop is not None and prop.reserved(seq) and seq.status is not Status.FINISHED:
                    self.cache.truncate(seq.request_id, 0)  # pages taken for a draft that did not come
            if not finished_only or seq.status is Status.FINISHED:
                outputs.append(self._output(seq))
            if seq.status is Status.FINISHED:
                del self._seqs[seq.request_id]
                if spec is not None:
                    spec.release(seq.request_id, seq.all_ids)
        step_ms = (time.perf_counter() - t0) * 1e3
        self._steps, self._step_ms = self._steps + 1, self._step_ms + step_ms
        self._forward_steps += 1
        if spec is not None and prop is not None:
            spec.end_step(prop, step_ms)
        elif spec is not None and plain_only:
            decode_only = all(is_decode(p) for p in planned)
            spec.stepped_plain(len(planned), len(planned) if decode_only else 0, step_ms)
        self.scheduler.record_step(step_ms)
        return outputs

    def _greedy_run(self, planned: list[ScheduledChunk], steps: int, t0: float,
                    finished_only: bool) -> list[RequestOutput] | None:
        """A run of up to ``steps`` greedy decode steps in one decoder call (decoding/runs.py), where the decoder
        offers it and nothing waits: each planned decode gets up to its limit of tokens, appended through the
        stop checks as a step's are (tokens past a stop are dropped with the request). None when it was not
        run (the caller steps once instead)."""
        offers = getattr(self.runner, "offers_greedy_steps", None)  # the torch runner runs no greedy runs
        if offers is None or self.scheduler.waiting or not offers():
            return None
        limits = run_limits(planned, steps, self.max_model_len)
        if limits is None:
            return None
        chunks = [self._chunk(p) for p in planned]
        t_fwd = time.perf_counter()
        toks = self.runner.greedy_steps(self.cache, chunks, limits, stop_ids(planned, self.eos_ids))
        if toks is None:
            return None
        fwd_ms = (time.perf_counter() - t_fwd) * 1e3
        steps = max(map(len, toks))
        self._run.observe(fwd_ms, steps)
        outputs = self._emit_run(planned, toks, t0, fwd_ms, steps, finished_only)
        if self.spec is not None:  # what the run yielded, its whole engine step, against proposals (runs.pays)
            self.spec.ran(len(planned), fwd_ms, steps, sum(map(len, toks)), (time.perf_counter() - t0) * 1e3)
        return outputs

    def _step_copy(self, p: ScheduledChunk, src: int, k: int, steps: int, t0: float,
                   finished_only: bool) -> list[RequestOutput] | None:
        """A copy run (``SpecDecoder.copy_run``): up to ``steps`` verification steps of one greedy request, each
        of ``k`` tokens drafted by lookup ``src`` of its replay, in one engine step; the tokens appended through
        the stop checks as a step's are. None when it ran no step (the caller proposes instead)."""
        assert self.spec is not None
        limits = run_limits([p], 1 << 30, self.max_model_len)  # the tokens it may still take
        if limits is None:
            return None
        t_fwd = time.perf_counter()
        toks, steps = self.spec.copy_run(p.seq, src, k, steps, limits[0], stop_ids([p], self.eos_ids))
        if not steps:
            return None
        return self._emit_run([p], [toks], t0, (time.perf_counter() - t_fwd) * 1e3, steps, finished_only)

    def _emit_run(self, planned: list[ScheduledChunk], toks: list[list[int]], t0: float, fwd_ms: float,
                  steps: int, finished_only: bool) -> list[RequestOutput]:
        """A run's tokens (``toks[i]`` for ``planned[i]``, every one fed to the decoder but the last) appended
        through the stop checks, finished requests released, the outputs, and the run counted as one engine
        step of ``steps`` decoder steps."""
        self._forward_ms += fwd_ms
        outputs = []
        for p, got in zip(planned, toks):
            seq = p.seq
            seq.num_computed += len(got)  # the chunk's token and every token fed after it
            self._append(seq, got)
            if not finished_only or seq.status is Status.FINISHED:
                outputs.append(self._output(seq))
            if seq.status is Status.FINISHED:
                del self._seqs[seq.request_id]
                if self.spec is not None:
                    self.spec.release(seq.request_id, seq.all_ids)
        step_ms = (time.perf_counter() - t0) * 1e3
        self._steps, self._step_ms = self._steps + 1, self._step_ms + step_ms
        self._forward_steps += steps
        self.scheduler.record_step(step_ms / steps)  # the batch limit adapts to a step's time, not a run's
        return outputs

    def _append(self, seq: Sequence, toks: list[int], logprobs: list[TokenLogprobs] | None = None) -> None:
        """Append ``toks`` (with their logprobs, when given) to ``seq`` through the stop checks, up to
        the first that finishes it. The text is decoded once at the end unless stop strings need it
        after every token."""
        per_token = bool(seq.params.stop)
        for i, t in enumerate(toks):
            seq.output_ids.append(t)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            self._check_stop(seq, t, decode=per_token, last=i == len(toks) - 1)
            if seq.status is Status.FINISHED:
                break
        if not per_token:
            self._set_text(seq, seq.finish_reason == "stop")

    def _chunk(self, p: ScheduledChunk) -> SeqChunk:
        """A planned prefill or decode chunk; with every row's logits while prompt logprobs are wanted."""
        s, a = p.seq, p.seq.num_computed
        return SeqChunk(s.request_id, s.all_ids[a : a + p.num_tokens], all_logits=self._wants_prompt_lp(s),
                        prompt_len=len(s.prompt_ids))

    @staticmethod
    def _wants_prompt_lp(s: Sequence) -> bool:
        # Until every prompt entry is in: a recompute after preemption only fills in what is missing.
        return s.params.prompt_logprobs is not None and s.num_computed <= len(s.prompt_logprobs) < len(s.prompt_ids) - 1

    def _prompt_logprobs(self, s: Sequence, rows: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs a prefill chunk's ``rows`` [n, vocab] give that are not in yet
        (called before ``num_computed`` advances); returns the last row, the one sampled from."""
        a, m = s.num_computed, len(s.prompt_logprobs)  # row r predicts prompt token a + r + 1
        targets = s.prompt_ids[m + 1 : min(a + rows.shape[0], len(s.prompt_ids) - 1) + 1]
        if targets:
            s.prompt_logprobs += batch_logprobs(rows[m - a : m - a + len(targets)], targets,
                                                s.params.prompt_logprobs or 0)
        return rows[-1]

    def _sample_processed(self, planned: list[ScheduledChunk], logits: list[torch.Tensor]) -> dict[int, int]:
        """Tokens of the step's rows that need processing or logprobs, done together: the processing
        (``process_batch``), the picks (``sample_rows``) and raw logprobs as batched tensor work, then per row
        the recorded logprobs and the grammar's advance, as ``_sample`` does them."""
        rows = [i for i, p in enumerate(planned) if p.completes and not p.seq.plain]
        if not rows:
            return {}
        seqs = [planned[i].seq for i in rows]
        raw = torch.stack([logits[i] for i in rows])
        work = [j for j, s in enumerate(seqs) if s.params.needs_processing or s.constraint is not None]
        proc = raw
        if work:
            proc = raw.clone()
            proc[work] = process_batch(raw[work], [seqs[j] for j in work], self.eos_ids)
        toks = sample_rows(proc, [s.params for s in seqs], [s.generator or self._default_gen for s in seqs])
        want = [j for j, s in enumerate(seqs) if s.params.logprobs is not None]
        if want:
            n = max(seqs[j].params.logprobs or 0 for j in want)
            got = batch_logprobs(raw[want], [toks[j] for j in want], n)
            for j, lp in zip(want, got):
                k = seqs[j].params.logprobs or 0
                seqs[j].logprobs.append(lp if k == n else TokenLogprobs(lp.token_id, lp.logprob, lp.top[:k]))
        for s, t in zip(seqs, toks):
            if s.constraint is not None:
                s.constraint.accept(t)
        return dict(zip(rows, toks))

    def _sample(self, seq: Sequence, row: torch.Tensor) -> int:
        """The next token of ``seq`` from its fp32 logits ``row``, which is then emitted: its raw logprob
        is recorded and the grammar advanced. Plain sequences go straight to ``sample``."""
        p = seq.params
        gen = seq.generator or self._default_gen
        if seq.plain:
            return sample(row, p, gen)
        proc = process(row, seq.prompt_ids, seq.output_ids, p, seq.constraint, self.eos_ids) \
            if p.needs_processing or seq.constraint is not None else row
        tok = sample(proc, p, gen)
        if p.logprobs is not None:
            seq.logprobs.append(token_logprobs(row, tok, p.logprobs))
        if seq.constraint is not None:
            seq.constraint.accept(tok)
        return tok

    def _check_stop(self, seq: Sequence, tok: int, decode: bool = True, last: bool = True) -> None:
        """Finish ``seq`` if ``tok`` (just appended) ends it. ``decode=False`` skips decoding the text,
        for a caller appending several tokens at once that decodes once afterwards (``_set_text``);
        only allowed without stop strings, which need the text after every token."""
        p = seq.params
        early = len(seq.output_ids) < p.min_tokens  # as vLLM: no stop checks before min_tokens
        stop_tok = not early and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids))
        if last and seq.constraint is not None and seq.constraint.is_terminated():
            stop_tok = True  # the grammar ended (on EOS); it has seen all of a verified run, so only its last token
        if decode or p.stop:
            self._set_text(seq, stop_tok)
        reason = "stop" if stop_tok else None
        if early and p.stop:  # the whole decode's length, trailing U+FFFD included, as the floor always was
            seq.stop_floor = len(self.detokenizer.whole(seq)) if self.tokenizer is not None else len(seq.text)
        elif p.stop and reason is None:
            # The earliest match wins; text before it is the output. A match must end past the text
            # of the first min_tokens - 1 tokens.
            hits = [i for s in p.stop if (i := seq.text.find(s, max(0, seq.stop_floor - len(s) + 1))) >= 0]
            if hits:
                seq.text, reason = seq.text[: min(hits)], "stop"
        if reason is None and (len(seq.output_ids) >= p.max_tokens
                               or len(seq.prompt_ids) + len(seq.output_ids) >= self.max_model_len):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if reason == "length" and (decode or p.stop):
                self._set_text(seq, False)  # finished: the whole decode, not the incremental one

    def _set_text(self, seq: Sequence, drop_last: bool) -> None:
        """``seq.text`` from its output tokens, less the last one when that is a stop token: decoded whole
        once the sequence ends, else incrementally where that gives the same text (dspark.llm.detokenize)."""
        if self.tokenizer is None:
            return
        if drop_last or seq.status is Status.FINISHED:
            seq.text = self.detokenizer.whole(seq, drop_last)
        else:
            seq.text = self.detokenizer.text(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.status is Status.FINISHED
        end = len(seq.text)
        if not finished:
            # Hold back what may still turn into a stop string, and half-decoded UTF-8.
            hold = max((len(s) for s in seq.params.stop), default=1) - 1
            end = max(seq.emitted, len(seq.text.rstrip("\ufffd")) - hold)
        delta, seq.emitted = seq.text[seq.emitted : end], end
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=list(seq.prompt_ids),
            text=seq.text, token_ids=list(seq.output_ids), delta=delta, finished=finished,
            finish_reason=seq.finish_reason, usage=Usage(len(seq.prompt_ids), len(seq.output_ids)),
            num_preemptions=seq.num_preemptions,
            logprobs=None if seq.params.logprobs is None else LogprobsPrefix(seq.logprobs, len(seq.output_ids)),
            first_scheduled=seq.first_scheduled,
            # Complete before the first output, and never changed after: no copy.
            prompt_logprobs=None if seq.params.prompt_logprobs is None else seq.prompt_logprobs,
        )

    def observe(self, fn: Callable[[Work, float], None]) -> None:
        """Tell ``fn(work, seconds)`` how long each forward, early-exit draft step and offloaded MLP call
        takes (:class:`~dspark.llm.runner.types.StepObservers`); the server's metrics use it."""
        self.runner.observers.add(fn)

    def layout(self) -> EngineLayout:
        """What runs the model and where (the decoder running now, its device map, offload, drafters, plugins)."""
        from dspark.llm.assembly.layout import describe

        return describe(self)

    def stats(self) -> EngineStats:
        kv = self.cache.stats()
        return EngineStats(
            kv_used_bytes=kv.used_bytes, kv_total_bytes=kv.total_bytes, kv_used_pages=kv.used_pages,
            kv_free_pages=kv.free_pages, kv_total_pages=kv.total_pages, kv_usage=kv.used_pages / kv.total_pages,
            kv_fragmentation=kv.fragmentation, page_size=kv.page_size, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), num_preemptions=self.scheduler.num_preemptions,
            effective_max_batch=self.scheduler.effective_max_batch, steps=self._steps,
            forward_ms_per_step=self._forward_ms / max(1, self._steps),
            host_ms_per_step=(self._step_ms - self._forward_ms) / max(1, self._steps), forward_steps=self._forward_steps,
            decoder=getattr(getattr(self.runner, "current", None), "label", "torch"),
            decoder_failovers=len(getattr(self.runner, "failovers", ())),
            **(self.spec.stats() if self.spec is not None else {}),
        )
