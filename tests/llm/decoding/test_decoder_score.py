"""How a decoder target's measured step times become its score: the time of a nominal request."""

from __future__ import annotations

import pytest

from dspark.llm.decoding.timing import NOMINAL_OUTPUT, NOMINAL_PROMPT, request_ms, score, scores, shapes

SHAPES = shapes(1, 128)  # decode_b1, run_b1, prefill_128, verify_k8
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


def test_a_server_of_32_weighs_each_batch_size_by_time_not_tokens() -> None:
    # The engine's start-up timings of the 0.5B Q4_K_M file (ms per step): llama.cpp steps one row faster,
    # OpenVINO 8 and 32 rows and prefill faster.
    one_row_fast = {"decode_b1": 25.2, "decode_b8": 68.8, "decode_b32": 164.1, "prefill_128": 333.8, "verify_k8": 57.5}
    batch_fast = {"decode_b1": 31.5, "decode_b8": 64.1, "decode_b32": 102.9, "prefill_128": 266.1, "verify_k8": 58.3}
    server = shapes(32, 128)
    assert score(batch_fast, one_row_fast, server) < 1.0  # a server sized for 32 at once runs the batch-fast one
    # an equal share of the tokens at each batch size would have chosen the other
    tokens_share = sum(256 / 3 / s.seqs * one_row_fast[s.name] for s in server if s.name.startswith("decode_"))
    assert tokens_share < sum(256 / 3 / s.seqs * batch_fast[s.name] for s in server if s.name.startswith("decode_"))
    alone = shapes(1, 128)  # an engine of one sequence at a time runs the one-row-fast one
    assert score(one_row_fast, batch_fast, alone) < 1.0
    assert request_ms(batch_fast, server) < request_ms(one_row_fast, server)


def test_targets_are_ranked_by_their_own_times_not_by_the_torch_runner_slowed_beside_them() -> None:
    # The engine's start-up timings of the embedded BF16 file (ms per step), each target timed in turn beside the
    # torch runner: beside OpenVINO the torch runner stepped one row in 6.49 ms, beside llama.cpp in 3.92 (they
    # share OpenMP), beside ONNX Runtime in 3.74. OpenVINO's ratio to its own neighbour put it ahead (x1.15) of
    # llama.cpp, which serves this file one request at a time 1.28x faster.
    ov = {"decode_b1": 1.4099, "prefill_128": 4.2329, "verify_k8": 1.3934}
    ov_ref = {"decode_b1": 6.4873, "prefill_128": 9.1159, "verify_k8": 4.7763}
    llama = {"decode_b1": 0.8414, "prefill_128": 21.1093, "verify_k8": 3.0176}
    llama_ref = {"decode_b1": 3.9196, "prefill_128": 8.8254, "verify_k8": 4.7772}
    ort = {"decode_b1": 2.5378, "prefill_128": 15.2484, "verify_k8": 3.8571}
    ort_ref = {"decode_b1": 3.736, "prefill_128": 9.5423, "verify_k8": 4.8339}
    assert score(ov, ov_ref, SHAPES) < score(llama, llama_ref, SHAPES)  # the ratio to each one's neighbour
    got, ref = scores({"cpu": ov, "llamacpp": llama, "npu": ort}, [ov_ref, llama_ref, ort_ref], SHAPES)
    assert got["llamacpp"] < got["cpu"] < got["npu"] < 1.0
    assert ref == {"decode_b1": 3.736, "prefill_128": 8.8254, "verify_k8": 4.7763}  # its fastest, shape by shape
    assert got["cpu"] / got["llamacpp"] == pytest.approx(request_ms(ov, SHAPES) / request_ms(llama, SHAPES))


def test_targets_timed_alone_are_scored_against_the_fastest() -> None:
    # A file run as stored: each target timed in a process of its own, with no torch runner beside it.
    fast, slow = {"decode_b1": 1.0, "prefill_128": 10.0}, {"decode_b1": 2.0, "prefill_128": 10.0}
    got, ref = scores({"a": slow, "b": fast}, [], shapes(1, 128))
    assert ref is None and got["b"] == 1.0 < got["a"]
    assert scores({}, [], SHAPES) == ({}, None)


def test_half_of_a_requests_decode_is_priced_at_the_targets_greedy_runs() -> None:
    # Recorded one-row times of the embedded BF16 file (ms): llama.cpp's steps through the engine 0.92, its runs
    # 0.64 a step; OpenVINO's 1.00 and 0.86. Half of a nominal request's steps are greedy runs, half plain steps.
    llama = {"decode_b1": 0.9177, "run_b1": 0.64, "prefill_128": 15.1068, "verify_k8": 2.6363}
    ov = {"decode_b1": 1.0027, "run_b1": 0.8571, "prefill_128": 8.4998, "verify_k8": 1.6167}
    assert score(llama, ov, SHAPES) < 1.0
    plain = {k: v for k, v in llama.items() if k != "run_b1"}  # its steps alone: OpenVINO's prefill wins
    assert score(plain, ov, SHAPES) > 1.0
    want = NOMINAL_OUTPUT * (0.9177 + 0.64) / 2 + NOMINAL_PROMPT / 128 * 15.1068
    assert request_ms(llama, SHAPES) == pytest.approx(want)
    # a target without runs (the torch runner) is priced at its step alone, against any target's runs
    assert request_ms(TORCH, SHAPES) == pytest.approx(NOMINAL_OUTPUT * 5.0 + NOMINAL_PROMPT / 128 * 25.0)


def test_close_calls_are_those_within_the_factor_of_the_best_and_each_takes_the_mean_of_its_times() -> None:
    from dspark.llm.decoding.timing import CLOSE, averaged, close_calls

    assert close_calls({"a": 1.0, "b": 1.0 * CLOSE, "c": 1.01 * CLOSE}) == ["a", "b"]
    assert close_calls({"a": 2.0}) == ["a"] and close_calls({}) == []
    assert averaged({"decode_b1": 1.0, "run_b1": 0.9}, {"decode_b1": 1.2, "run_b1": 0.5, "verify_k8": 2.0}) == {
        "decode_b1": 1.1, "run_b1": 0.7, "verify_k8": 2.0}
