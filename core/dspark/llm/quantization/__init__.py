"""Mixed-precision quantization of the LLM engine's models.

:mod:`.data` (calibration and held-out windows), :mod:`.evaluate`
(perplexity on the engine's forward), :mod:`.fake` (canonical rounding as
float ops), :mod:`.sensitivity` (measure and plan), :mod:`.apply` (kernels
through the plugins' ``dspark_quantize`` hook), :mod:`.convert` (optimized
model directories). ``quantization_config`` is validated by
:class:`dspark.llm.config.QuantizationConfig`; the plan, as data, is
:mod:`dspark.llm.runner.quant_plan` (the runner's loader reads by it).
"""

from __future__ import annotations

from dspark.llm.config import QuantizationConfig
from dspark.llm.runner.quant_plan import LayerPlan, QuantPlan

__all__ = ["LayerPlan", "QuantPlan", "QuantizationConfig"]
