"""The AMX probe's child (:mod:`dspark_llamacpp.amx`): ``python -m dspark_llamacpp.amx_child FILE`` loads FILE
with llama.cpp's extra CPU buffer types and decodes 32 rows; exit 0: the step ran."""

from __future__ import annotations

import sys


def main(path: str) -> None:
    import numpy as np

    from dspark_llamacpp import runtime

    model = runtime.Model(path, repack=True)
    ctx = runtime.Context(model, n_ctx=64, n_seq_max=1, n_batch=64, threads=2)
    n = 32  # more than one row: the tile path (one row takes a VNNI path without tiles)
    want = np.zeros(n, np.int8)
    want[-1] = 1
    ctx.decode(np.zeros(n, np.int32), np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32), want)
    ctx.close()
    model.close()


if __name__ == "__main__":
    main(sys.argv[1])
