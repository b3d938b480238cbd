"""Placement: collecting bids, partitioning, the placer (greedy and ILP), plans, the executor, adaptive runs and device profiles."""
