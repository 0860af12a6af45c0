"""The autotune log: one CSV row per sample (rank 0), Horovod's columns first, then perseus's own.

``compression_policy`` is the sample's Espresso policy when the tuner searches it, else empty; likewise
``sparse_algorithm``, ``dear_threshold_bytes``, ``device_bucket_bytes`` and ``device_path``."""

from __future__ import annotations

import csv

from perseus.autotune.space import ALGORITHMS, DEVICE_PATHS, Config

__all__ = ["TuneLog", "COLUMNS"]

# Horovod's autotune log columns (as far as perseus has them), then perseus's.
COLUMNS = ("hierarchical_allreduce", "hierarchical_allgather", "cache_enabled", "cycle_time_ms",
           "tensor_fusion_threshold", "score", "sample", "step", "technique", "channels", "inplace_threshold",
           "algorithm", "seconds_per_step", "best_seconds_per_step", "step_bytes", "compression_policy",
           "sparse_algorithm", "dear_threshold_bytes", "device_bucket_bytes", "device_path")


class TuneLog:
    """Append-only CSV log; the header is written when the file is created."""

    def __init__(self, file: str):
        self._f = open(file, "w", newline="")
        self._w = csv.writer(self._f)
        self._w.writerow(COLUMNS)
        self._f.flush()

    def row(self, *, sample: int, step: int, technique: str, config: Config, cost: float, best_cost: float,
            steps, policy: bool = False, sparse: bool = False, dear: bool = False, device: bool = False,
            path: bool = False) -> None:
        """One sample; ``policy``, ``sparse``, ``dear``, ``device``, ``path``: the compressor policy, the sparse
        algorithm, DeAR's group size, the device buckets' budget, the GPU path is searched (write it, else leave
        the column empty)."""
        step_bytes = int(steps[-1][1]) if steps else 0
        self._w.writerow([int(config.algorithm == 3), 0, 1, config.cycle_time_us / 1000.0,
                          config.fusion_threshold_bytes, step_bytes / cost if cost > 0 else 0.0, sample, step,
                          technique, config.channels, config.inplace_threshold_bytes, ALGORITHMS[config.algorithm],
                          f"{cost:.6f}", f"{best_cost:.6f}", step_bytes,
                          config.policy_name if policy else "", config.sparse_name if sparse else "",
                          config.dear_bytes if dear else "", config.device_bucket_bytes if device else "",
                          DEVICE_PATHS[config.device_path] if path else ""])
        self._f.flush()

    def close(self) -> None:
        self._f.close()
