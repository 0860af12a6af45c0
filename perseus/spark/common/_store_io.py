"""The parts of a store that travel to the ranks: the file system factory, the local output directory, the
copy of a run's files into the store, and :class:`RemoteStore` (what ``Store.to_remote`` gives a rank). All
picklable; fsspec is imported when a file system is first opened."""

from __future__ import annotations

import os
import tempfile
from typing import Any

__all__ = ["RemoteStore", "FilesystemFactory", "LocalOutputDir", "SyncToStore", "require_fsspec"]

_NEED = "the Spark estimators' stores need fsspec (and pyarrow for Parquet and HDFS): pip install 'perseus[spark]'"


def require_fsspec():
    """The fsspec module. Raises ImportError saying how to install it."""
    try:
        import fsspec
    except ImportError as e:
        raise ImportError(_NEED) from e
    return fsspec


class FilesystemFactory:
    """Makes the fsspec file system of a store (picklable: a rank makes its own from it).

    Raises (when called): OSError naming ``what`` and ``hint`` when the file system cannot be opened (for HDFS:
    no Hadoop client), ImportError when fsspec or the protocol's package is missing.
    """

    def __init__(self, protocol: str, options: dict, what: str, hint: str = ""):
        self.protocol, self.options, self.what, self.hint = protocol, dict(options), what, hint

    def __call__(self):
        fsspec = require_fsspec()
        try:
            return fsspec.filesystem(self.protocol, **self.options)
        except ImportError as e:
            raise ImportError(f"{self.what}: the file system for {self.protocol}:// needs a package that is not "
                              f"installed: {e}") from e
        except OSError as e:
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise OSError(f"{self.what}: cannot open the {self.protocol} file system "
                          f"({', '.join(f'{k}={v!r}' for k, v in self.options.items())}): {first}"
                          + (f". {self.hint}" if self.hint else "")) from e


class LocalOutputDir:
    """``get_local_output_dir()``: a context manager giving a fresh local temporary directory, removed after."""

    def __call__(self):
        return tempfile.TemporaryDirectory(prefix="perseus-run-")


class SyncToStore:
    """``sync(local_dir)``: copies the files under ``local_dir`` into the run's directory in the store, keeping
    the relative layout; a file already copied is copied again only when its size or mtime changed."""

    def __init__(self, store: Any, run_path: str):
        self.store, self.run_path = store, run_path
        self._copied: dict[str, tuple[int, int]] = {}

    def __getstate__(self):
        return {"store": self.store, "run_path": self.run_path, "_copied": {}}

    def __call__(self, local_run_path: str) -> None:
        fs = self.store.fs
        root = self.store.get_localized_path(self.run_path)
        for local_dir, _dirs, files in os.walk(local_run_path):
            rel = os.path.relpath(local_dir, local_run_path)
            target_dir = root if rel == "." else f"{root}/{rel}"
            if files:
                fs.makedirs(target_dir, exist_ok=True)
            for name in files:
                local = os.path.join(local_dir, name)
                st = os.stat(local)
                stamp = (st.st_size, st.st_mtime_ns)
                if self._copied.get(local) == stamp:
                    continue
                fs.put_file(local, f"{target_dir}/{name}")
                self._copied[local] = stamp


class RemoteStore:
    """What a rank needs of the store (``Store.to_remote(run_id, dataset_idx)``): picklable, made on the driver.

    Attributes (Horovod's): ``train_data_path``, ``val_data_path``, ``test_data_path``, ``saving_runs``,
    ``runs_path``, ``run_path``, ``checkpoint_path``, ``logs_path``, ``checkpoint_filename``, ``logs_subdir``,
    ``get_local_output_dir`` (call it for a context manager giving a local temp dir), ``sync`` (call it with a
    local directory to copy it into ``run_path``); and ``prefix_path``, ``storage_options``. Methods:
    :meth:`filesystem` (the store's fsspec file system, opened on first call in this process) and
    :meth:`get_localized_path` (a store path as that file system names it).
    """

    def __init__(self, store: Any, attrs: dict):
        self._store = store
        for name, value in attrs.items():
            setattr(self, name, value)

    def filesystem(self):
        """The store's fsspec file system, opened here on first use. Raises what the store's ``fs`` raises."""
        return self._store.fs

    @property
    def fs(self):
        return self._store.fs

    def get_localized_path(self, path: str) -> str:
        return self._store.get_localized_path(path)
