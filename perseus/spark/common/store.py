"""``horovod.spark.common.store``: where the Spark estimators keep their prepared data, checkpoints and logs.

A store is a directory (``prefix_path``) on some file system, laid out as Horovod lays it out::

    <prefix_path>/intermediate_train_data.<idx>/   Parquet written by prepare_data (idx: the dataset index)
    <prefix_path>/intermediate_val_data.<idx>/     the validation split, when there is one
    <prefix_path>/intermediate_test_data.<idx>/
    <prefix_path>/runs/<run_id>/checkpoint         the run's checkpoint (checkpoint_filename= to rename)
    <prefix_path>/runs/<run_id>/logs/

:meth:`Store.create` picks the class from the path: ``hdfs://...`` -> :class:`HDFSStore`; on Databricks
``dbfs:/...`` or ``/dbfs/...`` -> :class:`DBFSLocalStore`; a plain path or ``file://`` -> :class:`LocalStore`;
any other URL -> :class:`FilesystemStore` (any fsspec protocol). File systems are fsspec's and are made on first
use, so a store constructs anywhere (an HDFSStore without Hadoop too) and pickles without its connection;
:meth:`Store.to_remote` gives a rank the paths and a way to open the same file system.
"""

from __future__ import annotations

import functools
import operator
import os
import re
import uuid
from typing import Any, Callable, Optional

from perseus.spark.common._store_io import RemoteStore, FilesystemFactory, require_fsspec, LocalOutputDir, SyncToStore
from perseus.spark.common.util import is_databricks

__all__ = ["Store", "AbstractFilesystemStore", "FilesystemStore", "LocalStore", "HDFSStore", "DBFSLocalStore",
           "RemoteStore"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
# Tests point /dbfs/... at a local folder with this (Horovod's hook of the same name): None means /dbfs itself.
_DBFS_PREFIX_MAPPING: Optional[str] = None


def _split_protocol(path: str) -> tuple[Optional[str], str]:
    """``("s3", "bucket/key")`` for ``s3://bucket/key``; ``(None, path)`` for a path without a protocol."""
    m = _URL.match(path)
    return (m.group(1), m.group(2)) if m else (None, path)


class Store:
    """Where the estimators keep intermediate data (the prepared Parquet) and training artifacts (checkpoints,
    logs). Every run gets a directory of its own; every prepared dataset gets an index of its own, and the
    datasets stay until removed, so that later fits on the same DataFrame reuse them."""

    def is_parquet_dataset(self, path) -> bool:
        """True when ``path`` holds a Parquet dataset."""
        raise NotImplementedError()

    def get_parquet_dataset(self, path):
        """The ``pyarrow.parquet.ParquetDataset`` at ``path``."""
        raise NotImplementedError()

    def get_train_data_path(self, idx=None) -> str:
        """Where dataset ``idx``'s training split is (the bare name without idx)."""
        raise NotImplementedError()

    def get_val_data_path(self, idx=None) -> str:
        """Where dataset ``idx``'s validation split is."""
        raise NotImplementedError()

    def get_test_data_path(self, idx=None) -> str:
        """Where dataset ``idx``'s test data is."""
        raise NotImplementedError()

    def saving_runs(self) -> bool:
        """True when runs keep their checkpoints and logs in the store."""
        raise NotImplementedError()

    def get_runs_path(self) -> str:
        """The directory of all runs."""
        raise NotImplementedError()

    def get_run_path(self, run_id) -> str:
        """The directory of run ``run_id``."""
        raise NotImplementedError()

    def get_checkpoint_path(self, run_id) -> Optional[str]:
        """Where run ``run_id`` keeps its checkpoint (None when runs are not saved)."""
        raise NotImplementedError()

    def get_checkpoints(self, run_id, suffix=".ckpt") -> list:
        """The run's checkpoint files whose names end with ``suffix``, sorted."""
        raise NotImplementedError()

    def get_logs_path(self, run_id) -> Optional[str]:
        """The run's log directory (None when runs are not saved)."""
        raise NotImplementedError()

    def get_checkpoint_filename(self) -> str:
        """The name of a run's checkpoint file."""
        raise NotImplementedError()

    def get_logs_subdir(self) -> str:
        """The name of a run's log directory."""
        raise NotImplementedError()

    def exists(self, path) -> bool:
        """True when ``path`` exists in the store."""
        raise NotImplementedError()

    def read(self, path) -> bytes:
        """The contents of the file ``path``."""
        raise NotImplementedError()

    def write_text(self, path, text) -> None:
        """Write ``text`` to the file ``path`` (making its directory)."""
        raise NotImplementedError()

    def get_local_output_dir_fn(self, run_id) -> Callable:
        """A function giving a context manager of a local directory for the run's output."""
        raise NotImplementedError()

    def sync_fn(self, run_id) -> Callable[[str], None]:
        """A function copying a local directory into the run's directory."""
        raise NotImplementedError()

    def to_remote(self, run_id, dataset_idx) -> RemoteStore:
        """The picklable view of this store a rank uses for the run ``run_id`` on dataset ``dataset_idx``."""
        return RemoteStore(self, self._remote_attrs(run_id, dataset_idx))

    def _remote_attrs(self, run_id, dataset_idx) -> dict:
        return {
            "train_data_path": self.get_train_data_path(dataset_idx),
            "val_data_path": self.get_val_data_path(dataset_idx),
            "test_data_path": self.get_test_data_path(dataset_idx),
            "saving_runs": self.saving_runs(),
            "runs_path": self.get_runs_path(),
            "run_path": self.get_run_path(run_id),
            "checkpoint_path": self.get_checkpoint_path(run_id),
            "logs_path": self.get_logs_path(run_id),
            "checkpoint_filename": self.get_checkpoint_filename(),
            "logs_subdir": self.get_logs_subdir(),
            "get_local_output_dir": self.get_local_output_dir_fn(run_id),
            "sync": self.sync_fn(run_id),
            "prefix_path": getattr(self, "prefix_path", None),
            "storage_options": getattr(self, "storage_options", None),
        }

    @staticmethod
    def create(prefix_path, *args, **kwargs) -> "Store":
        """The store for ``prefix_path``: HDFSStore for ``hdfs://``; DBFSLocalStore for ``dbfs:/``, ``/dbfs/``
        (or ``file:/dbfs/``) on Databricks; LocalStore for a plain path or ``file://``; FilesystemStore for any
        other URL. Other arguments go to the class. Raises what the class's constructor raises."""
        if HDFSStore.matches(prefix_path):
            return HDFSStore(prefix_path, *args, **kwargs)
        if is_databricks() and DBFSLocalStore.matches_dbfs(prefix_path):
            return DBFSLocalStore(prefix_path, *args, **kwargs)
        if LocalStore.matches(prefix_path):
            return LocalStore(prefix_path, *args, **kwargs)
        return FilesystemStore(prefix_path, *args, **kwargs)


class AbstractFilesystemStore(Store):
    """A store on a file system: the layout above, the file operations through ``self.fs`` (fsspec), made on
    first use by ``_get_filesystem_fn()``. Subclasses say how paths map (``get_full_path``,
    ``get_localized_path``) and which file system to make."""

    def __init__(self, prefix_path, train_path=None, val_path=None, test_path=None, runs_path=None, save_runs=True,
                 storage_options=None, checkpoint_filename=None, **kwargs):
        self.storage_options = dict(storage_options or {})
        self._fs = None
        self.prefix_path = self.get_full_path(prefix_path).rstrip("/")
        self._train_path = self._full_or_default(train_path, "intermediate_train_data")
        self._val_path = self._full_or_default(val_path, "intermediate_val_data")
        self._test_path = self._full_or_default(test_path, "intermediate_test_data")
        self._runs_path = self._full_or_default(runs_path, "runs")
        self._save_runs = save_runs
        self.checkpoint_filename = checkpoint_filename or "checkpoint"

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fs"] = None  # a connection does not travel: the other side opens its own
        return state

    def _full_or_default(self, path, name):
        return self.get_full_path(path).rstrip("/") if path is not None else f"{self.prefix_path}/{name}"

    # -- the file system -------------------------------------------------------------------------------------
    @property
    def fs(self):
        """The fsspec file system, opened on first use. Raises OSError (with what to fix) if it cannot be."""
        if self._fs is None:
            self._fs = self._get_filesystem_fn()()
        return self._fs

    def get_filesystem(self):
        return self.fs

    def _get_filesystem_fn(self) -> Callable[[], Any]:
        raise NotImplementedError()

    def get_localized_path(self, path) -> str:
        raise NotImplementedError()

    def get_full_path(self, path) -> str:
        raise NotImplementedError()

    def get_full_path_fn(self) -> Callable[[str], str]:
        raise NotImplementedError()

    # -- files -----------------------------------------------------------------------------------------------
    def exists(self, path) -> bool:
        return self.fs.exists(self.get_localized_path(path))

    def read(self, path) -> bytes:
        with self.fs.open(self.get_localized_path(path), "rb") as f:
            return f.read()

    def write_text(self, path, text) -> None:
        local = self.get_localized_path(path)
        parent = local.rsplit("/", 1)[0]
        if parent and parent != local:
            self.fs.makedirs(parent, exist_ok=True)
        with self.fs.open(local, "w") as f:
            f.write(text)

    def check_writable(self, path=None) -> None:
        """Write and remove a small file under ``path`` (default ``prefix_path``), making the directory.

        Raises:
            OSError: the path cannot be written, naming it and the file system's own reason.
        """
        path = self.prefix_path if path is None else self.get_full_path(path)
        local = self.get_localized_path(path).rstrip("/")
        probe = f"{local}/.perseus-write-check-{uuid.uuid4().hex}"
        try:
            fs = self.fs
            fs.makedirs(local, exist_ok=True)
            with fs.open(probe, "wb") as f:
                f.write(b"ok")
            fs.rm(probe)
        except OSError as e:
            raise OSError(f"the store path {path} cannot be written ({type(e).__name__}: {e}); give the "
                          f"estimator a store whose prefix_path is a directory this process can write") from e

    def list_parquet_files(self, path) -> list:
        """The Parquet files of the dataset directory ``path`` (localized, sorted); hidden (``_``/``.``) and
        other files are left out. [] when the directory does not exist."""
        local = self.get_localized_path(path).rstrip("/")
        if not self.fs.isdir(local):
            return []
        names = self.fs.find(local)
        return sorted(n for n in names if n.endswith(".parquet") and not
                      any(part.startswith(("_", ".")) for part in n[len(local):].split("/") if part))

    def is_parquet_dataset(self, path) -> bool:
        """True when ``path`` is a directory holding at least one Parquet file."""
        try:
            return bool(self.list_parquet_files(path))
        except (OSError, ValueError):
            return False

    def get_parquet_dataset(self, path):
        """``pyarrow.parquet.ParquetDataset`` of ``path`` on the store's file system."""
        import pyarrow.parquet as pq
        return pq.ParquetDataset(self.get_localized_path(path), filesystem=self.fs)

    # -- the layout ------------------------------------------------------------------------------------------
    def get_train_data_path(self, idx=None) -> str:
        return f"{self._train_path}.{idx}" if idx is not None else self._train_path

    def get_val_data_path(self, idx=None) -> str:
        return f"{self._val_path}.{idx}" if idx is not None else self._val_path

    def get_test_data_path(self, idx=None) -> str:
        return f"{self._test_path}.{idx}" if idx is not None else self._test_path

    def saving_runs(self) -> bool:
        return self._save_runs

    def get_runs_path(self) -> str:
        return self._runs_path

    def get_run_path(self, run_id) -> str:
        return f"{self._runs_path}/{run_id}"

    def get_checkpoint_path(self, run_id) -> Optional[str]:
        """The run's directory, where its checkpoint file is written (None when runs are not saved)."""
        return self.get_run_path(run_id) if self._save_runs else None

    def get_checkpoints(self, run_id, suffix=".ckpt") -> list:
        """The files of the run's checkpoint directory whose names end with ``suffix``, sorted (localized
        paths); [] when runs are not saved or the directory does not exist."""
        path = self.get_checkpoint_path(run_id)
        if path is None:
            return []
        local = self.get_localized_path(path)
        if not self.fs.isdir(local):
            return []
        return sorted(n for n in self.fs.ls(local, detail=False) if n.endswith(suffix))

    def get_logs_path(self, run_id) -> Optional[str]:
        return f"{self.get_run_path(run_id)}/{self.get_logs_subdir()}" if self._save_runs else None

    def get_checkpoint_filename(self) -> str:
        return self.checkpoint_filename

    def get_logs_subdir(self) -> str:
        return "logs"

    def get_local_output_dir_fn(self, run_id) -> Callable:
        return LocalOutputDir()

    def sync_fn(self, run_id) -> Callable[[str], None]:
        return SyncToStore(self, self.get_run_path(run_id))


class FilesystemStore(AbstractFilesystemStore):
    """A store on any fsspec file system, chosen by the path's protocol (``s3://``, ``gs://``, ``file://``...;
    a plain path is local). ``storage_options`` go to the file system (credentials, endpoints)."""

    def __init__(self, prefix_path, *args, **kwargs):
        super().__init__(prefix_path, *args, **kwargs)
        self.protocol = _split_protocol(self.prefix_path)[0] or "file"

    def _get_filesystem_fn(self):
        options = {}
        if self.protocol != "file":
            cls = require_fsspec().get_filesystem_class(self.protocol)
            options.update(cls._get_kwargs_from_urls(self.prefix_path))
        options.update(self.storage_options)
        return FilesystemFactory(self.protocol, options, f"{type(self).__name__}({self.prefix_path})")

    def get_localized_path(self, path) -> str:
        protocol, rest = _split_protocol(path)
        return rest if protocol else path

    def get_full_path(self, path) -> str:
        return self.get_full_path_fn()(path)

    def get_full_path_fn(self):
        return _full_local_or_url

    @classmethod
    def matches(cls, path) -> bool:
        return True


def _full_local_or_url(path: str) -> str:
    """A URL stays; a plain path becomes ``file:///absolute/path``."""
    if _split_protocol(path)[0] is not None:
        return path
    return "file://" + os.path.abspath(path)


class LocalStore(FilesystemStore):
    """A store on this machine's file system (or a shared mount every executor sees at the same path).

    Raises:
        ValueError: ``prefix_path`` is a URL of another file system (use FilesystemStore or Store.create).
    """

    def __init__(self, prefix_path, *args, **kwargs):
        if not self.matches(prefix_path):
            raise ValueError(f"LocalStore({prefix_path!r}): not a local path; use FilesystemStore or Store.create "
                             "for other file systems")
        super().__init__(prefix_path, *args, **kwargs)

    @classmethod
    def matches(cls, path) -> bool:
        return _split_protocol(path)[0] in (None, "file")


class HDFSStore(AbstractFilesystemStore):
    """A store on HDFS, through pyarrow's HadoopFileSystem (fsspec's ``hdfs`` protocol).

    ``prefix_path``: ``hdfs://namenode:8020/path``, ``hdfs:///path`` or ``/path``. Host and port come from the
    arguments, else the URL, else ``default`` and 0 (Hadoop's configuration). ``user``, ``kerb_ticket`` and
    ``extra_conf`` go to the client; ``driver`` is accepted for Horovod's signature (pyarrow has only libhdfs).
    The connection is made on first use: constructing needs no Hadoop.

    Raises:
        ValueError: the URL is of another file system, or has no path.
        OSError (on first use of the file system): no Hadoop client here, with what to set up.
    """

    FS_PREFIX = "hdfs://"
    URL_PATTERN = r"^(?:([A-Za-z][A-Za-z0-9+.-]*)://)?([^/:]+)?(?::([0-9]+))?(/.*)?$"
    _HINT = ("pyarrow's HDFS client needs Hadoop's libhdfs and a Java runtime on this machine: set JAVA_HOME, "
             "HADOOP_HOME (ARROW_LIBHDFS_DIR when libhdfs.so is elsewhere) and CLASSPATH=$(hadoop classpath --glob)"
             " on the driver and every executor")

    def __init__(self, prefix_path, host=None, port=None, user=None, kerb_ticket=None, driver="libhdfs",
                 extra_conf=None, *args, **kwargs):
        protocol, url_host, url_port, path = self.parse_url(prefix_path)
        if protocol is not None and protocol != "hdfs":
            raise ValueError(f"HDFSStore({prefix_path!r}): a {protocol}:// URL; HDFSStore takes hdfs:// URLs or "
                             "plain paths (use Store.create to choose the store by the URL)")
        if not path:
            raise ValueError(f"HDFSStore({prefix_path!r}): no path in the URL")
        self._url_prefix = (self.FS_PREFIX + (url_host or "") + (f":{url_port}" if url_port else "")
                            if protocol else self.FS_PREFIX)
        self._hdfs_kwargs = dict(host=host or url_host or "default", port=int(port or url_port or 0), user=user,
                                 kerb_ticket=kerb_ticket, extra_conf=extra_conf)
        self.driver = driver
        super().__init__(prefix_path, *args, **kwargs)

    def parse_url(self, url) -> tuple:
        """``(protocol, host, port, path)`` of ``url``; each None when absent."""
        m = re.match(self.URL_PATTERN, url)
        if not m:
            raise ValueError(f"HDFSStore: cannot parse the URL {url!r}")
        protocol, host, port, path = m.groups()
        if protocol is None and host is not None:  # "relative/path": no host without a protocol
            return None, None, None, url
        return protocol, host, int(port) if port else None, path

    def get_full_path(self, path) -> str:
        return path if self.matches(path) else self._url_prefix + path

    def get_full_path_fn(self):
        return functools.partial(operator.add, self._url_prefix)

    def get_localized_path(self, path) -> str:
        if not self.matches(path):
            return path
        rest = path[len(self.FS_PREFIX):]
        slash = rest.find("/")
        return rest[slash:] if slash >= 0 else "/"

    def _get_filesystem_fn(self):
        options = {k: v for k, v in self._hdfs_kwargs.items() if v is not None}
        options.update(self.storage_options)
        return FilesystemFactory("hdfs", options, f"HDFSStore({self.prefix_path})", self._HINT)

    @classmethod
    def matches(cls, path) -> bool:
        return path.startswith(cls.FS_PREFIX)


class DBFSLocalStore(FilesystemStore):
    """A store on Databricks' DBFS through its local mount (``/dbfs/...``). ``prefix_path``: ``/dbfs/...``,
    ``dbfs:/...``, ``file:/dbfs/...`` or ``file:///dbfs/...``. Checkpoints are named ``checkpoint.tf`` unless
    ``checkpoint_filename`` says otherwise.

    Raises:
        ValueError: the path is not a DBFS path.
    """

    DBFS_PATH_FORMAT_ERROR = ("not a DBFS path: {}; give a path starting with /dbfs/, dbfs:/, file:/dbfs/ or "
                              "file:///dbfs/")

    def __init__(self, prefix_path, *args, **kwargs):
        kwargs.setdefault("checkpoint_filename", "checkpoint.tf")
        super().__init__(self.normalize_path(prefix_path), *args, **kwargs)
        self.protocol = "file"

    @classmethod
    def matches_dbfs(cls, path) -> bool:
        return ((path.startswith("dbfs:/") and not path.startswith("dbfs://")) or path.startswith("/dbfs/")
                or path.startswith("file:///dbfs/") or path.startswith("file:/dbfs/"))

    @staticmethod
    def normalize_path(path) -> str:
        """The ``/dbfs/...`` form of a DBFS path. Raises ValueError for any other path."""
        if path.startswith("dbfs:/") and not path.startswith("dbfs://"):
            return "/dbfs" + path[len("dbfs:"):]
        if path.startswith("/dbfs/"):
            return path
        if path.startswith("file:///dbfs/"):
            return path[len("file://"):]
        if path.startswith("file:/dbfs/"):
            return path[len("file:"):]
        raise ValueError(DBFSLocalStore.DBFS_PATH_FORMAT_ERROR.format(path))

    def get_localized_path(self, path) -> str:
        local = self.normalize_path(path)
        if _DBFS_PREFIX_MAPPING:
            return os.path.join(_DBFS_PREFIX_MAPPING, local[len("/dbfs/"):])
        return local

    def get_full_path(self, path) -> str:
        return "file://" + self.normalize_path(path)

    def get_full_path_fn(self):
        return self.get_full_path

    def _get_filesystem_fn(self):
        return FilesystemFactory("file", dict(self.storage_options), f"DBFSLocalStore({self.prefix_path})")

