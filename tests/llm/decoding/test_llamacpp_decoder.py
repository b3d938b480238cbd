"""The engine on llama.cpp (plugins/dspark-llamacpp): a decoder that keeps its own KV per sequence (API 1.8).

Every engine feature runs on it unchanged and gives the torch runner's greedy tokens in float32 (f32 KV,
flash attention off: logits within float rounding); GGUF files run as stored, with greedy tokens identical
to llama.cpp driven alone; what it cannot run is declined with the reason. Which runtime measures
fastest is left to benchmarks/vs_llamacpp.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from decoder_testutil import MODEL, PROMPTS, LlamacppWrapped, float_engine, greedy, run_prompts

from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.llm.engine import LLMEngine
from dspark.llm.sampling import GuidedSpec, SamplingParams

dspark_llamacpp = pytest.importorskip("dspark_llamacpp", reason="the llamacpp plugin is not installed (scripts/setup.sh)")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup.sh builds it)")
from dspark_llamacpp import runtime as lrt  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
_run, _engine, _greedy = run_prompts, float_engine, greedy


def _tokens(out: dict[str, Any]) -> dict[str, list[int]]:
    return {k: o.token_ids for k, o in out.items()}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The embedded model as GGUF files: F32 written by the plugin, BF16, Q8_0 and Q4_K_M by llama.cpp's quantizer."""
    e = _engine("llamacpp", max_batch_size=4)  # compiling writes the checkpoint's GGUF once (cached)
    assert e.stats().decoder == "llamacpp@cpu", e.decoder_choice
    spec = e.runner.current.compiled  # the compiled decoder holds the model it loaded
    d = tmp_path_factory.mktemp("gguf")
    out = {"f32": d / "stdlib-llama-f32.gguf"}
    out["f32"].write_bytes(Path(spec.model.path).read_bytes())
    for t in ("BF16", "Q8_0", "Q4_K_M"):
        out[t.lower()] = d / f"stdlib-llama-{t.lower()}.gguf"
        lrt.quantize(out["f32"], out[t.lower()], t)
    return out


def test_batching_chunked_prefill_preemption_priorities_match_torch() -> None:
    # 16-token prefill chunks, 5 sequences over 4 batch slots, a KV budget that forces preemption by recompute:
    # llama.cpp is told to drop each preempted sequence and starts it again from position 0.
    kw = dict(max_batch_size=4, max_num_batched_tokens=16, max_total_tokens=96, priority_preemption=True)
    prios = [1, 0, 2, 0, 1]
    ref = _run(_engine("torch", **kw), _greedy(), prios)
    e = _engine("llamacpp", **kw)
    assert e.stats().decoder == "llamacpp@cpu", e.decoder_choice
    got = _run(e, _greedy(), prios)
    assert _tokens(got) == _tokens(ref)
    assert e.stats().num_preemptions > 0
    assert e.runner.failovers == []


@pytest.mark.parametrize(("spec", "seqs"), [({"enabled": True}, 8), ({"enabled": True}, 1),
                                           ({"strategy": "fixed", "drafters": ["ngram"], "num_speculative_tokens": 4}, 8),
                                           ({"strategy": "fixed", "drafters": ["ngram"], "num_speculative_tokens": 4}, 1)],
                         ids=["deepspec", "deepspec-one-at-a-time", "prompt-lookup", "prompt-lookup-one-at-a-time"])
def test_speculative_decoding_on_llamacpp_is_lossless(spec: dict[str, Any], seqs: int) -> None:
    # Verified drafts ask every row's logits; rejected ones are dropped from llama.cpp's cache. One sequence at a
    # time, the startup calibration times no more sequences than llama.cpp was set up to hold (it once timed 4
    # and the engine failed over to another target before its first request).
    ref = _run(_engine("torch"), _greedy(32))
    e = _engine("llamacpp", speculative_decoding=spec, max_batch_size=seqs)
    got = _run(e, _greedy(32))
    assert _tokens(got) == _tokens(ref)
    s = e.stats()
    assert s.decoder == "llamacpp@cpu" and s.spec_drafts > 0
    if "drafters" in spec:  # fixed drafting only: what DeepSpec drafts and accepts follows measured costs
        assert s.spec_accepted_tokens > 0
        assert s.spec_draft_tokens > s.spec_accepted_tokens  # some drafts were rejected and rolled back
    assert s.spec_drafter_failures == 0 and "self-draft" not in s.spec_drafters  # no early exit on llama.cpp
    assert e.runner.failovers == []


def test_logprobs_sampling_penalties_and_structured_output_on_llamacpp() -> None:
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=7, logprobs=2, prompt_logprobs=1),
              SamplingParams(max_tokens=10, temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
              SamplingParams(max_tokens=8, guided=GuidedSpec(kind="regex", value="[a-c]{2,4}")),
              SamplingParams(max_tokens=12, guided=GuidedSpec(kind="json_object"), temperature=0),
              SamplingParams(max_tokens=6, guided=GuidedSpec(kind="choice", value=json.dumps(["yes", "no"])))]
    ref = _run(_engine("torch"), params)
    got = _run(_engine("llamacpp"), params)
    assert _tokens(got) == _tokens(ref)
    a = np.array([lp.logprob for lp in got["0"].logprobs])
    b = np.array([lp.logprob for lp in ref["0"].logprobs])
    assert np.abs(a - b).max() < 1e-3
    assert len(got["0"].prompt_logprobs) == len(ref["0"].prompt_logprobs)
    assert got["4"].text in ("yes", "no")


class _Faulty(LlamacppWrapped):
    """llama.cpp's decoder, failing at its ``fail_at``-th step (a runtime that dies while serving)."""

    RUNTIME = "faulty llama.cpp"

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.steps = fail_at, 0

    def _step(self, inner: Any, kv: Any, batch: Any) -> Any:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("llama.cpp aborted")
        return inner.step(kv, batch)


def test_a_failing_llamacpp_decoder_moves_to_torch_and_loses_no_request() -> None:
    ref = _run(_engine("torch", max_batch_size=8), _greedy(20))
    host = PluginHost(PluginSettings(blocked={"npu", "cuda", "llamacpp"}))
    faulty = _Faulty(fail_at=20)  # the probe scenario takes 15 steps: this is mid-serving
    host.register(faulty, "faulty")
    host.load()
    e = LLMEngine.from_model(MODEL, dtype="float32", decoder="faulty", max_batch_size=8, plugin_host=host)
    assert e.stats().decoder == "faulty@cpu", e.decoder_choice
    got = _run(e, _greedy(20))
    assert _tokens(got) == _tokens(ref)
    s = e.stats()
    assert s.decoder == "torch" and s.decoder_failovers == 1
    assert not getattr(e.runner.reference, "is_weightless", False)  # reloaded from disk for the failover
    fault = host.last_fault("faulty")
    assert fault is not None and fault.hook == "decoder.step" and "llama.cpp aborted" in fault.reason


def _llamacpp_alone(path: Path, prompt: list[int], n: int, kv_dtype: str = "float32") -> list[int]:
    """Greedy tokens from llama.cpp driven directly (one sequence, K and V in ``kv_dtype``, flash attention
    where the plugin runs it), no engine."""
    ctx = lrt.Context(lrt.Model(path), n_ctx=256, n_seq_max=1, n_batch=64, threads=2, kv_dtype=kv_dtype,
                      flash_attn=dspark_llamacpp.flash_attn(kv_dtype))
    toks = list(prompt)
    logits = ctx.decode(np.zeros(len(toks), np.int64), np.asarray(toks), np.arange(len(toks)),
                        np.eye(1, len(toks), len(toks) - 1, dtype=np.int8)[0])
    out = []
    for _ in range(n):
        t = int(logits[-1].argmax())
        out.append(t)
        logits = ctx.decode(np.zeros(1, np.int64), np.asarray([t]), np.asarray([len(toks)]), np.ones(1, np.int8))
        toks.append(t)
    return out


@pytest.mark.parametrize(("kind", "dtype"), [("f32", "auto"), ("bf16", "auto"), ("q8_0", "auto"),
                                             ("q4_k_m", "auto"), ("q4_k_m", "bfloat16")])
def test_gguf_files_run_as_stored_with_llamacpp_alones_greedy_tokens(ggufs: dict[str, Path], kind: str,
                                                                     dtype: str) -> None:
    # A BF16 file computes in bfloat16 on llama.cpp whatever dtype the engine holds it in: its bid says so and
    # the probe allows bfloat16's rounding (an exact float32 tolerance declined it). A bfloat16 engine's K and V
    # are float16, float32's float32: llama.cpp alone holds them in the same type.
    path = ggufs[kind]
    e = LLMEngine.from_model(path, dtype=dtype, decoder="llamacpp", max_batch_size=4)
    kv_dtype = e.runner.current.compiled.kv_dtype
    half = dtype == "bfloat16" or kind == "bf16"  # this file's "auto"
    assert str(e.runner.dtype) == ("torch.bfloat16" if half else "torch.float32")
    assert kv_dtype == ("float16" if half else "float32")
    c = e.decoder_choice
    assert c is not None and c.chosen == "llamacpp@cpu" and not c.declined, c
    note = next(r.get("note", "") for r in c.ranked if r["label"] == "llamacpp@cpu")
    stored = {"f32": "F32", "bf16": "BF16", "q8_0": "Q8_0", "q4_k_m": "Q8_0"}[kind]  # Q4_K_M: 384-wide rows
    assert note.startswith("GGUF as stored:") and stored in note, note
    prompts = [e.encode(p) for p in PROMPTS[:3]]
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while e.has_unfinished():
        got.update({o.request_id: o.token_ids for o in e.step() if o.finished})
    for i, p in enumerate(prompts):
        assert got[str(i)] == _llamacpp_alone(path, p, 24, kv_dtype), f"prompt {i}"


def test_a_quantized_gguf_holds_its_weights_once_on_llamacpp(ggufs: dict[str, Path]) -> None:
    # The engine starts the file without the torch runner's dequantized copy: llama.cpp holds the weights
    # as stored; the torch runner is only the fallback, loaded from the file if it must run.
    e = LLMEngine.from_model(ggufs["q4_k_m"], decoder="llamacpp", max_batch_size=4)
    assert e.stats().decoder == "llamacpp@cpu", e.decoder_choice
    assert e.runner.reference.is_weightless and e.runner.reference.layers == []
    assert e.decoder_choice is not None and "as stored" in e.decoder_choice.reason
    assert e.load_seconds > 0


def test_a_failing_decoder_on_a_stored_gguf_loads_the_torch_runner_and_loses_no_request(
        ggufs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from dspark.llm.gguf import reference

    made: list[tuple[Any, ...]] = []
    real = reference.reference_runner
    monkeypatch.setattr(reference, "reference_runner", lambda *a, **k: made.append(a) or real(*a, **k))
    host = PluginHost(PluginSettings(blocked={"npu", "cuda", "llamacpp"}))
    faulty = _Faulty(fail_at=20)  # registered here only: its probe runs in this process (the reference loaded for it)
    host.register(faulty, "faulty")
    host.load()
    e = LLMEngine.from_model(ggufs["q8_0"], decoder="faulty", max_batch_size=8, plugin_host=host)
    assert e.stats().decoder == "faulty@cpu", e.decoder_choice
    # Probed here against the file dequantized within its budget (as a probe's process does), then let go.
    assert [a[0] for a in made] == [str(ggufs["q8_0"])]
    assert e.runner.reference.is_weightless
    params = _greedy(20)
    got = _run(e, params)
    assert sorted(got) == [str(i) for i in range(len(PROMPTS))]
    assert all(len(o.token_ids) == 20 and o.finish_reason == "length" for o in got.values())
    s = e.stats()
    assert s.decoder == "torch" and s.decoder_failovers == 1
    assert not getattr(e.runner.reference, "is_weightless", False) and e.runner.reference.layers  # loaded now


def test_quantized_gguf_is_offered_only_to_decoders_that_run_it_as_stored(
        ggufs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # llama.cpp and OpenVINO (the file's blocks as compressed weights, API 1.14) both run it as stored: each is
    # probed and timed in a process of its own (no torch runner to time beside, and this process never holds
    # one decoder's weights while it times another), and only the faster is compiled here; ONNX Runtime's
    # decoder declines it. A cache of its own: nothing timed before.
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    host = PluginHost(PluginSettings(blocked={"cuda"})).load()
    compiled: list[str] = []
    call = host.call

    def counted(name: str, hook: str, **kwargs: Any) -> Any:
        if hook == "dspark_compile_decoder":
            compiled.append(name)
        return call(name, hook, **kwargs)

    host.call = counted  # type: ignore[method-assign]
    e = LLMEngine.from_model(ggufs["q8_0"], decoder="auto", max_batch_size=4, plugin_host=host)
    c = e.decoder_choice
    assert c is not None and compiled == [c.chosen.split("@")[0]], (compiled, c)
    assert c is not None
    npu = [d for d in c.declined if d["label"] == "npu@cpu"]
    assert npu and "gguf_stored" in npu[0]["reason"] and "linear.blocks" in npu[0]["reason"], c.declined
    timed = {r["label"]: r for r in c.ranked if r.get("step_ms")}
    assert set(timed) == {"llamacpp@cpu", "cpu@cpu"}, c.ranked
    assert c.chosen == min(timed, key=lambda k: timed[k]["score"]) and "measured fastest" in c.reason, c
    assert e.runner.reference.is_weightless  # neither needed the torch copy


def test_what_llamacpp_cannot_run_is_declined_with_the_reason(checkpoint: Any) -> None:
    # Qwen2's q/k/v biases are not written as a llama GGUF here: declined, and the engine runs the torch runner.
    e = LLMEngine.from_model(checkpoint("qwen2"), dtype="float32", decoder="llamacpp")
    c = e.decoder_choice
    assert c is not None and c.chosen == "torch"
    assert any(d["label"] == "llamacpp@cpu" and "qwen2" in d["reason"] for d in c.declined), c.declined


def test_a_checkpoint_on_llamacpp_keeps_no_torch_copy_of_its_weights() -> None:
    # llama.cpp reads its own GGUF of the checkpoint: the torch runner's copy is dropped.
    e = _engine("llamacpp", max_batch_size=4)
    assert e.stats().decoder == "llamacpp@cpu", e.decoder_choice
    assert e.runner.reference.is_weightless and e.runner.reference_loader is not None


def test_a_tiny_llama_checkpoint_is_written_as_gguf_and_matches_torch(checkpoint: Any) -> None:
    path = checkpoint("llama")
    prompts = [[5, 9, 13, 2, 7] * 3, [11, 3, 8]]
    outs = []
    for dec in ("torch", "llamacpp"):
        e = LLMEngine.from_model(path, dtype="float32", decoder=dec, max_batch_size=4)
        for i, p in enumerate(prompts):
            e.add_request(str(i), p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        out: dict[str, list[int]] = {}
        while e.has_unfinished():
            out.update({o.request_id: o.token_ids for o in e.step() if o.finished})
        outs.append(out)
        assert e.stats().decoder == ("torch" if dec == "torch" else "llamacpp@cpu"), e.decoder_choice
    assert outs[0] == outs[1]


def test_devices_decoders_lists_llamacpp(ggufs: dict[str, Path]) -> None:
    proc = subprocess.run([sys.executable, "-m", "dspark.cli", "devices", "--decoders", str(ggufs["q4_k_m"]),
                           "--json"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    text = json.dumps(data)
    assert "llamacpp" in text and "GGUF as stored" in text, text[:2000]


def test_a_stored_files_probe_keeps_verdicts_and_tries_failures_again(
        ggufs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe's process answers; a compile that failed there (a transient state: memory, a plugin mid-upgrade)
    # is tried again at the next start, while the probe step's own verdict is kept.
    from dspark.llm.decoding import stored
    from dspark.llm.decoding.runner import Target
    from dspark.llm.decoding.spec import make_spec
    from dspark.llm.gguf import load_runner

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    answers = [{"bad": "bid, then did not compile in the probe's process"}, {"bad": None, "verdict": True}]
    asked: list[dict[str, Any]] = []

    def child(req: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
        asked.append(req)
        return answers[len(asked) - 1]

    monkeypatch.setattr(stored, "child", child)
    runner, _ = load_runner(ggufs["q8_0"], weightless_if_quantized=True)
    spec = make_spec(runner, ggufs["q8_0"], extra_features=frozenset({"gguf_stored"}))
    t = Target("llamacpp@cpu", "llama.cpp", None, "llamacpp", "cpu")
    assert stored.probe_isolated(t, spec, None) == answers[0]["bad"]
    assert stored.probe_isolated(t, spec, None) is None  # asked again
    assert stored.probe_isolated(t, spec, None) is None and len(asked) == 2  # kept


def test_a_stored_files_reference_is_recorded_once_and_each_decoder_probed_and_timed_in_one_process(
        ggufs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe's reference (the file dequantized) is recorded by the first probe's process and replayed by
    # every later one, whatever its decoder's block size; a decoder not yet probed is probed and timed by one.
    # The reference keeps none of its dequantized matrices (an edge box's budget): both decoders still pass.
    from dspark.llm.config import EngineConfig
    from dspark.llm.decoding import stored
    from dspark.llm.decoding.runner import Target
    from dspark.llm.decoding.spec import make_spec
    from dspark.llm.gguf import load_runner

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DSPARK_REFERENCE_BYTES", "0")
    asked: list[dict[str, Any]] = []
    real = stored.child
    monkeypatch.setattr(stored, "child", lambda req, env: asked.append(req) or real(req, env))
    runner, _ = load_runner(ggufs["q8_0"], weightless_if_quantized=True)
    spec = make_spec(runner, ggufs["q8_0"], extra_features=frozenset({"gguf_stored"}))
    assert stored.load_transcript(spec) is None
    llama = Target("llamacpp@cpu", "llama.cpp", None, "llamacpp", "cpu")
    assert stored.probe_isolated(llama, spec, None) is None
    again = stored.load_transcript(spec)
    assert again is not None and again.block_size == 16 and len(again.events) > 5
    blob = next((tmp_path / stored.TRANSCRIPT_NAMESPACE).glob("*.bin"))
    recorded_at = blob.stat().st_mtime_ns
    host, declined = PluginHost().load(), []
    ov = Target("cpu@cpu", "OpenVINO", None, "cpu", "cpu")
    timed = stored.time_isolated(ov, spec, EngineConfig(max_batch_size=1), host, declined)
    assert declined == [] and isinstance(timed, dict) and timed["step_ms"]["decode_b1"] > 0, (timed, declined)
    assert [r.get("probe") for r in asked] == [True, True] and "time" in asked[1]  # one process: probed, timed
    assert blob.stat().st_mtime_ns == recorded_at  # replayed, not recorded again
    assert stored.time_isolated(ov, spec, EngineConfig(max_batch_size=1), host, declined)
    assert asked[2].get("probe") is False  # its verdict is kept: timed only


@pytest.mark.parametrize("second_pass", ["turns it round", "far apart"])
def test_targets_timed_one_after_the_other_and_close_are_timed_again_in_the_other_order(
        ggufs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second_pass: str) -> None:
    # Each decoder is really probed and timed in a process of its own; what each timing reports is set here (a
    # machine's phases are not this test's to win): llama.cpp first measures within timing.CLOSE of OpenVINO,
    # then llama.cpp's second, other-order timing is faster and each takes the mean of its times per shape.
    # Far apart, nobody is timed twice.
    from dspark.llm.decoding import choose, stored
    from dspark.llm.decoding.timing import CLOSE

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    ov = {"decode_b1": 1.0, "run_b1": 0.9, "prefill_128": 8.0, "verify_k8": 2.0}
    gap = 1.0 if second_pass == "turns it round" else 3 * CLOSE
    first = {**ov, "decode_b1": 1.05 * gap, "run_b1": 0.95 * gap, "prefill_128": 12.0}
    answers = {"cpu@cpu": [ov, {**ov, "decode_b1": 1.2}], "llamacpp@cpu": [first, {**first, "run_b1": 0.5}]}
    asked: list[str] = []
    real = stored.time_isolated

    def recorded(t: Any, *a: Any) -> Any:
        out = real(t, *a)  # really probed and timed
        assert isinstance(out, dict), out
        asked.append(t.label)
        return {**out, "step_ms": answers[t.label][asked.count(t.label) - 1]}

    monkeypatch.setattr(stored, "time_isolated", recorded)
    host = PluginHost(PluginSettings(blocked={"cuda", "npu"})).load()
    e = LLMEngine.from_model(ggufs["q8_0"], decoder="auto", max_batch_size=1, plugin_host=host)
    c = e.decoder_choice
    assert c is not None
    timed = {r["label"]: r["step_ms"] for r in c.ranked if r.get("step_ms")}
    if second_pass == "far apart":
        assert sorted(asked) == ["cpu@cpu", "llamacpp@cpu"] and c.chosen == "cpu@cpu", (asked, c)
        return
    assert asked[:2] in (["cpu@cpu", "llamacpp@cpu"], ["llamacpp@cpu", "cpu@cpu"])
    assert asked[2:] == asked[1::-1]  # again, in the other order
    assert timed["cpu@cpu"] == {**ov, "decode_b1": 1.1}  # the mean per shape
    assert timed["llamacpp@cpu"] == {**first, "run_b1": 0.725}
    assert c.chosen == "llamacpp@cpu", c
    kept = [json.loads(f.read_text())["value"]["step_ms"] for f in (tmp_path / choose._NAMESPACE).glob("*.json")]
    assert {**first, "run_b1": 0.725} in kept and {**ov, "decode_b1": 1.1} in kept, kept  # kept for the next start
