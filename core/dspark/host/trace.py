"""``DSPARK_TRACE=1``: one line on stderr per hook call, whatever the log level.

Format: ``dspark.trace plugin=NAME hook=HOOK ms=DURATION outcome=OUTCOME [detail=...]``;
the outcome is ``ok``, ``abstained`` (the hook returned None), ``skipped``
(not called: an earlier failure excluded it), ``no hardware``, ``raised``,
``invalid`` or ``timeout``.
"""

from __future__ import annotations

import sys


def emit(plugin: str, hook: str, seconds: float, outcome: str, detail: str = "") -> None:
    line = f"dspark.trace plugin={plugin} hook={hook} ms={seconds * 1e3:.3f} outcome={outcome}"
    if detail:
        line += f" detail={detail!r}"
    # Read sys.stderr at call time: a replaced stderr (pytest capture) must not go stale.
    print(line, file=sys.stderr, flush=True)
