"""Suite-wide settings: an isolated cache, no plugin selection leaking in from the shell, the torch decoder."""

from __future__ import annotations

import os
import tempfile

import pytest

# One cache per test session, shared with the subprocesses the tests start,
# so microbenchmarks run once and the user's ~/.cache is never touched.
_CACHE = tempfile.mkdtemp(prefix="dspark-test-cache-")
os.environ["DSPARK_CACHE_DIR"] = _CACHE
for var in ("DSPARK_PLUGINS", "DSPARK_DISABLE_PLUGIN_AUTOLOAD", "DSPARK_HOOK_TIMEOUT", "DSPARK_TRACE"):
    os.environ.pop(var, None)
# The engine's decoder defaults to the torch runner here: most tests are about the engine's own logic
# and compare with transformers on it. tests/llm/test_decoder_targets.py runs 'auto' and every plugin's
# compiled decoder through the same engine features, and the server tests start a real 'auto' server.
os.environ["DSPARK_DECODER"] = "torch"


@pytest.fixture(scope="session")
def cache_dir() -> str:
    return _CACHE
