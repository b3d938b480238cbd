"""The device map through the placer (declared device profiles) and the dense MLP offload."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from llm_testutil import random_prompts

from dspark.llm import SamplingParams
from dspark.llm.runner.loader import ModelConfig
from dspark.llm.device_map.layers import map_layers
from dspark.placement.placer import MEMORY_HEADROOM
from dspark.placement.profile import profile_host

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# A ~1.3B Llama: 24 layers of ~50 MB in fp16 plus ~4 MB of KV each at 4096 tokens.
BIG = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                  num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4, head_dim=64)
KW = dict(max_model_len=2048, max_total_tokens=4096, dtype="float16")


def _profile(tmp_path: Path, gpu_bytes: int | None, name: str = "box") -> Path:
    cpu = {"id": "cpu", "kind": "cpu", "name": "host", "memory_total_bytes": "64 GiB",
           "peak_flops": {"float32": "1 TFLOPS", "bfloat16": "1 TFLOPS"},
           "memory_bandwidth_bytes_per_s": "50 GB/s", "runtimes": [{"plugin": "torch"}]}
    devices: list[dict[str, Any]] = [cpu]
    if gpu_bytes is not None:
        devices.append({"id": "cuda:0", "kind": "cuda", "name": "gpu", "memory_total_bytes": gpu_bytes,
                        "peak_flops": {"float32": "20 TFLOPS", "float16": "80 TFLOPS"},
                        "memory_bandwidth_bytes_per_s": "900 GB/s", "host_link_bandwidth_bytes_per_s": "25 GB/s",
                        "runtimes": [{"plugin": "cuda"}]})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "devices": devices}))
    return path


def _place(path: Path, cfg: ModelConfig = BIG) -> Any:
    host, inv = profile_host(path)
    return map_layers(cfg, host, inv, **KW)  # type: ignore[arg-type]


def test_gpu_big_enough_takes_every_layer(tmp_path: Path) -> None:
    lp = _place(_profile(tmp_path, 16 << 30))
    assert set(lp.layer_devices.values()) == {"cuda:0"}
    assert lp.embed.device_id == lp.head.device_id == "cuda:0"
    assert lp.layers[0].kv_bytes == 2 * 4 * 64 * 2 * 4096  # K and V, fp16, 4096 tokens
    assert "single target cuda@cuda:0" in lp.plan.gate


def test_cpu_only_profile_puts_everything_on_the_cpu(tmp_path: Path) -> None:
    lp = _place(_profile(tmp_path, None))
    assert set(lp.layer_devices.values()) == {"cpu"} and lp.head.device_id == lp.embed.device_id == "cpu"


def test_small_gpu_splits_by_budget_and_more_memory_never_means_fewer_gpu_layers(tmp_path: Path) -> None:
    n = BIG.num_hidden_layers
    counts, costs = [], []
    for gib in (0.25, 0.5, 1.0, 1.5, 2.0, 4.0):
        budget = int(gib * 2**30)
        lp = _place(_profile(tmp_path, budget, f"gpu{gib}"))
        on_gpu = lp.layers_on("cuda:0")
        counts.append(len(on_gpu))
        costs.append(lp.plan.predicted_total_ms)
        used = lp.device_bytes().get("cuda:0", 0)
        assert used <= budget * MEMORY_HEADROOM, (gib, used)
        if 0 < len(on_gpu) < n:  # llama.cpp-style: one contiguous run at either end, the rest on the CPU
            assert on_gpu in (list(range(len(on_gpu))), list(range(n - len(on_gpu), n))), on_gpu
            assert lp.layers_on("cpu") == sorted(set(range(n)) - set(on_gpu))
            # What is left out of the budget really would not fit: one more layer would overflow it.
            assert used + lp.layers[0].memory_bytes > budget * MEMORY_HEADROOM
    assert counts == sorted(counts), counts
    assert costs == sorted(costs, reverse=True), costs
    assert any(0 < c < n for c in counts) and counts[-1] == n, counts


@pytest.fixture(scope="module")
def real_host() -> tuple[Any, Any]:
    from dspark.host.inventory import probe
    from dspark.host.plugin_manager import PluginHost

    host = PluginHost().load()
    return host, probe(host)


def test_auto_on_this_machine_runs_on_the_cpu_with_the_same_tokens(make_llm: Callable[..., Any]) -> None:
    prompts = random_prompts(4, seed=3)
    plain = make_llm()
    placed = make_llm(devices="auto")
    lp = placed.engine.device_map
    assert lp is not None and set(lp.layer_devices.values()) == {"cpu"}
    assert placed.engine.runner.layer_devices is None  # all on the CPU: the unchanged fast path
    assert [o.token_ids for o in placed.generate(prompts, GREEDY)] == \
        [o.token_ids for o in plain.generate(prompts, GREEDY)]


def test_profile_devices_torch_cannot_drive_are_dropped(make_llm: Callable[..., Any], tmp_path: Path) -> None:
    path = _profile(tmp_path, 16 << 30)
    text = path.read_text().replace("cuda:0", "gpu:0").replace("kind: cuda", "kind: gpu")
    path.write_text(text)
    llm = make_llm(devices=str(path))
    assert set(llm.engine.device_map.layer_devices.values()) == {"cpu"}
    with pytest.raises(FileNotFoundError, match="device-profile"):
        make_llm(devices=str(tmp_path / "missing.yaml"))


def test_runner_moves_state_between_layer_devices(checkpoint: Callable[[str], Path]) -> None:
    """The per-device path (weights, KV pages and the hidden state per layer), exercised with
    two spellings of the CPU, which torch treats as distinct devices."""
    from dspark.llm.runner.model import ModelRunner, SeqChunk

    ref = ModelRunner.from_pretrained(str(checkpoint("llama_tied_mha")), "float32")
    moved = ModelRunner.from_pretrained(str(checkpoint("llama_tied_mha")), "float32")
    moved.place(["cpu:0", "cpu"], embed_device="cpu", head_device="cpu:0")
    assert moved.layer_devices is not None
    ref.attention = "torch"  # the per-device path gathers + SDPA; compare it bit for bit with the same
    c1, c2 = ref.make_cache(8, 4), moved.make_cache(8, 4)
    p = random_prompts(2, seed=1, lo=5, hi=9)
    for chunks in ([SeqChunk("a", p[0]), SeqChunk("b", p[1])], [SeqChunk("a", [7]), SeqChunk("b", [9])]):
        for x, y in zip(ref.step(c1, chunks), moved.step(c2, chunks), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_dense_offload_forced_is_token_identical(make_llm: Callable[..., Any], real_host: Any) -> None:
    from dspark.llm.device_map.offload import decide_dense_offload

    host, inv = real_host
    plain = make_llm()
    decision = decide_dense_offload(plain.engine.runner, host, inv, mode="auto")
    assert "torch@cpu" in decision.bids
    others = sorted({k.split("@")[0] for k in decision.bids} - {"torch"})
    if not others:
        pytest.skip("no plugin other than torch bids on the MLP here")
    prompts = random_prompts(5, seed=4, lo=2, hi=140)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    for plugin in others:
        llm = make_llm(dense_offload=plugin)
        off = llm.engine.dense_offload
        assert off is not None and off.device.plugin == plugin
        timed: list[str] = []
        calls = off.calls
        llm.engine.observe(lambda work, seconds: timed.append(work))
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert got == want, plugin
        assert off._exes and off.calls > 0  # compiled per (layer, bucket) on first use, and used
        assert timed.count("mlp") == off.calls - calls > 0 and timed.count("forward") == llm.stats().steps  # what metrics see


def test_dense_offload_whose_run_fails_falls_back_to_torch(make_llm: Callable[..., Any]) -> None:
    """A plugin that bids on the MLP, compiles it, and raises at run time costs the engine
    nothing but speed: torch runs that layer's MLP, the outputs are plain decoding's, and
    the failure is charged to the plugin for that subgraph, not to the whole plugin."""
    from bad_plugins import RaisesAtRun
    from dspark import PluginStatus
    from dspark.host.plugin_manager import PluginHost
    from dspark.host.settings import PluginSettings

    host = PluginHost(PluginSettings(autoload=False, blocked={"ngram", "drafters"})).load()
    host.register(RaisesAtRun(), "boom")
    prompts = random_prompts(3, seed=5, lo=2, hi=60)
    want = [o.token_ids for o in make_llm().generate(prompts, GREEDY)]
    llm = make_llm(dense_offload="boom", plugin_host=host)
    off = llm.engine.dense_offload
    assert off is not None and off.device.plugin == "boom"
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want
    assert off.calls == 0 and len(off.failed) == len(llm.engine.runner.layers)  # each layer left to torch
    assert next(iter(off.failed.values())).startswith("run: RuntimeError")
    record = host.records["boom"]
    assert record.faults and record.faults[0].hook == "run" and record.faults[0].charged_to == "subgraph"
    assert record.status == PluginStatus.ACTIVE  # one odd subgraph does not cost the whole plugin
