"""What a decoder spec hands a plugin as weights: float32 by default, or (API 1.12) the engine's own
tensors in their precision, with no float32 copy made on the way."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch
from decoder_testutil import MODEL

from dspark.llm.decoding.spec import make_spec
from dspark.llm.runner.model import ModelRunner


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stored_weights_are_views_of_the_engines_tensors(dtype: torch.dtype) -> None:
    runner = ModelRunner.from_pretrained(str(MODEL), dtype)
    spec = make_spec(runner, MODEL)
    stored, wide = spec.weights(stored=True), spec.weights()
    want = ml_dtypes.bfloat16 if dtype == torch.bfloat16 else np.float32
    L, S = runner.layers[0], stored.layers[0]
    for arr, tensor in ((S.qkv, L.w_qkv_t), (S.o, L.w_o.t()), (S.down, L.w_down.t()), (stored.embed, runner.embed),
                        (stored.head, runner.lm_head_t), (S.in_norm, L.in_norm)):
        assert arr is not None and arr.dtype == want
        assert arr.shape == tuple(tensor.shape)
        assert _address(arr) == tensor.data_ptr()  # the engine's memory, not a copy
    # The same values either way: float32 widening is exact.
    for got, ref in ((S.qkv, wide.layers[0].qkv), (stored.embed, wide.embed), (S.in_norm, wide.layers[0].in_norm)):
        assert got is not None and ref is not None and ref.dtype == np.float32
        assert np.array_equal(np.asarray(got, np.float32), ref)


def test_a_spec_without_stored_weights_gives_float32() -> None:
    runner = ModelRunner.from_pretrained(str(MODEL), torch.bfloat16)
    spec = dataclasses.replace(make_spec(runner, MODEL), stored_weights_fn=None)  # as a spec made before 1.12
    w = spec.weights(stored=True)
    assert w.layers[0].qkv is not None and w.layers[0].qkv.dtype == np.float32
