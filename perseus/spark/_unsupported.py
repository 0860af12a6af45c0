"""The base of the Horovod Spark classes perseus does not implement (the estimators and their stores)."""

from __future__ import annotations

from typing import NoReturn

__all__ = ["NotImplementedInPerseus"]


class NotImplementedInPerseus:
    """Raises NotImplementedError on construction (and from ``load``), naming the Horovod class and what to
    use instead. Subclasses set ``_horovod`` (the Horovod name) and ``_instead`` (what to do in perseus)."""

    _horovod = "horovod.spark"
    _instead = ("train with perseus.spark.run(fn, ...), where fn is your own training function (it calls "
                "hvd.init() and reads its data itself); see docs/spark.md")

    @classmethod
    def _refuse(cls) -> NoReturn:
        raise NotImplementedError(f"{cls._horovod}: perseus does not implement Horovod's Spark estimators; "
                                  f"{cls._instead}")

    def __init__(self, *args, **kwargs):
        type(self)._refuse()

    @classmethod
    def load(cls, *args, **kwargs):
        """Horovod's reader of saved estimators and models: not implemented either.

        Raises:
            NotImplementedError: always.
        """
        cls._refuse()
