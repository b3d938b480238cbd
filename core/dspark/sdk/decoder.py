"""Whole-decoder targets (plugin API 1.6, 1.8): the SDK's name for :mod:`dspark.types.decoder`.

The types live with the other records plugins exchange with the core
(:mod:`dspark.types`), below :mod:`dspark.hookspecs`, whose decoder hooks
name them; plugins import them from here or from there alike.
"""

from __future__ import annotations

from dspark.types.blocks import BLOCK_TYPES, BlockPart, BlockWeight, Unpacked
from dspark.types.decoder import (
    FEATURES,
    CompiledDecoder,
    DecoderBid,
    DecoderSpec,
    DecoderWeights,
    LayerWeights,
    SeqBatch,
    SequenceDecoder,
    StepBatch,
    is_sequence,
)

__all__ = ["BLOCK_TYPES", "FEATURES", "BlockPart", "BlockWeight", "CompiledDecoder", "DecoderBid", "DecoderSpec",
           "DecoderWeights", "LayerWeights", "SeqBatch", "SequenceDecoder", "StepBatch", "Unpacked", "is_sequence"]
