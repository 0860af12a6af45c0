"""Which of the tuned parameters keep their value: PERSEUS_AUTOTUNE_FIXED, read the same way on every rank.

:func:`tuned_fixed_params` turns the job's settings into the values the search leaves alone ('explicit', the
default: those the job set itself; 'none'; or a list of parameter names). Every rank computes it from the
same settings, so every rank's search space agrees. Raises ValueError for an unknown parameter name.
"""

from __future__ import annotations

from perseus.autotune.space import ALGORITHMS, DEAR, DEVICE, PATH, POLICY, SPARSE
from perseus.engine.settings import allreduce_algorithm

__all__ = ["tuned_fixed_params"]


def tuned_fixed_params(settings) -> dict:
    """The tuned parameters that keep their value (PERSEUS_AUTOTUNE_FIXED; by default those set explicitly).

    Raises ValueError for an unknown parameter name.
    """
    algorithm = allreduce_algorithm(settings)
    values = {  # parameter: (value, set explicitly)
        "fusion_threshold_bytes": (int(settings.fusion_threshold_bytes),
                                   settings.is_explicit("fusion_threshold_bytes")),
        "inplace_threshold_bytes": (int(settings.inplace_threshold_bytes),
                                    settings.is_explicit("inplace_threshold_bytes")),
        "channels": (int(settings.num_channels), settings.is_explicit("num_channels")),
        "cycle_time_us": (int(round(settings.cycle_time_ms * 1000)), settings.is_explicit("cycle_time_ms")),
        "algorithm": (ALGORITHMS.index(algorithm),
                      settings.is_explicit("allreduce_algorithm") or settings.hierarchical_allreduce),
        # -1: the policy the compressor has when the search starts (set_policy() is the explicit setting)
        POLICY: (-1, False),
        # -1: likewise the sparse algorithm in force when the search starts (perseus.sparse.set_policy())
        SPARSE: (-1, False),
        # -1: DeAR's group size in force (PERSEUS_DEAR_THRESHOLD_BYTES set explicitly keeps it)
        DEAR: (-1, settings.is_explicit("dear_threshold_bytes")),
        # -1: the device buckets' budget in force (PERSEUS_DEVICE_BUCKET_BYTES set explicitly keeps it)
        DEVICE: (-1, settings.is_explicit("device_bucket_bytes")),
        # -1: the GPU path in force (PERSEUS_DEVICE_BACKEND set explicitly keeps it)
        PATH: (-1, settings.is_explicit("device_backend")),
    }
    choice = settings.autotune_fixed.strip().lower()
    if choice == "explicit":
        return {name: v for name, (v, explicit) in values.items() if explicit}
    if choice in ("none", ""):
        return {}
    names = [n.strip() for n in choice.split(",") if n.strip()]
    unknown = [n for n in names if n not in values]
    if unknown:
        raise ValueError(f"PERSEUS_AUTOTUNE_FIXED names unknown parameters {', '.join(unknown)}; use 'explicit', "
                         f"'none' or some of {', '.join(values)}")
    return {name: values[name][0] for name in names}
