"""The numpy example plugin's decoder: dspark.sdk.family.forward on ops a vendor writes, under the engine.

Every family's tiny checkpoint runs the engine (batching, chunked prefill, speculative verification)
on the ops and gives the torch runner's greedy tokens in float32; a family the definition cannot yet
express is declined with the reason. The kit's decoder check runs in the plugin's own suite
(tests/plugins/test_example_plugin.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from dspark.hookspecs import hookimpl
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.testing import engine_tokens, tiny_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins" / "dspark-numpy" / "src"))
import dspark_numpy  # noqa: E402

@pytest.fixture(scope="module")
def host() -> PluginHost:
    h = PluginHost(PluginSettings())
    h.register(dspark_numpy, "numpy")
    h.load()
    return h


def _tokens(path: Path, decoder: str, host: PluginHost, **kw: Any) -> tuple[list[list[int]], Any]:
    return engine_tokens(path, decoder, plugin_host=host, **kw)


@pytest.mark.parametrize("variant", ["gemma2", "gemma3", "smollm3", "mistral_sliding", "phi4_mini"])
def test_every_family_runs_on_the_ops_with_the_torch_runners_tokens(tmp_path: Path, host: PluginHost,
                                                                     variant: str) -> None:
    path = tiny_checkpoint(tmp_path / variant, variant)
    ref, _ = _tokens(path, "torch", host)
    got, e = _tokens(path, "numpy", host, max_num_batched_tokens=16)  # prompts run in chunks
    assert e.stats().decoder == "numpy@cpu", e.decoder_choice
    assert got == ref


def test_self_drafting_through_an_early_exit_on_the_ops_is_lossless(tmp_path: Path, host: PluginHost) -> None:
    path = tiny_checkpoint(tmp_path / "gemma2", "gemma2")
    ref, _ = _tokens(path, "torch", host)
    got, e = _tokens(path, "numpy", host, speculative_decoding={"strategy": "fixed", "drafters": ["self"],
                                                                "exit_layer": 1})
    s = e.stats()
    assert s.decoder == "numpy@cpu" and s.spec_drafts > 0, s
    assert got == ref


def test_longrope_crosses_its_switch_on_the_ops_as_the_torch_runner_does(tmp_path: Path, host: PluginHost) -> None:
    """Phi-3's LongRoPE: a sequence that grows past original_max_position_embeddings (32 here) is
    recomputed in long mode (dspark.llm.decoding.longrope), a prompt past it runs long from its first
    chunk, and a speculative rollback across it goes back to short mode."""
    path = tiny_checkpoint(tmp_path / "phi3", "phi3_longrope")
    prompts = ([5, 9, 13, 2, 7] * 4, list(range(30, 60)), list(range(40, 80)))
    ref, _ = engine_tokens(path, "torch", plugin_host=host, prompts=prompts, max_tokens=16)
    got, e = engine_tokens(path, "numpy", plugin_host=host, prompts=prompts, max_tokens=16,
                           speculative_decoding={"strategy": "fixed", "drafters": ["self"], "exit_layer": 1})
    assert e.stats().decoder == "numpy@cpu" and e.stats().spec_drafts > 0
    assert got == ref


class _Counted:
    """The numpy plugin's decoder hooks under a given version, counting compiles into ``compiled``."""

    DSPARK_API_VERSION = "1.10"

    def __init__(self, version: str, compiled: list[str]) -> None:
        self.version = version
        self.compiled = compiled

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> Any:
        return dspark_numpy.dspark_probe_devices(refresh)

    @hookimpl
    def dspark_decoder_bid(self, decoder: Any, device: Any) -> Any:
        return dspark_numpy.dspark_decoder_bid(decoder, device)

    @hookimpl
    def dspark_compile_decoder(self, decoder: Any, device: Any) -> Any:
        self.compiled.append(self.version)
        return dspark_numpy.dspark_compile_decoder(decoder, device)


def _start_auto(path: Path, version: str, compiled: list[str]) -> None:
    h = PluginHost(PluginSettings())
    h.register(_Counted(version, compiled), "numpy", version=version)
    h.load()
    engine_tokens(path, "auto", plugin_host=h, prompts=([5, 9, 13],), max_tokens=2)


def test_a_new_plugin_version_is_timed_again(tmp_path: Path) -> None:
    """decoder="auto" times every bidder once per model and keeps the timings on disk; the key holds the
    plugin's version, so a new release is measured again rather than trusted on old figures."""
    path = tiny_checkpoint(tmp_path / "llama", "llama")
    compiled: list[str] = []
    _start_auto(path, "0.1.0", compiled)
    first = len(compiled)  # once to time it, and once more if it won
    _start_auto(path, "0.1.0", compiled)  # warm: the same ranking from the cache, nothing compiled to time
    warm = len(compiled) - first
    _start_auto(path, "0.2.0", compiled)
    assert first >= 1 and warm == first - 1, compiled
    assert compiled[first + warm:] and set(compiled[first + warm:]) == {"0.2.0"}, compiled  # timed again


def test_another_cpu_is_timed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The timings' key holds the host's CPU: a cache directory carried to a machine with other ISA
    features (a home directory kept while the machine under it changed) is measured again, not trusted."""
    from dspark.host import hostinfo

    path = tiny_checkpoint(tmp_path / "llama", "llama")
    compiled: list[str] = []
    _start_auto(path, "0.1.0", compiled)
    first = len(compiled)
    _start_auto(path, "0.1.0", compiled)
    warm = len(compiled) - first
    here = hostinfo.fingerprint()
    monkeypatch.setattr(hostinfo, "fingerprint", lambda: {**here, "isa": [*here["isa"], "another-isa"]})
    _start_auto(path, "0.1.0", compiled)
    assert first >= 1 and warm == first - 1, compiled
    assert len(compiled) - first - warm == first, compiled  # timed (and compiled to run) as on a cold start
