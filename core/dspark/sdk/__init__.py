"""The plugin SDK: what plugin authors use besides the hookspecs, types and graph.

Calibrated estimates (:mod:`.calibration`), roofline and timing (:mod:`.cost`),
reference quantization layouts (:mod:`.quant`), the disk cache and host facts.
"""

from __future__ import annotations

from dspark.host import cache, hostinfo
from dspark.sdk import calibration, cost, quant

__all__ = ["cache", "calibration", "cost", "hostinfo", "quant"]
