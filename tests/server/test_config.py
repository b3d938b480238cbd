"""The server config: the seed's YAML, field-path errors, CLI overrides, a server started from the example."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from dspark.llm import SamplingParams, default_model_path
from dspark.llm.config import EngineConfig
from dspark.server.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
SEED = """\
model:
  path: "/models/deepseek-coder-33b-dspark"
  name: "deepseek-coder-33b-instruct"
server:
  host: "0.0.0.0"
  port: 8000
  api_type: "openai"
engine:
  max_total_tokens: 200000
  max_model_len: 32768
  continuous_batching:
    enabled: true
    max_batch_size: 64
  speculative_decoding:
    enabled: true
    strategy: "deepspec_v2"
resources:
  gpu_memory_utilization: 0.9
  cpu_cores_per_worker: 4
  enable_metrics: true
  metrics_port: 9090
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_the_seeds_file_is_accepted_and_mapped(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, SEED))
    assert cfg.served_name() == "deepseek-coder-33b-instruct" and cfg.model_path() == Path(
        "/models/deepseek-coder-33b-dspark")
    assert (cfg.server.host, cfg.server.port, cfg.resources.metrics_port) == ("0.0.0.0", 8000, 9090)
    spec = cfg.engine.speculative_decoding
    assert spec.active and spec.strategy == "deepspec"  # deepspec_v2 is an alias
    ec = cfg.engine_config()
    assert (ec.max_batch_size, ec.max_model_len, ec.max_total_tokens) == (64, 32768, 200000)
    assert ec.decode_run_ms == EngineConfig.model_fields["decode_run_ms"].default  # the engine's own default


def test_greedy_runs_are_set_from_the_config(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "engine:\n  continuous_batching:\n    decode_run_ms: 0\n"))
    assert cfg.engine_config().decode_run_ms == 0.0
    with pytest.raises(Exception, match="engine.continuous_batching.decode_run_ms"):
        load_config(write(tmp_path, "engine:\n  continuous_batching:\n    decode_run_ms: -1\n"))


def test_model_quantization_reaches_the_engine(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "model:\n  quantization:\n    method: int4_mixed\n    group_size: 64\n"))
    q = cfg.engine_config().quantization
    assert q is not None and (q.scheme, q.group_size, q.budget) == ("int4_mixed", 64, 0.04)
    assert load_config(None).engine_config().quantization is None


def test_defaults_serve_the_embedded_model_on_loopback() -> None:
    cfg = load_config(None)
    assert (cfg.server.host, cfg.server.port, cfg.resources.metrics_port) == ("127.0.0.1", 8000, 9090)
    assert cfg.resources.enable_metrics and cfg.server.api_key is None
    assert cfg.model_path() == default_model_path() and cfg.served_name() == default_model_path().name


def test_flags_override_the_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, SEED), {"port": 0, "model": "default", "max_batch_size": 2, "host": None,
                                              "enable_metrics": False, "served_model_name": "m"})
    assert cfg.server.port == 0 and cfg.model_path() == default_model_path() and cfg.served_name() == "m"
    assert cfg.engine_config().max_batch_size == 2 and not cfg.resources.enable_metrics
    assert cfg.server.host == "0.0.0.0"  # None = flag not given: the file's value stays


def test_disabled_continuous_batching_runs_one_sequence() -> None:
    cfg = load_config(None)
    off = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={
        "continuous_batching": cfg.engine.continuous_batching.model_copy(update={"enabled": False})})})
    assert off.engine_config().max_batch_size == 1


@pytest.mark.parametrize(("text", "expected"), [
    ("engine:\n  continuous_batching:\n    max_batch_size: 0\n",
     "engine.continuous_batching.max_batch_size: Input should be greater than or equal to 1"),
    ("engine:\n  speculative_decoding:\n    strategy: medusa\n",
     "engine.speculative_decoding.strategy: Input should be 'deepspec', 'deepspec_v2', 'fixed' or 'off'"),
    ("engine:\n  scheduler:\n    policy: lifo\n", "engine.scheduler.policy: Input should be 'fcfs_with_priority' or 'fcfs'"),
    ("server:\n  api_type: grpc\n", "server.api_type: Input should be 'openai'"),
    ("resources:\n  gpu_memory_utilization: 1.5\n", "resources.gpu_memory_utilization: Input should be less than"),
    ("resources:\n  gpu_memory_utilization: 0\n", "resources.gpu_memory_utilization: Input should be greater than 0"),
    ("server:\n  port: 70000\n", "server.port: Input should be less than or equal to 65535"),
    ("engine:\n  max_batch_size: 4\n", "engine.max_batch_size: unknown field"),
    ("model:\n  quantization: int9\n", "model.quantization.method: Value error, unknown quantization scheme 'int9'"),
    ("model:\n  quantization:\n    method: int8\n    max_drop: -1\n",
     "model.quantization.max_drop: Input should be greater than or equal to 0"),
    ("- just\n- a list\n", "expected a mapping"),
    ("model: [unclosed\n", "not valid YAML"),
])
def test_errors_name_the_field_path(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert expected in str(e.value)


def test_cli_reports_config_errors_with_exit_code_2(tmp_path: Path) -> None:
    bad = write(tmp_path, "engine:\n  continuous_batching:\n    max_batch_size: 0\n")
    r = subprocess.run([sys.executable, "-m", "dspark.server", "--config", str(bad), "--dtype", "float64"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "engine.continuous_batching.max_batch_size: Input should be greater than or equal to 1" in r.stderr
    assert "model.dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'" in r.stderr  # the flag's value
    assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "dspark.cli", "serve", "--model", str(tmp_path / "nowhere")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "model.path" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def example_server(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``dspark serve`` on examples/server_config.yaml, with flags overriding the file."""
    cfg = yaml.safe_load((REPO / "examples" / "server_config.yaml").read_text())
    h = server_factory(tmp_path_factory.mktemp("example"), config=cfg, entry=["-m", "dspark.cli", "serve"],
                       args=["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--dtype", "float32",
                             "--served-model-name", "coder", "--api-key", "s3cret", "--cpu-cores", "1",
                             "--max-batch-size", "4", "--max-model-len", "256"])
    h.api_key = "s3cret"  # given as a flag, so the handle did not know it
    return h


def test_startup_log_lines(example_server: Any) -> None:
    events = [e for e in example_server.startup_log if e.get("level") in ("info", "warning")]
    text = [e["event"] for e in events]
    assert f"Loading model from {default_model_path()}" in text
    assert any(re.fullmatch(r"Model loaded in \d+\.\d+s\.", t) for t in text)
    assert "Initializing DeepSpec scheduler..." in text
    port = example_server.base_url.rsplit(":", 1)[1]
    assert f"DSpark server is listening on http://127.0.0.1:{port}" in text
    assert f"Metrics endpoint is available on {example_server.metrics_url}" in text
    loading = next(e for e in events if e["event"].startswith("Loading model"))
    assert loading["torch_threads"] == 1  # --cpu-cores overrides resources.cpu_cores_per_worker: 4
    loaded = next(e for e in events if e["event"].startswith("Model loaded"))
    assert loaded["max_model_len"] == 256 and loaded["model"] == "coder"
    frozen = next(e for e in events if e["event"] == "heap frozen for the collector")  # before serving
    assert frozen["objects"] > 10_000  # the runtimes' and the model's objects, out of every full collection


def test_api_key_and_served_name(example_server: Any) -> None:
    s = example_server
    assert [m.id for m in s.openai().models.list().data] == ["coder"]
    assert s.openai().models.retrieve("coder").max_model_len == 256  # type: ignore[attr-defined]
    r = s.openai().completions.create(model="coder", prompt="import os\n", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    for key in ("wrong", "s3cre", "s3cret2"):
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=s.api_url, api_key=key, max_retries=0).models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    no_key = httpx.post(f"{s.api_url}/completions", json={"model": "coder", "prompt": "x"})
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{s.base_url}/health").status_code == 200  # liveness probes need no key


def test_chat_without_max_tokens_fills_the_context(example_server: Any) -> None:
    """No max_tokens: generation may use all that is left of max_model_len (256 here, from the flag)."""
    r = example_server.openai().chat.completions.create(
        model="coder", messages=[{"role": "user", "content": "hi"}], temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.total_tokens == 256 and r.choices[0].finish_reason == "length"


def test_speculative_decoding_reaches_the_engine(example_server: Any, reference: Any) -> None:
    """The example enables DeepSpec (as deepspec_v2): drafts show in /metrics and greedy text is unchanged."""
    prompt = "def quick_sort(arr):"
    r = example_server.openai().completions.create(model="coder", prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == reference.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0].text
    m = example_server.metrics()
    assert m.value("dspark_spec_decode_enabled", strategy="deepspec") == 1
    drafted = m.value("dspark_spec_decode_draft_tokens_total")
    accepted = m.value("dspark_spec_decode_accepted_tokens_total")
    assert 0 <= accepted <= drafted
    assert m.value("dspark_spec_decode_acceptance_rate") == pytest.approx(accepted / drafted if drafted else 0.0)
    per_drafter = m.families["dspark_spec_decode_drafter_draft_tokens"].samples
    assert per_drafter and sum(x.value for x in per_drafter) == drafted
    assert not [e for e in example_server.log() if e.get("level") == "warning" and "speculative" in e["event"]]


def test_logprobs_penalties_and_grammar_under_speculation(example_server: Any, reference: Any) -> None:
    """DeepSpec on: logprobs are the target model's, penalties keep greedy output exact, and drafted
    tokens are held to the grammar (every constrained output validates)."""
    import json

    import jsonschema

    client = example_server.openai()
    prompt = "def quick_sort(arr):"
    r = client.completions.create(model="coder", prompt=prompt, max_tokens=24, temperature=0, logprobs=2,
                                  presence_penalty=0.8, extra_body={"repetition_penalty": 1.2})
    ref = reference.generate(prompt, SamplingParams(max_tokens=24, temperature=0, logprobs=2, presence_penalty=0.8,
                                                    repetition_penalty=1.2))[0]
    assert r.choices[0].text == ref.text
    for got, want in zip(r.choices[0].logprobs.token_logprobs, ref.logprobs, strict=True):
        assert got == pytest.approx(want.logprob, abs=1e-4)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                             "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    for seed in range(3):
        out = client.chat.completions.create(
            model="coder", messages=[{"role": "user", "content": "status as JSON"}], max_tokens=60,
            temperature=0.8, seed=seed, response_format={"type": "json_schema", "json_schema": {
                "name": "s", "schema": schema}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert example_server.metrics().value("dspark_spec_decode_draft_tokens_total") > 0


def test_sigterm_shuts_down_cleanly(example_server: Any) -> None:
    assert example_server.stop() == 0
    assert example_server.log()[-1]["event"] == "DSpark server stopped"
