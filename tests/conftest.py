"""Suite-wide settings: an isolated cache, no plugin selection leaking in from the shell, the torch decoder."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The tests' shared helpers are imported by bare name from every folder below (pytest's default
# 'prepend' import mode, no __init__.py files): bad_plugins and plugin_install live here, in tests/;
# llm_testutil and logits_testutil in tests/llm/. Pytest would put both folders on sys.path anyway
# when it loads their conftest.py files; saying so here keeps a test module in a deeper folder
# importable however it is started. Test module names stay unique across tests/ for the same reason.
_TESTS = Path(__file__).resolve().parent
for _helpers in (_TESTS, _TESTS / "llm"):
    if str(_helpers) not in sys.path:
        sys.path.insert(0, str(_helpers))

# One cache per test session, shared with the subprocesses the tests start and with pytest-xdist's
# workers (they inherit the environment of the process that started them), so microbenchmarks run
# once and the user's ~/.cache is never touched.
_OWN_CACHE = not os.environ.get("DSPARK_TEST_SESSION_CACHE")  # made here, not inherited: removed at the end
_CACHE = os.environ.get("DSPARK_TEST_SESSION_CACHE") or tempfile.mkdtemp(prefix="dspark-test-cache-")
os.environ["DSPARK_TEST_SESSION_CACHE"] = os.environ["DSPARK_CACHE_DIR"] = _CACHE
for var in ("DSPARK_PLUGINS", "DSPARK_DISABLE_PLUGIN_AUTOLOAD", "DSPARK_HOOK_TIMEOUT", "DSPARK_TRACE"):
    os.environ.pop(var, None)
# The engine's decoder defaults to the torch runner here: most tests are about the engine's own logic
# and compare with transformers on it. tests/llm/decoding/test_decoder_targets.py runs 'auto' and every plugin's
# compiled decoder through the same engine features, and the server tests start a real 'auto' server.
os.environ["DSPARK_DECODER"] = "torch"
# Decoder timings taken while other processes held the cores are timed again at a quieter start; on a
# machine busy with other work (pytest-xdist's own workers among it) a cache test would then follow the
# machine's load. Kept off here; tests/llm/decoding/test_decoder_contention.py turns it on.
os.environ["DSPARK_BUSY_RETIME"] = "0"


@pytest.fixture(scope="session")
def cache_dir() -> str:
    return _CACHE


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The session's cache goes with it (it holds mapped weight files, megabytes each), removed by the
    process that made it: pytest-xdist's controller, after its workers."""
    if _OWN_CACHE:
        shutil.rmtree(_CACHE, ignore_errors=True)
