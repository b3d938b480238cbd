"""Suite-wide settings: an isolated cache, and no plugin selection leaking in from the shell."""

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


@pytest.fixture(scope="session")
def cache_dir() -> str:
    return _CACHE
