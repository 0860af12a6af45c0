"""perseus.spark.common.store (horovod.spark.common.store): Horovod's layout and paths, Store.create choosing the
class, LocalStore's file operations, checkpoints, sync and its remote view (pickled), HDFSStore without Hadoop,
DBFS paths. No Spark needed."""

import os
import pickle

import pytest

pytest.importorskip("fsspec")

from perseus.base.knobs import set_external  # noqa: E402
from perseus.spark.common import store as store_mod  # noqa: E402
from perseus.spark.common.store import (DBFSLocalStore, FilesystemStore, HDFSStore, LocalStore,  # noqa: E402
                                        RemoteStore, Store)


@pytest.fixture
def databricks():
    set_external("DATABRICKS_RUNTIME_VERSION", "15.4")
    yield
    set_external("DATABRICKS_RUNTIME_VERSION", None)


def test_layout_follows_horovods(tmp_path):
    s = LocalStore(str(tmp_path))
    root = f"file://{tmp_path}"
    assert s.prefix_path == root
    assert s.get_train_data_path() == f"{root}/intermediate_train_data"
    assert s.get_train_data_path(3) == f"{root}/intermediate_train_data.3"
    assert s.get_val_data_path(0) == f"{root}/intermediate_val_data.0"
    assert s.get_test_data_path(1) == f"{root}/intermediate_test_data.1"
    assert s.get_runs_path() == f"{root}/runs"
    assert s.get_run_path("r1") == f"{root}/runs/r1"
    assert s.get_checkpoint_path("r1") == f"{root}/runs/r1"
    assert s.get_logs_path("r1") == f"{root}/runs/r1/logs"
    assert s.get_checkpoint_filename() == "checkpoint" and s.get_logs_subdir() == "logs"
    assert s.saving_runs()
    assert s.get_localized_path(s.get_run_path("r1")) == f"{tmp_path}/runs/r1"


def test_layout_options(tmp_path):
    s = LocalStore(str(tmp_path), train_path=str(tmp_path / "t"), val_path=f"file://{tmp_path}/v",
                   runs_path=str(tmp_path / "out"), save_runs=False, checkpoint_filename="model.pt")
    assert s.get_train_data_path(0) == f"file://{tmp_path}/t.0"
    assert s.get_val_data_path() == f"file://{tmp_path}/v"
    assert s.get_run_path("x") == f"file://{tmp_path}/out/x"
    assert s.get_checkpoint_path("x") is None and s.get_logs_path("x") is None and not s.saving_runs()
    assert s.get_checkpoint_filename() == "model.pt"
    assert s.get_checkpoints("x") == []


def test_relative_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert LocalStore("rel/store").prefix_path == f"file://{tmp_path}/rel/store"


def test_create_chooses_the_class_by_prefix(tmp_path, databricks):
    assert type(Store.create(str(tmp_path))) is LocalStore
    assert type(Store.create(f"file://{tmp_path}")) is LocalStore
    assert type(Store.create("hdfs://namenode:8020/user/x")) is HDFSStore
    assert type(Store.create("memory://bucket/x")) is FilesystemStore
    for path in ("/dbfs/tmp/a", "dbfs:/tmp/a", "file:/dbfs/tmp/a", "file:///dbfs/tmp/a"):
        assert type(Store.create(path)) is DBFSLocalStore, path


def test_dbfs_paths_are_local_paths_off_databricks():
    assert type(Store.create("/dbfs/tmp/a")) is LocalStore


def test_dbfs_path_normalisation():
    assert DBFSLocalStore.normalize_path("dbfs:/tmp/a1") == "/dbfs/tmp/a1"
    assert DBFSLocalStore.normalize_path("/dbfs/tmp/a1") == "/dbfs/tmp/a1"
    assert DBFSLocalStore.normalize_path("file:/dbfs/tmp/a1") == "/dbfs/tmp/a1"
    assert DBFSLocalStore.normalize_path("file:///dbfs/tmp/a1") == "/dbfs/tmp/a1"
    assert not DBFSLocalStore.matches_dbfs("dbfs://tmp/a1")
    with pytest.raises(ValueError, match="not a DBFS path"):
        DBFSLocalStore.normalize_path("dbfs://tmp/a1")
    s = DBFSLocalStore("dbfs:/tmp/exp")
    assert s.prefix_path == "file:///dbfs/tmp/exp"
    assert s.get_localized_path(s.get_train_data_path(0)) == "/dbfs/tmp/exp/intermediate_train_data.0"
    assert s.get_checkpoint_filename() == "checkpoint.tf"


def test_dbfs_store_works_on_a_mapped_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "_DBFS_PREFIX_MAPPING", str(tmp_path))
    s = DBFSLocalStore("/dbfs/exp")
    s.write_text(s.get_run_path("r") + "/note.txt", "hello")
    assert (tmp_path / "exp" / "runs" / "r" / "note.txt").read_text() == "hello"
    assert s.exists("dbfs:/exp/runs/r/note.txt")


def test_local_store_refuses_other_file_systems():
    with pytest.raises(ValueError, match="not a local path"):
        LocalStore("s3://bucket/x")


def test_read_write_exists(tmp_path):
    s = LocalStore(str(tmp_path / "store"))
    path = s.get_run_path("r") + "/sub/a.txt"
    assert not s.exists(path)
    s.write_text(path, "text")
    assert s.exists(path) and s.read(path) == b"text"
    assert (tmp_path / "store" / "runs" / "r" / "sub" / "a.txt").read_text() == "text"
    assert not s.is_parquet_dataset(s.get_train_data_path(0))


def test_get_checkpoints_lists_the_run_directory(tmp_path):
    s = LocalStore(str(tmp_path))
    assert s.get_checkpoints("r") == []
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    for name in ("b.ckpt", "a.ckpt", "checkpoint", "c.txt"):
        (run / name).write_text("x")
    assert s.get_checkpoints("r") == [str(run / "a.ckpt"), str(run / "b.ckpt")]
    assert s.get_checkpoints("r", suffix=".txt") == [str(run / "c.txt")]


def test_sync_copies_the_tree_and_only_what_changed(tmp_path):
    s = LocalStore(str(tmp_path / "store"))
    sync = s.sync_fn("r")
    local = tmp_path / "local"
    (local / "logs").mkdir(parents=True)
    (local / "checkpoint").write_text("1")
    (local / "logs" / "events").write_text("e")
    sync(str(local))
    run = tmp_path / "store" / "runs" / "r"
    assert (run / "checkpoint").read_text() == "1" and (run / "logs" / "events").read_text() == "e"
    (run / "logs" / "events").write_text("changed in the store")
    (local / "checkpoint").write_text("22")
    sync(str(local))
    assert (run / "checkpoint").read_text() == "22"
    assert (run / "logs" / "events").read_text() == "changed in the store"  # unchanged here: not copied again


def test_local_output_dir_is_a_fresh_directory_removed_after(tmp_path):
    make = LocalStore(str(tmp_path)).get_local_output_dir_fn("r")
    with make() as d:
        assert os.path.isdir(d) and not os.listdir(d)
    assert not os.path.exists(d)


def test_to_remote_pickles_and_works_on_the_other_side(tmp_path):
    s = LocalStore(str(tmp_path), storage_options={"auto_mkdir": True})
    s.fs  # opened here: the connection must not travel
    remote = pickle.loads(pickle.dumps(s.to_remote("run1", 2)))
    assert isinstance(remote, RemoteStore)
    assert remote.train_data_path == s.get_train_data_path(2)
    assert remote.val_data_path == s.get_val_data_path(2)
    assert remote.test_data_path == s.get_test_data_path(2)
    assert remote.run_path == s.get_run_path("run1") and remote.runs_path == s.get_runs_path()
    assert remote.checkpoint_path == s.get_checkpoint_path("run1") and remote.logs_path == s.get_logs_path("run1")
    assert remote.checkpoint_filename == "checkpoint" and remote.logs_subdir == "logs" and remote.saving_runs
    assert remote.prefix_path == s.prefix_path and remote.storage_options == {"auto_mkdir": True}
    with remote.get_local_output_dir() as out:
        with open(os.path.join(out, remote.checkpoint_filename), "w") as f:
            f.write("weights")
        remote.sync(out)
    assert (tmp_path / "runs" / "run1" / "checkpoint").read_text() == "weights"
    fs = remote.filesystem()
    assert fs.exists(remote.get_localized_path(remote.run_path) + "/checkpoint")


def test_store_pickles_without_its_file_system(tmp_path):
    s = LocalStore(str(tmp_path))
    s.write_text(s.get_run_path("r") + "/x", "1")
    copy = pickle.loads(pickle.dumps(s))
    assert copy._fs is None and copy.read(copy.get_run_path("r") + "/x") == b"1"


def test_check_writable(tmp_path):
    LocalStore(str(tmp_path / "new" / "store")).check_writable()
    assert os.listdir(tmp_path / "new" / "store") == []  # the probe is gone
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OSError, match=r"store path file://.*/afile/store cannot be written"):
        LocalStore(str(tmp_path / "afile" / "store")).check_writable()


def test_hdfs_store_parses_urls_without_hadoop():
    s = HDFSStore("hdfs://namenode01:8020/user/test/output")
    assert s.prefix_path == "hdfs://namenode01:8020/user/test/output"
    assert s.get_full_path("/output") == "hdfs://namenode01:8020/output"
    assert s.get_localized_path("hdfs://namenode01:8020/user/test/output") == "/user/test/output"
    assert s._hdfs_kwargs["host"] == "namenode01" and s._hdfs_kwargs["port"] == 8020
    assert s.get_train_data_path(1) == "hdfs://namenode01:8020/user/test/output/intermediate_train_data.1"
    for root in ("hdfs:///user/test/output", "/user/test/output"):
        s = HDFSStore(root)
        assert s.get_full_path("/user/test/output") == "hdfs:///user/test/output"
        assert s.get_localized_path("hdfs:///user/test/output") == "/user/test/output"
        assert s._hdfs_kwargs["host"] == "default" and s._hdfs_kwargs["port"] == 0
    s = HDFSStore("/user/prefix", host="nn", port=9000, user="me", train_path="/user/train_path")
    assert s.get_train_data_path() == "hdfs:///user/train_path"
    assert s._hdfs_kwargs == dict(host="nn", port=9000, user="me", kerb_ticket=None, extra_conf=None)
    with pytest.raises(ValueError, match="file:// URL"):
        HDFSStore("file:///user/test/output")


def test_hdfs_store_says_what_is_missing_when_first_used():
    s = HDFSStore("hdfs://namenode01:8020/user/test/output")
    remote = pickle.loads(pickle.dumps(s.to_remote("r", 0)))  # constructs and travels without Hadoop
    assert remote.train_data_path.startswith("hdfs://namenode01:8020/")
    if os.path.isdir(os.environ.get("HADOOP_HOME", "/nonexistent")):
        pytest.skip("a Hadoop client is installed here")
    with pytest.raises(OSError, match=r"HDFSStore\(hdfs://namenode01:8020/user/test/output\): cannot open the "
                                      r"hdfs file system .*HADOOP_HOME"):
        s.exists(s.get_train_data_path(0))


def test_hdfs_store_uses_a_file_system_from_its_factory(tmp_path, monkeypatch):
    """Horovod's tests replace _get_filesystem_fn; the store then works through what it returns."""
    import fsspec

    local = fsspec.filesystem("file")
    monkeypatch.setattr(HDFSStore, "_get_filesystem_fn", lambda self: (lambda: local))
    s = HDFSStore(f"hdfs://{tmp_path}")
    s.write_text(s.get_run_path("r") + "/a", "x")
    assert (tmp_path / "runs" / "r" / "a").read_text() == "x"


def test_memory_file_system_store():
    s = FilesystemStore("memory://perseus-test/store")
    s.write_text(s.get_run_path("r") + "/a", "x")
    assert s.exists(s.get_run_path("r") + "/a") and s.read(s.get_run_path("r") + "/a") == b"x"
