"""What the tuner remembers between runs: the best setting per job, in one small JSON file.

A job is keyed by its gradient signature (a digest of every name, op, dtype and shape of a training step)
and its topology (ranks, ranks per host, hosts). A later run with the same key applies the stored setting
at once, without searching. A run with the same topology and no exact match starts its search from the
setting of the job whose step moved the closest number of bytes (within a factor of 2): similar models
tend to want similar units and channels.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from typing import Optional

from perseus.autotune.space import Config
from perseus.base.knobs import external

__all__ = ["Known", "path", "lookup", "store"]

_FILE = "autotune.json"


@dataclasses.dataclass(frozen=True)
class Known:
    config: Config
    exact: bool  # same gradient signature and topology


def path(settings) -> str:
    """The cache file: PERSEUS_CACHE_DIR, else $XDG_CACHE_HOME/perseus, else ~/.cache/perseus."""
    base = settings.cache_dir or os.path.join(
        external("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "perseus")
    return os.path.join(base, _FILE)


def _key(digest: int, topology: tuple) -> str:
    return f"{digest:016x}@" + "x".join(str(int(v)) for v in topology)


def _load(file: str) -> dict:
    try:
        with open(file) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or damaged: start afresh (store() rewrites it whole)


def lookup(file: str, digest: int, topology: tuple, step_bytes: int) -> Optional[Known]:
    """The stored setting for this job, or the closest similar one, or None."""
    data = _load(file)
    key = _key(digest, topology)
    try:
        if key in data:
            return Known(Config(**data[key]["config"]), True)
        suffix = key.split("@", 1)[1]
        best, best_distance = None, math.log(2.0)
        for k, entry in data.items():
            if k.split("@", 1)[-1] != suffix or step_bytes <= 0 or entry.get("step_bytes", 0) <= 0:
                continue
            distance = abs(math.log(entry["step_bytes"] / step_bytes))
            if distance <= best_distance:
                best, best_distance = entry, distance
        return Known(Config(**best["config"]), False) if best is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def store(file: str, digest: int, topology: tuple, step_bytes: int, config: Config, cost: float) -> None:
    """Remember config for this job (atomically: a concurrent reader sees the old or the new file)."""
    data = _load(file)
    data[_key(digest, topology)] = {"config": config.as_dict(), "step_bytes": int(step_bytes),
                                    "seconds_per_step": float(cost), "time": time.time()}
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), prefix=".autotune-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, file)
    except OSError:
        pass  # a read-only home: the run is tuned, only not remembered
