"""Structured logging through structlog: JSON when stderr is not a terminal."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured = False


class _StderrLogger:
    """Writes to whatever ``sys.stderr`` is at the time of the call, not at configure time
    (so a redirected or replaced stderr, e.g. under pytest's capture, never goes stale)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def configure(json: bool | None = None, level: str | None = None) -> None:
    global _configured
    level_name = (level or os.environ.get("DSPARK_LOG_LEVEL", "WARNING")).upper()
    as_json = (not sys.stderr.isatty()) if json is None else json
    renderer: Any = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level_name]),
        logger_factory=lambda *args: _StderrLogger(),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str) -> Any:
    if not _configured:
        configure()
    return structlog.get_logger(name)
