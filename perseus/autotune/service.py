"""The run-time tuner as a service of the runtime (:class:`perseus.runtime.state.Service`).

:mod:`perseus.lifecycle` hands :class:`TunerService` to the runtime's start-up; the runtime calls its hooks
at the start-up phases and stops the tuner at shutdown. Under ``HOROVOD_AUTOTUNE``/``PERSEUS_AUTOTUNE`` in a
job of more than one rank every rank runs one :class:`~perseus.autotune.tuner.Tuner` thread; otherwise the
service runs nothing.
"""

from __future__ import annotations

from perseus.autotune import techniques
from perseus.autotune.tuner import Tuner

__all__ = ["TunerService", "make_tuner", "AUTOTUNE_MAX_CHANNELS"]

#: channels each process set creates under the tuner (idle until a TUNE request activates them)
AUTOTUNE_MAX_CHANNELS = 8


def make_tuner(engine, settings, topology) -> Tuner:
    """This rank's run-time tuner (every rank of the job runs one), not started yet."""
    return Tuner(engine, settings, rank=topology.rank, size=topology.size,
                 topology=(topology.size, topology.local_size, topology.cross_size),
                 multi_host=topology.cross_size > 1 and topology.homogeneous and topology.local_size > 1)


class TunerService:
    """Starts and stops the run-time tuner with the runtime."""

    name = "tuner"

    def configure(self, settings, size: int) -> None:
        """Start-up, first local phase. Raises ImportError (on every rank, through the runtime's vote) when
        autotuning is asked for and Optuna is missing; gives the engine its spare channels."""
        if settings.autotune and size > 1:
            techniques._optuna()
        if settings.autotune and not settings.max_channels:
            settings.max_channels = AUTOTUNE_MAX_CHANNELS

    def prepare(self, engine, settings, topology):
        """Start-up, second local phase: the tuner to start, or None when this job is not tuned."""
        if not (settings.autotune and topology.size > 1):
            return None
        return make_tuner(engine, settings, topology)
