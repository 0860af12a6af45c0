"""``horovod.spark.common.store``: where Horovod's Spark estimators keep their data and checkpoints.

perseus does not implement the estimators, so it has no stores either: every class here raises
NotImplementedError when created (``Store.create`` too). With :func:`perseus.spark.run`, the training function
reads its data and writes its checkpoints itself.
"""

from perseus.spark._unsupported import NotImplementedInPerseus

__all__ = ["Store", "AbstractFilesystemStore", "FilesystemStore", "LocalStore", "HDFSStore", "DBFSLocalStore"]

_INSTEAD = ("stores serve the estimators only; with perseus.spark.run(fn, ...) your training function reads its "
            "data and writes its checkpoints itself (see docs/spark.md)")


class Store(NotImplementedInPerseus):
    """Not implemented: raises NotImplementedError."""

    _horovod = "horovod.spark.common.store.Store"
    _instead = _INSTEAD

    @classmethod
    def create(cls, *args, **kwargs):
        """Horovod's store factory: not implemented.

        Raises:
            NotImplementedError: always.
        """
        cls._refuse()


class AbstractFilesystemStore(Store):
    """Not implemented: raises NotImplementedError."""

    _horovod = "horovod.spark.common.store.AbstractFilesystemStore"


class FilesystemStore(AbstractFilesystemStore):
    """Not implemented: raises NotImplementedError."""

    _horovod = "horovod.spark.common.store.FilesystemStore"


class LocalStore(FilesystemStore):
    """Not implemented: raises NotImplementedError."""

    _horovod = "horovod.spark.common.store.LocalStore"


class HDFSStore(AbstractFilesystemStore):
    """Not implemented: raises NotImplementedError."""

    _horovod = "horovod.spark.common.store.HDFSStore"


class DBFSLocalStore(FilesystemStore):
    """Not implemented: raises NotImplementedError."""

    _horovod = "horovod.spark.common.store.DBFSLocalStore"
