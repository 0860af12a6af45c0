"""Placement groups for Ray workers (Horovod's ``horovod.ray.strategy.create_placement_group``).

:class:`perseus.ray.RayExecutor` places its workers itself (perseus.ray.settings); this module gives Horovod's
helper for code that builds a placement group of its own.
"""

from __future__ import annotations

from typing import Dict

__all__ = ["create_placement_group"]


def create_placement_group(resources_per_bundle: Dict[str, float], num_bundles: int, pg_timeout: float,
                           pg_strategy: str):
    """``(placement group, bundles)``: ``num_bundles`` bundles of ``resources_per_bundle`` each, placed with
    ``pg_strategy`` (``PACK``, ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``), once Ray has placed them.

    Raises:
        TimeoutError: not placed within ``pg_timeout`` seconds; the message gives what the cluster has free and
            what was asked (the group is removed again).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [dict(resources_per_bundle) for _ in range(int(num_bundles))]
    pg = placement_group(bundles, strategy=pg_strategy)
    ready, _ = ray.wait([pg.ready()], timeout=pg_timeout)
    if not ready:
        remove_placement_group(pg)
        raise TimeoutError(f"perseus.ray: the placement group ({num_bundles} x {resources_per_bundle}, "
                           f"{pg_strategy}) was not placed within {pg_timeout} s; the cluster has "
                           f"{ray.available_resources()} free")
    return pg, bundles
