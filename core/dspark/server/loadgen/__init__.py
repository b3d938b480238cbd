"""The load generator behind ``dspark bench serve``: requests, statistics, sweeps and reports (no server code)."""
