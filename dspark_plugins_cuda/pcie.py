"""PCIe link bandwidth from the link generation and width NVML reports."""

from __future__ import annotations

# Usable bytes/s per lane per direction, after line coding (8b/10b for gen1-2,
# 128b/130b for gen3-5, FLIT/PAM4 for gen6), in GB/s (1e9 bytes).
PER_LANE_GB_S: dict[int, float] = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def link_bandwidth_bytes_per_s(generation: int | None, width: int | None) -> float | None:
    """One-direction bandwidth of a PCIe link in bytes/s; None when unknown.

    An unknown generation gives None rather than a guess: a wrong host-link
    figure would mislead the placer's transfer costs.
    """
    if not generation or not width or generation not in PER_LANE_GB_S or width <= 0:
        return None
    return PER_LANE_GB_S[generation] * 1e9 * width
