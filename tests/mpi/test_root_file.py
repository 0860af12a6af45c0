"""perseus.runtime.files: a file written on the root alone is read back on every rank through root_file, and
root_call gives every rank the root's answer."""

import glob
import os
import pathlib
import shutil
import tempfile

import numpy as np
import pytest
import torch

from perseus.runtime.files import root_call, root_file

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def folder(hvd):
    """A directory only this rank writes to (so that the root's files are absent on the other ranks)."""
    path = tempfile.mkdtemp(prefix=f"root-file-test-{hvd.rank()}-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_torch_checkpoint_written_on_root_only(hvd, folder):
    rank, size = hvd.rank(), hvd.size()
    path = os.path.join(folder, "best.pt")
    state = {"w": torch.arange(6.0).reshape(2, 3) + 10, "step": 7}
    if rank == 0:
        torch.save(state, path)
    assert root_call(os.path.exists, path)
    local = root_file(path)
    if rank == 0:
        assert local == path
    else:
        assert local != path and os.path.basename(local) == "best.pt" and not os.path.exists(path)
    loaded = torch.load(local)
    assert loaded["step"] == 7 and torch.equal(loaded["w"], state["w"])
    # the same root path again: a new copy replaces the previous one
    if rank == 0:
        torch.save({"w": torch.zeros(1), "step": 8}, path)
    again = root_file(pathlib.Path(path))
    assert isinstance(again, pathlib.Path)
    assert torch.load(again)["step"] == 8
    if rank != 0 and size > 1:
        assert not os.path.exists(local)


def test_only_the_roots_argument_matters(hvd, folder):
    rank = hvd.rank()
    path = os.path.join(folder, "notes.txt")  # a different folder on every rank
    if rank == 0:
        with open(path, "w") as f:
            f.write("written on rank 0\n")
    with open(root_file(path if rank == 0 else None)) as f:
        assert f.read() == "written on rank 0\n"


def test_directory_prefix_and_large_file(hvd, folder, monkeypatch):
    import perseus.runtime.files as files

    monkeypatch.setattr(files, "CHUNK_BYTES", 1000)  # several chunks per file, one short last chunk
    rank = hvd.rank()
    blob = np.random.default_rng(3).integers(0, 256, 4321, dtype=np.uint8).tobytes()
    model_dir = os.path.join(folder, "saved")
    if rank == 0:
        os.makedirs(os.path.join(model_dir, "variables"))
        with open(os.path.join(model_dir, "variables", "data.bin"), "wb") as f:
            f.write(blob)
        open(os.path.join(model_dir, "empty"), "wb").close()
        for suffix in (".index", ".data-00000-of-00001"):
            with open(os.path.join(folder, "ckpt-3" + suffix), "wb") as f:
                f.write(suffix.encode())
    local_dir = root_file(model_dir)
    with open(os.path.join(local_dir, "variables", "data.bin"), "rb") as f:
        assert f.read() == blob
    assert os.path.getsize(os.path.join(local_dir, "empty")) == 0
    prefix = root_file(os.path.join(folder, "ckpt-3"))
    assert os.path.basename(prefix) == "ckpt-3" and not os.path.exists(prefix)
    with open(prefix + ".index", "rb") as f:
        assert f.read() == b".index"
    assert sorted(os.path.basename(p) for p in root_call(glob.glob, os.path.join(folder, "ckpt-*"))) == [
        "ckpt-3.data-00000-of-00001", "ckpt-3.index"]


def test_missing_file_raises_on_every_rank(hvd, folder):
    path = os.path.join(folder, "never-written.pt")
    assert not root_call(os.path.exists, path)
    with pytest.raises(FileNotFoundError, match="rank 0 has no file"):
        root_file(path)
    with pytest.raises(TypeError):  # raised by os.path.exists on the root, then on every rank
        root_call(os.path.exists, None if hvd.rank() == 0 else path)
    # nothing is left half-done: the ranks still agree
    assert hvd.allgather_object(hvd.rank(), name="root_file.after") == list(range(hvd.size()))


def test_not_a_path_is_returned_as_it_is(hvd):
    import io

    buf = io.BytesIO(b"rank %d" % hvd.rank())
    assert root_file(buf) is buf


def test_root_other_than_zero(hvd, folder):
    size, rank = hvd.size(), hvd.rank()
    root = size - 1
    path = os.path.join(folder, "from_last.txt")
    if rank == root:
        with open(path, "w") as f:
            f.write(f"rank {root}")
    assert root_call(os.path.exists, path, root_rank=root)
    assert root_call(lambda: hvd.rank()) == 0
    with open(root_file(path, root_rank=root)) as f:
        assert f.read() == f"rank {root}"
