"""Progress of a model's start: steps reach the innermost reporter and the log, a failing display fails
nothing, and an engine's start reports its stages in order (dspark.host.progress)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from dspark.host import progress
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings

MODEL = Path(__file__).resolve().parents[2] / "core" / "dspark" / "assets" / "models" / "stdlib-llama"


@pytest.fixture
def info_logs() -> Iterator[list[dict[str, Any]]]:
    """The events logged at INFO and above while the test runs (the default level is WARNING)."""
    before = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**before)


def test_steps_reach_the_innermost_reporter_and_the_log(info_logs: list[dict[str, Any]]) -> None:
    outer: list[str] = []
    inner: list[str] = []
    with progress.showing(outer.append):
        progress.step("a")
        with progress.showing(inner.append):
            progress.step("b", target="x")
        progress.step("c")
    progress.step("d")  # nobody shows it: logged only
    assert outer == ["a", "c"] and inner == ["b"]
    got = [(e["what"], e.get("target")) for e in info_logs if e["event"] == "progress"]
    assert got == [("a", None), ("b", "x"), ("c", None), ("d", None)]


def test_a_failing_display_fails_nothing() -> None:
    def broken(what: str) -> None:
        raise OSError("the terminal went away")

    with structlog.testing.capture_logs() as logs, progress.showing(broken):
        progress.step("a")
    failed = [e for e in logs if e["event"] == "progress.reporter_failed"]
    assert len(failed) == 1 and "the terminal went away" in failed[0]["error"]


def test_on_terminal_is_silent_where_stderr_is_no_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    with progress.on_terminal("starting"):
        progress.step("a")
    assert capsys.readouterr().err == ""


def test_an_engine_start_reports_its_stages_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("openvino")
    from dspark.llm.engine import LLMEngine

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))  # a cold start: every stage runs
    host = PluginHost(PluginSettings(blocked={"npu", "cuda", "llamacpp"})).load()
    seen: list[str] = []
    with progress.showing(seen.append):
        e: Any = LLMEngine.from_model(MODEL, dtype="float32", decoder="auto", plugin_host=host, max_batch_size=4,
                                      speculative_decoding={"drafters": ["prompt-lookup"]})
    # Which decoder wins is measured, and a busy machine can tip it: the stages are the same up to the timing,
    # and the winner is compiled again only when it is not the torch runner.
    choice = e.decoder_choice
    assert choice is not None and choice.chosen in {"cpu@cpu", "torch"}, choice
    want = ["reading stdlib-llama", "asking the plugins for a decoder", "stdlib-llama: compiling cpu@cpu",
            "stdlib-llama: checking cpu@cpu's outputs", "stdlib-llama: timing cpu@cpu",
            *(["stdlib-llama: compiling cpu@cpu"] if choice.chosen == "cpu@cpu" else []), "preparing the drafters",
            "timing verification and drafters (DeepSpec's cost models)"]
    it = iter(seen)
    assert all(w in it for w in want), seen  # in this order, whatever else comes between
    if choice.chosen == "torch":
        assert seen.count("stdlib-llama: compiling cpu@cpu") == 1, seen  # a loser is not compiled again
