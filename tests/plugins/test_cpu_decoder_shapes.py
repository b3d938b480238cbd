"""The `cpu` plugin's decoder keeps its inputs' shapes where it can: OpenVINO prepares the graph's nodes again
when an input's shape changes, so the block table, whose length grows each time a sequence crosses a page,
is padded to a power of two; PagedAttention never reads the padding, so the logits are the unpadded ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import dspark_plugins_cpu as plugin
from dspark.llm.decoding.runner import DecoderRunner, Target
from dspark.llm.decoding.spec import make_spec
from dspark.llm.runner.model import ModelRunner
from dspark.llm.runner.types import SeqChunk
from dspark.types import Device
from dspark_plugins_cpu.decoder import OpenVINODecoder

MODEL = Path(__file__).resolve().parents[2] / "core" / "dspark" / "assets" / "models" / "stdlib-llama"


def _device() -> Device:
    cpu = [d for d in plugin.dspark_probe_devices(refresh=False) if isinstance(d, Device) and d.id == "cpu"]
    assert len(cpu) == 1, cpu
    return cpu[0]


def test_the_block_table_keeps_its_shape_across_pages_and_the_logits_match_torch() -> None:
    runner = ModelRunner.from_pretrained(str(MODEL), torch.float32)
    dec = OpenVINODecoder(make_spec(runner, MODEL, max_num_tokens=64, max_num_seqs=2), _device())
    dr = DecoderRunner(ModelRunner.weightless(runner.cfg, runner.dtype),
                       [Target("cpu@cpu", "openvino", dec, "cpu", "cpu")], step_timeout_s=None, max_seqs=2)
    cache, ref = dr.make_cache(16, dec.block_size), runner.make_cache(16, dec.block_size)
    prompts = {"a": [5, 77, 310, 1024, 9, 4000, 12], "b": [6, 501, 33, 2048, 7, 88, 1200, 64, 9, 10, 11]}
    shapes, tables = set(), set()
    chunks = [SeqChunk(s, p) for s, p in prompts.items()]
    for _ in range(3 * dec.block_size):  # each sequence crosses two pages
        got, want = dr.step(cache, chunks), runner.step(ref, chunks)
        shapes.add(tuple(dec.request.get_tensor("block_indices").shape))
        tables.add(sum(len(cache.block_tables[s]) for s in prompts))
        for g, w in zip(got, want, strict=True):
            assert int(g.reshape(-1).argmax()) == int(w.reshape(-1).argmax())
            assert float((g - w).abs().max()) < 1e-3 * max(1.0, float(w.abs().max()))
        chunks = [SeqChunk(s, [int(w.reshape(-1).argmax())]) for s, w in zip(prompts, want)]
    assert len(tables) >= 4  # the block table grew step after step...
    assert shapes == {(16,)}  # ...and OpenVINO saw one shape
    assert np.all(dec.request.get_tensor("block_indices").data[sum(len(cache.block_tables[s]) for s in prompts):] == 0)
