"""How a decoder target's measured step times become its score: the time of a nominal request."""

from __future__ import annotations

import pytest

from dspark.llm.decoding.timing import NOMINAL_OUTPUT, NOMINAL_PROMPT, request_ms, score, shapes

SHAPES = shapes(1, 128)  # decode_b1, prefill_128, verify_k8
TORCH = {"decode_b1": 5.0, "prefill_128": 25.0, "verify_k8": 8.0}


def test_a_request_is_its_prefill_chunks_and_its_decode_steps() -> None:
    want = NOMINAL_OUTPUT * 5.0 + NOMINAL_PROMPT / 128 * 25.0
    assert request_ms(TORCH, SHAPES) == pytest.approx(want)
    # with speculation half the output goes through k=8 verifications taking 4 tokens each
    spec = NOMINAL_OUTPUT / 2 * 5.0 + NOMINAL_PROMPT / 128 * 25.0 + NOMINAL_OUTPUT / 2 / 4 * 8.0
    assert request_ms(TORCH, SHAPES, speculative=True) == pytest.approx(spec)


def test_fast_decode_beats_fast_prefill_one_request_at_a_time() -> None:
    # llama.cpp against OpenVINO on the embedded BF16 file, as measured: faster at decode, slower at prefill.
    decode_fast = {"decode_b1": 2.57, "prefill_128": 26.8, "verify_k8": 5.02}
    prefill_fast = {"decode_b1": 3.13, "prefill_128": 16.7, "verify_k8": 4.22}
    a, b = score(decode_fast, TORCH, SHAPES), score(prefill_fast, TORCH, SHAPES)
    assert a < b < 1.0
    def mean_ratio(ms: dict[str, float]) -> float:
        return sum(ms[k] / TORCH[k] for k in TORCH) / len(TORCH)

    assert mean_ratio(decode_fast) > mean_ratio(prefill_fast)  # an average of the shapes ranks them the other way


def test_batched_decode_prices_each_step_by_the_tokens_it_gives() -> None:
    sl = shapes(32, 128)
    ref = {"decode_b1": 5.0, "decode_b8": 8.0, "decode_b32": 16.0, "prefill_128": 25.0, "verify_k8": 8.0}
    batch_fast = {**ref, "decode_b32": 8.0}  # twice as fast at 32 at once only
    assert score(batch_fast, ref, sl) < 1.0 == score(ref, ref, sl)
    assert score({"decode_b1": 1.0}, {"prefill_128": 1.0}, sl) == float("inf")  # nothing in common
