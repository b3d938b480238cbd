"""Progress of work that takes seconds: a model's start (its decoder targets compiled, checked and timed, the
winner compiled, speculation calibrated), reported step by step.

The work says what it begins (:func:`step`); whoever shows it installs a reporter around the work
(:func:`showing`; the CLI's :func:`on_terminal` draws a live line on a terminal), and every step is also logged
(``progress``), so a server's log says where its start-up time went.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from dspark.host.log import get_logger

log = get_logger(__name__)

Reporter = Callable[[str], None]  # called with what begins now

_lock = threading.Lock()
_reporters: list[Reporter] = []


@contextmanager
def showing(reporter: Reporter) -> Iterator[None]:
    """``reporter`` is told every step that begins while the block runs (where blocks nest, the innermost)."""
    with _lock:
        _reporters.append(reporter)
    try:
        yield
    finally:
        with _lock:
            _reporters.remove(reporter)


def step(what: str, **fields: Any) -> None:
    """Work named ``what`` begins now; it ends when the next step begins or the shown block ends. ``fields``
    go to the log only."""
    log.info("progress", what=what, **fields)
    with _lock:
        reporter = _reporters[-1] if _reporters else None
    if reporter is not None:
        try:
            reporter(what)
        except Exception as exc:  # a display's fault must not fail the work it shows
            log.warning("progress.reporter_failed", error=f"{type(exc).__name__}: {exc}")


@contextmanager
def on_terminal(title: str) -> Iterator[None]:
    """While the block runs, a line on stderr, when it is a terminal: a spinner, ``title``, the step in
    progress and the time since the block began (rich's progress display, gone once the block ends)."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(title, total=None)
        with showing(lambda what: bar.update(task, description=f"{title}: {what}")):
            yield
