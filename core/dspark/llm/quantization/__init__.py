"""Mixed-precision quantization of the LLM engine's models.

:mod:`.config` (``quantization_config``), :mod:`.data` (calibration and
held-out windows), :mod:`.evaluate` (perplexity on the engine's forward),
:mod:`.fake` (canonical rounding as float ops), :mod:`.sensitivity`
(measure and plan), :mod:`.plan` (the plan as data), :mod:`.apply` (kernels
through the plugins' ``dspark_quantize`` hook), :mod:`.convert` (optimized
model directories).
"""

from __future__ import annotations

from dspark.llm.quantization.config import QuantizationConfig
from dspark.llm.quantization.plan import LayerPlan, QuantPlan

__all__ = ["LayerPlan", "QuantPlan", "QuantizationConfig"]
