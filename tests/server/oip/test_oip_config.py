"""The OIP server's config: every error names its field path on one line; the CLI turns bad input into a
one-line error and exit status 2 before anything loads; a model that cannot be batched as configured is
refused at load, naming the model and what to change."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from oip_fixtures import fixed, mlp

from dspark.server.config import ConfigError
from dspark.server.oip.config import OipConfig, is_oip_config, load_oip_config, single_model
from dspark.server.oip.model import ModelLoadError

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mlp(tmp_path_factory.mktemp("cfg") / "mlp.onnx")


def _write(tmp_path: Path, cfg: Any) -> Path:
    p = tmp_path / "oip.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.mark.parametrize("models, server, words", [
    (None, {}, "models: Field required"),
    ([], {}, "models: List should have at least 1 item"),
    ([{"path": "missing.onnx"}], {}, "models.0.path: no such file: missing.onnx"),
    ([{"path": "{onnx}", "max_batch": 4}], {}, "models.0.max_batch: unknown field"),
    ([{"path": "{onnx}", "max_batch_size": -1}], {}, "models.0.max_batch_size: Input should be greater than or equal"),
    ([{"path": "{onnx}", "dynamic_batching": {}}], {}, "models.0: dynamic_batching needs max_batch_size > 0"),
    ([{"path": "{onnx}", "max_batch_size": 4, "dynamic_batching": {"preferred_batch_size": [2, 8]}}], {},
     "preferred_batch_size [2, 8] exceeds max_batch_size (4)"),
    ([{"path": "{onnx}", "max_batch_size": 4, "dynamic_batching": {"max_queue_delay_microseconds": -5}}], {},
     "models.0.dynamic_batching.max_queue_delay_microseconds: Input should be greater than or equal to 0"),
    ([{"path": "{onnx}", "instance_count": 0}], {}, "models.0.instance_count: Input should be greater than or equal"),
    ([{"path": "{onnx}"}, {"path": "{onnx}"}], {}, "model names must be unique: ['mlp'] served twice"),
    ([{"path": "{onnx}", "name": "a/b"}], {}, "name 'a/b': use letters"),
    ([{"path": "{onnx}"}], {"grpc_port": 70000}, "server.grpc_port: Input should be less than or equal to 65535"),
    ([{"path": "{onnx}"}], {"api_type": "openai"}, "server.api_type: Input should be 'oip'"),
])
def test_errors_name_the_field_on_one_line(tmp_path: Path, onnx_file: Path, models: Any, server: dict[str, Any],
                                           words: str) -> None:
    cfg: dict[str, Any] = {"server": server}
    if models is not None:
        cfg["models"] = [{k: (str(onnx_file) if v == "{onnx}" else v) for k, v in m.items()} for m in models]
    path = _write(tmp_path, cfg)
    with pytest.raises(ConfigError) as e:
        load_oip_config(path)
    msg = str(e.value)
    assert words in msg and msg.startswith(f"{path}: ") and "\n" not in msg, msg


def test_a_model_on_the_command_line_and_the_flags(onnx_file: Path, tmp_path: Path) -> None:
    cfg = load_oip_config(None, overrides={"port": 0, "grpc_port": 0, "metrics_port": False, "host": None},
                          model=single_model(str(onnx_file), 8, 250))
    m = cfg.models[0]
    assert (m.served_name, m.max_batch_size, cfg.server.metrics_port, cfg.server.grpc_port) == ("mlp", 8, None, 0)
    assert m.dynamic_batching is not None and m.dynamic_batching.max_queue_delay_microseconds == 250
    plain = load_oip_config(None, model=single_model(str(onnx_file)))
    assert plain.models[0].max_batch_size == 0 and plain.models[0].dynamic_batching is None
    assert plain.server.port == 8000 and plain.server.grpc_port == 8001 and plain.server.metrics_port == 8002
    with pytest.raises(ConfigError, match="--max-queue-delay-us needs --max-batch-size"):
        single_model(str(onnx_file), None, 100)
    listed = _write(tmp_path, {"models": [{"path": str(onnx_file)}]})
    with pytest.raises(ConfigError, match="lists models: and a MODEL was given too"):
        load_oip_config(listed, model=single_model(str(onnx_file)))
    server_only = _write(tmp_path, {"server": {"api_type": "oip", "port": 9100}})
    assert is_oip_config(yaml.safe_load(server_only.read_text())) and is_oip_config({"models": []})
    assert not is_oip_config({"model": {"path": "default"}, "server": {"port": 1}})
    assert load_oip_config(server_only, model=single_model(str(onnx_file))).server.port == 9100


def test_the_example_config_validates(onnx_file: Path) -> None:
    raw = yaml.safe_load((REPO / "examples" / "oip_config.yaml").read_text())
    assert is_oip_config(raw)
    for m in raw["models"]:
        m["path"] = str(onnx_file)  # the example's files are the reader's; the fields are what is checked
    cfg = OipConfig.model_validate(raw)
    assert len(cfg.models) >= 2 and any(m.dynamic_batching is not None for m in cfg.models)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    dspark = Path(sys.executable).with_name("dspark")
    return subprocess.run([str(dspark), "serve", *args], capture_output=True, text=True, timeout=120)


def test_the_cli_refuses_bad_input_with_one_line_and_status_2(tmp_path: Path, onnx_file: Path) -> None:
    r = _cli(str(tmp_path / "missing.onnx"), "--port", "0")
    assert r.returncode == 2 and r.stderr.strip() == f"error: models.0.path: no such file: {tmp_path / 'missing.onnx'}"
    bad = _write(tmp_path, {"models": [{"path": str(onnx_file), "max_batch_size": 4,
                                        "dynamic_batching": {"preferred_batch_size": [16]}}]})
    r = _cli("--config", str(bad))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert str(bad) in r.stderr and "models.0" in r.stderr and "preferred_batch_size" in r.stderr
    r = _cli(str(onnx_file), "--dtype", "float32")
    assert r.returncode == 2 and "--dtype" in r.stderr and "not for an .onnx model" in r.stderr
    r = _cli(str(onnx_file), "--max-queue-delay-us", "100")
    assert r.returncode == 2 and "--max-batch-size" in r.stderr


def test_batching_a_model_whose_first_dim_is_fixed_is_refused_at_load(tmp_path: Path) -> None:
    from dspark.server.oip.launch import load_models

    path = fixed(tmp_path / "fixed.onnx")
    cfg = OipConfig.model_validate({"models": [{"path": str(path), "max_batch_size": 4}]})
    with pytest.raises(ModelLoadError) as e:
        load_models(cfg)
    msg = str(e.value)
    assert msg.startswith("models.0: model 'fixed': max_batch_size 4") and "x [2, 2]" in msg, msg
    assert "max_batch_size: 0" in msg
