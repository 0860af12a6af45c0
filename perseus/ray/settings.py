"""The settings object of :class:`~perseus.ray.RayExecutor` and :class:`~perseus.ray.ElasticRayExecutor`
(``create_settings``), and how workers are placed on the cluster (placement groups)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

__all__ = ["Settings", "make_settings", "place", "connect"]


@dataclasses.dataclass
class Settings:
    """What ``create_settings`` returns (Horovod's ``MiniSettings`` / ``ElasticSettings``).

    ``timeout_s``: seconds for the ranks to start and connect; ``placement_group_timeout_s``: seconds for Ray
    to place the workers; ``nics``: network interfaces for MPI and perseus's channels; ``verbose``: print the
    ``mpirun`` command and progress. Elastic jobs also use ``min_np``, ``max_np``, ``reset_limit``,
    ``cooldown_range``, ``elastic_timeout`` and ``discovery`` (an object with ``find_available_hosts_and_slots()``,
    e.g. :class:`~perseus.ray.elastic.RayHostDiscovery`). ``ssh_identity_file``/``ssh_str`` are accepted for
    compatibility: no ssh is used (ranks start through the actors).
    """

    timeout_s: float = 30
    ssh_identity_file: Optional[str] = None
    ssh_str: Optional[str] = None
    placement_group_timeout_s: float = 100
    nics: Optional[Any] = None
    verbose: int = 0
    elastic: bool = False
    min_np: Optional[int] = None
    max_np: Optional[int] = None
    reset_limit: Optional[int] = None
    cooldown_range: Optional[tuple] = None
    elastic_timeout: float = 600
    discovery: Optional[Any] = None

    @property
    def start_timeout(self) -> float:
        return float(self.timeout_s)

    def nic_list(self) -> list[str]:
        """The network interfaces as a list ([] when none were named)."""
        if not self.nics:
            return []
        if isinstance(self.nics, str):
            return [n for n in self.nics.split(",") if n]
        return sorted(str(n) for n in self.nics)


def make_settings(ssh_identity_file: Optional[str] = None, ssh_str: Optional[str] = None, **fields) -> Settings:
    """A :class:`Settings`; ``ssh_str`` (a private key) is written to ``ssh_identity_file`` as Horovod does.

    Raises:
        ValueError: ``ssh_str`` without ``ssh_identity_file``.
    """
    if ssh_str:
        if not ssh_identity_file:
            raise ValueError("create_settings: ssh_str needs ssh_identity_file, the file to write the key to")
        if not os.path.exists(ssh_identity_file):
            fd = os.open(ssh_identity_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(ssh_str)
    return Settings(ssh_identity_file=ssh_identity_file, ssh_str=ssh_str, **fields)


def connect():
    """Return the ``ray`` module, connected (``ray.init()`` when it is not initialized).

    Raises:
        ImportError: Ray is not installed (the message says how to install it).
    """
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"perseus.ray needs Ray: pip install 'perseus[ray]' (or pip install ray) ({exc})") from None
    if not ray.is_initialized():
        ray.init()
    return ray


def _resources_text() -> str:
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    keys = [k for k in ("CPU", "GPU") if k in total]
    return ", ".join(f"{k}: {free.get(k, 0):g} free of {total.get(k, 0):g}" for k in keys) or "no CPU or GPU"


def place(num_workers: Optional[int], num_hosts: Optional[int], per_host: int, cpus: float, gpus: float,
          timeout_s: float):
    """Reserve the workers' resources; returns ``(placement_group, bundle index of each worker)``.

    ``num_workers``: that many bundles of ``cpus``/``gpus``, packed onto as few nodes as possible (PACK).
    ``num_hosts``: one bundle of ``per_host`` workers per node, each on a different node (STRICT_SPREAD).

    Raises:
        TimeoutError: Ray could not place them within ``timeout_s`` seconds; the message says what was asked,
            what the cluster has free and what to change.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    def bundle(n: int) -> dict:
        b = {"CPU": float(cpus) * n}
        if gpus:
            b["GPU"] = float(gpus) * n
        return b

    if num_hosts:
        pg = placement_group([bundle(per_host)] * num_hosts, strategy="STRICT_SPREAD")
        indexes = [h for h in range(num_hosts) for _ in range(per_host)]
        asked = f"{num_hosts} node(s) with {per_host} worker(s) each"
    else:
        pg = placement_group([bundle(1)] * num_workers, strategy="PACK")
        indexes = list(range(num_workers))
        asked = f"{num_workers} worker(s)"
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise TimeoutError(
            f"perseus.ray: Ray could not place {asked} ({cpus:g} CPU{f', {gpus:g} GPU' if gpus else ''} per worker) "
            f"within placement_group_timeout_s={timeout_s:g} s; the cluster has {_resources_text()}. Lower "
            f"num_workers or the resources per worker, add nodes, or raise placement_group_timeout_s") from None
    return pg, indexes
