"""Values a rank sends to the driver's callbacks (Horovod's ``horovod.ray.ray_logger``).

Inside a function that :class:`~perseus.ray.RayExecutor` runs, ``ray_logger.log({"loss": ...})`` sends the dict
to the rank's actor; the values rank 0 logs reach the ``callbacks`` given to ``run``/``execute`` on the driver
while the function runs. Under :class:`~perseus.ray.ElasticRayExecutor` every rank's values reach them, as
Horovod's elastic executor forwards every worker's. Elsewhere (a plain script) the call warns once and does nothing.
"""

from __future__ import annotations

import warnings

from perseus.runner.remote import rank as _rank

__all__ = ["log"]

_warned = False


def log(info_dict) -> None:
    """Send ``info_dict`` (picklable) to the driver's callbacks; a no-op, with one warning, outside a rank."""
    global _warned
    if not _rank.log(info_dict) and not _warned:
        warnings.warn("perseus.ray.ray_logger.log called outside a RayExecutor rank: nothing is sent", stacklevel=2)
        _warned = True
