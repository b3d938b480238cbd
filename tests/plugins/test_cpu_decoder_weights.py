"""The `cpu` plugin's decoder holds a model's weights once: in their precision (no float32 copy of a
half-precision model, which OpenVINO folds an unmarked widening into), and mapped from the disk cache,
whose pages leave memory once OpenVINO has packed them."""

from __future__ import annotations

import dataclasses
import resource
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import dspark_plugins_cpu as plugin
from dspark.llm.decoding.runner import DecoderRunner, Target
from dspark.llm.decoding.spec import make_spec
from dspark.llm.runner.model import ModelRunner
from dspark.llm.runner.types import SeqChunk
from dspark.sdk import mapped
from dspark.types import Device
from dspark_plugins_cpu.decoder import OpenVINODecoder

MODEL = Path(__file__).resolve().parents[2] / "core" / "dspark" / "assets" / "models" / "stdlib-llama"
PROMPT = [5, 77, 310, 1024, 9, 4000, 12, 6, 501, 33, 2048, 7]


def _device() -> Device:
    cpu = [d for d in plugin.dspark_probe_devices(refresh=False) if isinstance(d, Device) and d.id == "cpu"]
    assert len(cpu) == 1, cpu
    return cpu[0]


def _constants(dec: OpenVINODecoder) -> list[tuple[str, int]]:
    """(element type, elements) of each constant of the compiled model: the weights as the runtime holds them."""
    out = []
    for op in dec.compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        if "layerType" in rt and rt["layerType"].astype(str) == "Const":
            n = int(np.prod([d.get_length() for d in op.get_output_partial_shape(0)]))
            out.append((op.get_output_element_type(0).get_type_name(), n))
    return out


def _greedy_logits(dec: OpenVINODecoder, runner: ModelRunner, steps: int = 4) -> list[torch.Tensor]:
    dr = DecoderRunner(ModelRunner.weightless(runner.cfg, runner.dtype), [Target("cpu@cpu", "openvino", dec, "cpu",
                                                                              "cpu")], step_timeout_s=None, max_seqs=1)
    cache = dr.make_cache(8, dec.block_size)
    out, logits = dr.step(cache, [SeqChunk("s", PROMPT)]), []
    for _ in range(steps):
        logits.append(out[0].reshape(-1).float())
        out = dr.step(cache, [SeqChunk("s", [int(logits[-1].argmax())])])
    return logits


def test_a_bfloat16_model_is_held_as_bfloat16_and_runs_as_from_float32_weights() -> None:
    device = _device()
    if "bfloat16" not in device.dtypes:
        pytest.skip(f"OpenVINO has no bfloat16 kernels on this CPU ({device.name}): the engine holds float32")
    runner = ModelRunner.from_pretrained(str(MODEL), torch.bfloat16)
    spec = make_spec(runner, MODEL, max_num_tokens=64, max_num_seqs=1)
    stored = OpenVINODecoder(spec, device)
    widened = OpenVINODecoder(dataclasses.replace(spec, stored_weights_fn=None), device)  # float32 weights in
    smallest = min(t.numel() for L in runner.layers for t in (L.w_qkv_t, L.w_o, L.w_gate_up_t, L.w_down))
    params = sum(t.numel() for t in (runner.embed, *[t for L in runner.layers for t in (L.w_qkv_t, L.w_o,
                                                                                        L.w_gate_up_t, L.w_down)]))
    held, wide = _constants(stored), _constants(widened)
    # No float32 constant the size of a projection (RoPE's tables are float32 and smaller); every weight bf16.
    assert max(n for t, n in held if t == "f32") < smallest, held
    assert sum(n for t, n in held if t == "bf16") >= params, held
    assert sum(n for t, n in wide if t == "f32") >= params, wide  # what the marked widening avoids
    got, want = _greedy_logits(stored, runner), _greedy_logits(widened, runner)
    for g, w in zip(got, want, strict=True):  # the same bfloat16 values, so the same logits up to summation order
        assert int(g.argmax()) == int(w.argmax())
        assert float((g - w).abs().max()) <= 0.05 * float(w.abs().max()), (g - w).abs().max()


def test_the_weights_are_mapped_from_the_cache_and_leave_memory_once_packed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    if not mapped.usable():
        pytest.skip(f"mapped weights save nothing here (not Linux, or {tmp_path} is in memory)")
    device = _device()
    dtype = torch.bfloat16 if "bfloat16" in device.dtypes else torch.float32
    runner = ModelRunner.from_pretrained(str(MODEL), dtype)
    spec = make_spec(runner, MODEL, max_num_tokens=64, max_num_seqs=1)
    dec = OpenVINODecoder(spec, device)
    wf = dec.weights_file
    assert wf is not None and wf.written == wf.nbytes > 0 and wf.path.is_relative_to(tmp_path)
    got = _greedy_logits(dec, runner, steps=8)  # a prefill, then decode steps: every weight packed
    # What stays of the file in memory is what OpenVINO reads per step, the embedding rows of the tokens (the
    # kernel maps 64 KiB around each), not the projections it packed from (the rest of the file).
    table = runner.embed.numel() * runner.embed.element_size()
    assert wf.nbytes > 3 * table and wf.resident() <= table, (wf.resident(), table, wf.nbytes)
    with monkeypatch.context() as m:
        m.setattr(mapped, "usable", lambda: False)  # as on a machine whose cache is in memory: OpenVINO's copies
        owned = OpenVINODecoder(spec, device)
    assert owned.weights_file is None
    want = _greedy_logits(owned, runner, steps=8)
    assert all(np.array_equal(g.numpy(), w.numpy()) for g, w in zip(got, want, strict=True))
    again = OpenVINODecoder(spec, device)  # a later start maps the cached file, writing nothing
    assert again.weights_file is not None and again.weights_file.written == 0
    assert all(np.array_equal(g.numpy(), w.numpy()) for g, w in zip(_greedy_logits(again, runner, steps=8), want,
                                                                     strict=True))


def test_pages_are_released_beside_a_step_until_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While OpenVINO packs (its first steps) the mapped file's pages go as it proceeds: the load peaks at the
    packed copy and a little, not at the packed copy and the whole file."""
    from dspark_plugins_cpu.decoder import _Releasing

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    if not mapped.usable():
        pytest.skip(f"mapped weights save nothing here (not Linux, or {tmp_path} is in memory)")
    big = np.random.default_rng(3).standard_normal((2048, 1024), dtype=np.float32)  # 8 MiB
    store = mapped.MappedWeights({"model": "releasing"})
    view = store.add(big)
    store.close()
    assert float(np.asarray(view).sum()) == pytest.approx(float(big.sum()), rel=1e-4)  # as packing reads them
    assert store.resident() >= big.nbytes
    releasing = _Releasing(store, period_s=0.001)
    try:
        deadline = time.monotonic() + 30.0
        while store.resident() >= big.nbytes // 8 and time.monotonic() < deadline:
            releasing._done.wait(0.01)
        assert store.resident() < big.nbytes // 8
    finally:
        releasing.stop()
    assert not releasing._thread.is_alive()
    assert np.array_equal(view, big)


def test_pages_are_released_beside_the_packing_steps_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A releasing thread runs beside the first step of several rows and the first of one row (OpenVINO packs
    then), not beside the steps after them: a server that never steps one row (every batch of two or more
    requests) would otherwise start and join a thread every step."""
    import dspark_plugins_cpu.decoder as decoder

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    if not mapped.usable():
        pytest.skip(f"mapped weights save nothing here (not Linux, or {tmp_path} is in memory)")
    started: list[int] = []
    real = decoder._Releasing

    class Counted(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a: object, **k: object) -> None:
            started.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(decoder, "_Releasing", Counted)
    device = _device()
    runner = ModelRunner.from_pretrained(str(MODEL), torch.float32)
    dec = OpenVINODecoder(make_spec(runner, MODEL, max_num_tokens=64, max_num_seqs=2), device)
    assert dec.weights_file is not None
    dr = DecoderRunner(ModelRunner.weightless(runner.cfg, runner.dtype), [Target("cpu@cpu", "openvino", dec, "cpu",
                                                                              "cpu")], step_timeout_s=None, max_seqs=2)
    cache = dr.make_cache(8, dec.block_size)
    out = dr.step(cache, [SeqChunk("a", PROMPT), SeqChunk("b", PROMPT[:5])])  # several rows: packs
    for _ in range(6):  # steps of two rows: packed already
        out = dr.step(cache, [SeqChunk("a", [int(out[0].argmax())]), SeqChunk("b", [int(out[1].argmax())])])
    assert len(started) == 1
    dr.step(cache, [SeqChunk("a", [int(out[0].argmax())])])  # the first step of one row: packs
    dr.step(cache, [SeqChunk("a", [7])])
    assert len(started) == 2


def test_a_cache_that_cannot_be_written_leaves_openvino_its_own_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = _device()
    runner = ModelRunner.from_pretrained(str(MODEL), torch.float32)
    spec = make_spec(runner, MODEL, max_num_tokens=64, max_num_seqs=1)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(blocker / "cache"))  # no directory can be made under a file
    unwritable = OpenVINODecoder(spec, device)
    assert unwritable.weights_file is None
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing us
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # a disk that fills after 1 MiB
        full = OpenVINODecoder(spec, device)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert full.weights_file is None and not list((tmp_path / "cache" / mapped.NAMESPACE).glob("*"))
    want = _greedy_logits(unwritable, runner, steps=3)
    assert all(np.array_equal(g.numpy(), w.numpy()) for g, w in zip(_greedy_logits(full, runner, steps=3), want,
                                                                     strict=True))
