"""The AMX probe's child (:mod:`dspark_llamacpp.amx`): ``python -m dspark_llamacpp.amx_child FILE`` loads FILE
with llama.cpp's extra CPU buffer types and decodes 32 rows, then runs a bfloat16 matmul in torch (oneDNN's
AMX kernels, on the same thread) and decodes the same rows again; exit 0: every step ran and both decodes
gave the same logits."""

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

    def rows() -> np.ndarray:
        ctx.drop(0, 0)
        return ctx.decode(np.zeros(n, np.int32), np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32), want)

    first = rows()
    # Another library's tiles on this thread between two steps (a build that loads its tile configuration once
    # per thread dies here of SIGILL).
    import torch

    x = torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256).remainder(7).to(torch.bfloat16)
    before = x @ x
    again = rows()
    after = x @ x
    ctx.close()
    model.close()
    if not np.array_equal(first, again):
        sys.exit("llama.cpp's logits changed after a torch bfloat16 matmul on the same thread")
    if not torch.equal(before, after):
        sys.exit("a torch bfloat16 matmul changed after a llama.cpp step on AMX weights")


if __name__ == "__main__":
    main(sys.argv[1])
