"""The ``dspark`` command line: the app with every command module registered on it."""

from __future__ import annotations

import sys

from dspark.cli import bench as _bench  # noqa: F401  (registers bench)
from dspark.cli import cache as _cache  # noqa: F401  (registers cache)
from dspark.cli import convert as _convert
from dspark.cli import devices as _devices  # noqa: F401  (registers devices, demo)
from dspark.cli import plan as _plan  # noqa: F401  (registers plan, run)
from dspark.cli import serve as _serve  # noqa: F401  (registers serve)
from dspark.cli.app import app

app.command("convert")(_convert.convert)


def main() -> None:
    import os
    import threading

    from dspark.host import log
    from dspark.host.hook_threads import IDLE_NAME

    log.configure()
    code: int | str | None = 0
    try:
        app()
    except SystemExit as exc:
        code = exc.code
    # A plugin hook that hung past its timeout still owns a thread; it must not
    # keep the process alive or crash the interpreter's shutdown.
    if any(t.name.startswith("dspark-hook-") and t.name != IDLE_NAME and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
