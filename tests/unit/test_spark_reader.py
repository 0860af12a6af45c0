"""perseus.spark.common.reader.ParquetBatches on Parquet files written here with pyarrow (no Spark): row groups
dealt round robin, the same number of steps on every rank, cycling over a short share, seeded shuffling, array
and Spark vector columns stacked, and the errors."""

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

import pyarrow.parquet as pq  # noqa: E402

from perseus.spark.common.reader import ParquetBatches  # noqa: E402


def _write(directory, files=3, groups=2, rows=5):
    """``files`` Parquet files of ``groups`` row groups of ``rows`` rows; ``id`` numbers the rows in file order.
    Returns the ids of each row group in the dataset's order."""
    directory.mkdir(exist_ok=True)
    order, next_id = [], 0
    for f in range(files):
        ids = np.arange(next_id, next_id + groups * rows)
        next_id += len(ids)
        table = pa.table({"id": ids, "x": pa.array([[float(i), -float(i)] for i in ids], pa.list_(pa.float32())),
                          "y": ids * 0.5, "flag": ids % 2 == 0})
        pq.write_table(table, str(directory / f"part-{f:05d}.parquet"), row_group_size=rows)
        order += [list(ids[g * rows:(g + 1) * rows]) for g in range(groups)]
    (directory / "_SUCCESS").write_text("")
    (directory / "._SUCCESS.crc").write_text("")
    return order


def _ids(batches):
    return [int(i) for b in batches for i in b["id"]]


def test_row_groups_are_dealt_round_robin(tmp_path):
    groups = _write(tmp_path / "d")
    for rank in range(2):
        r = ParquetBatches(str(tmp_path / "d"), ["id"], 5, rank, 2)
        mine = [i for g in groups[rank::2] for i in g]
        assert r.rows == len(mine) and r.rows_total == 30
        assert _ids(r.epoch(0, steps=3)) == mine


def test_every_rank_runs_the_same_number_of_full_batches(tmp_path):
    _write(tmp_path / "d", files=7, groups=1, rows=4)  # 7 row groups over 3 ranks: 3, 2 and 2
    readers = [ParquetBatches(str(tmp_path / "d"), ["id", "x"], 3, rank, 3) for rank in range(3)]
    assert [r.rows for r in readers] == [12, 8, 8]
    assert {r.steps() for r in readers} == {28 // 9} and len(readers[0]) == 3
    for r in readers:
        batches = list(r.epoch(0))
        assert len(batches) == 3
        assert all(b["id"].shape == (3,) and b["x"].shape == (3, 2) for b in batches)
    assert readers[0].steps(1000) == 1000 // 9 and readers[0].steps(2) == 1


def test_a_short_share_cycles(tmp_path):
    groups = _write(tmp_path / "d", files=1, groups=3, rows=2)  # rank 1 holds one row group of 2 rows
    r = ParquetBatches(str(tmp_path / "d"), ["id"], 3, 1, 2)
    assert _ids(r.epoch(0, steps=3)) == groups[1] * 4 + groups[1][:1]


def test_without_shuffling_every_epoch_reads_the_same_rows(tmp_path):
    _write(tmp_path / "d")
    r = ParquetBatches(str(tmp_path / "d"), ["id"], 4, 0, 2)
    assert _ids(r.epoch(0)) == _ids(r.epoch(5))


def test_shuffling_is_seeded_by_seed_epoch_and_rank(tmp_path):
    _write(tmp_path / "d", files=4, groups=3, rows=5)

    def read(seed, epoch, rank, buffer=16):
        return _ids(ParquetBatches(str(tmp_path / "d"), ["id"], 5, rank, 2, shuffle_buffer_size=buffer,
                                   seed=seed).epoch(epoch))

    first = read(1, 0, 0)
    assert len(first) == 30 == len(set(first))  # one pass over the share: each row once
    assert first == read(1, 0, 0)
    assert first != read(1, 1, 0) and first != read(2, 0, 0)
    assert sorted(first) == sorted(read(1, 1, 0))  # the same rows, another order
    assert set(first).isdisjoint(read(1, 0, 1))
    plain = _ids(ParquetBatches(str(tmp_path / "d"), ["id"], 5, 0, 2).epoch(0))
    assert first != plain and sorted(first) == sorted(plain)
    assert sorted(read(1, 0, 0, buffer=1)) == sorted(plain)  # row groups shuffled, rows kept in order


def test_shuffle_flag_without_a_buffer_size(tmp_path):
    _write(tmp_path / "d")
    shuffled = ParquetBatches(str(tmp_path / "d"), ["id"], 5, 0, 1, shuffle=True, seed=3)
    assert shuffled.shuffle and sorted(_ids(shuffled.epoch(0))) == list(range(30))
    assert not ParquetBatches(str(tmp_path / "d"), ["id"], 5, 0, 1, shuffle_buffer_size=8, shuffle=False).shuffle


def test_iterating_runs_successive_epochs(tmp_path):
    _write(tmp_path / "d")
    r = ParquetBatches(str(tmp_path / "d"), ["id"], 5, 0, 1, shuffle_buffer_size=30, seed=0)
    assert [_ids(r) for _ in range(2)] == [_ids(r.epoch(0)), _ids(r.epoch(1))]


def test_columns_become_numpy_arrays(tmp_path):
    _write(tmp_path / "d")
    batch = next(ParquetBatches(str(tmp_path / "d"), ["x", "y", "flag", "id"], 4, 0, 1).epoch(0))
    assert list(batch) == ["x", "y", "flag", "id"]
    assert batch["x"].dtype == np.float32 and batch["x"].shape == (4, 2)
    np.testing.assert_array_equal(batch["x"], [[0, 0], [1, -1], [2, -2], [3, -3]])
    assert batch["y"].dtype == np.float64 and batch["flag"].dtype == np.bool_ and batch["id"].dtype == np.int64
    assert all(v.flags.writeable for v in batch.values())


def test_fixed_size_and_ragged_lists(tmp_path):
    values = pa.array([[1, 2, 3], [4, 5, 6]], pa.list_(pa.int64(), 3))
    pq.write_table(pa.table({"v": values}), str(tmp_path / "fixed.parquet"))
    batch = next(ParquetBatches(str(tmp_path / "fixed.parquet"), ["v"], 2, 0, 1).epoch(0))
    np.testing.assert_array_equal(batch["v"], [[1, 2, 3], [4, 5, 6]])
    pq.write_table(pa.table({"v": pa.array([[1.0], [2.0, 3.0]])}), str(tmp_path / "ragged.parquet"))
    with pytest.raises(ValueError, match=r"column 'v' holds rows of different lengths \(1 to 2\)"):
        next(ParquetBatches(str(tmp_path / "ragged.parquet"), ["v"], 2, 0, 1).epoch(0))


def _spark_vectors(rows):
    """Vectors laid out as Spark writes VectorUDT: struct<type int8, size int32, indices list<int32>,
    values list<double>>; type 0 sparse (size, indices, values), 1 dense (values only)."""
    t = pa.struct([("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())),
                   ("values", pa.list_(pa.float64()))])
    return pa.array(rows, t)


def test_spark_vectors_are_densified(tmp_path):
    vectors = _spark_vectors([
        {"type": 0, "size": 4, "indices": [1, 3], "values": [5.0, 7.0]},
        {"type": 1, "size": None, "indices": None, "values": [1.0, 2.0, 3.0, 4.0]},
        {"type": 0, "size": 4, "indices": [], "values": []},
        {"type": 0, "size": 4, "indices": [0], "values": [9.0]},
    ])
    pq.write_table(pa.table({"v": vectors, "n": [0, 1, 2, 3]}), str(tmp_path / "v.parquet"))
    r = ParquetBatches(str(tmp_path / "v.parquet"), ["v"], 3, 0, 1)
    batch = next(r.epoch(0, steps=2))  # rows 0-2 (and the slice at 1-3 of the next batch below)
    np.testing.assert_array_equal(batch["v"], [[0, 5, 0, 7], [1, 2, 3, 4], [0, 0, 0, 0]])
    sliced = ParquetBatches(str(tmp_path / "v.parquet"), ["v"], 1, 1, 2)  # rows 2-3 (a cut of the row group)
    np.testing.assert_array_equal(np.concatenate([b["v"] for b in sliced.epoch(0, steps=2)]),
                                  [[0, 0, 0, 0], [9, 0, 0, 0]])


def test_fewer_row_groups_than_ranks_are_cut_into_row_ranges(tmp_path):
    _write(tmp_path / "d", files=1, groups=1, rows=10)
    readers = [ParquetBatches(str(tmp_path / "d"), ["id"], 1, rank, 4) for rank in range(4)]
    shares = [_ids(r.epoch(0, steps=r.rows)) for r in readers]
    assert sorted(i for s in shares for i in s) == list(range(10))
    assert all(shares) and shares[0] == [0, 1]


def test_an_empty_share_names_the_rank_and_the_fix(tmp_path):
    _write(tmp_path / "d", files=1, groups=1, rows=1)
    ParquetBatches(str(tmp_path / "d"), ["id"], 1, 0, 2)
    with pytest.raises(ValueError, match=r"rank 1 of 2 has no rows to read: .* has 1 rows in 1 row groups of 1 "
                                         r"files; run at most 1 ranks, or write more rows"):
        ParquetBatches(str(tmp_path / "d"), ["id"], 1, 1, 2)


def test_errors(tmp_path):
    _write(tmp_path / "d")
    with pytest.raises(ValueError, match=r"has no column 'nope' \(its columns: id, x, y, flag\)"):
        ParquetBatches(str(tmp_path / "d"), ["id", "nope"], 2, 0, 1)
    with pytest.raises(ValueError, match="rank=2 in"):
        ParquetBatches(str(tmp_path / "d"), ["id"], 2, 2, 2)
    with pytest.raises(ValueError, match="batch_size=0"):
        ParquetBatches(str(tmp_path / "d"), ["id"], 0, 0, 1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ParquetBatches(str(tmp_path / "missing"), ["id"], 2, 0, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no Parquet files"):
        ParquetBatches(str(tmp_path / "empty"), ["id"], 2, 0, 1)


def test_urls_and_file_systems(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    import pyarrow.fs as pafs

    _write(tmp_path / "d")
    want = _ids(ParquetBatches(str(tmp_path / "d"), ["id"], 5, 0, 1).epoch(0))
    for path, fs in ((f"file://{tmp_path}/d", None), (f"file://{tmp_path}/d", fsspec.filesystem("file")),
                     (str(tmp_path / "d"), pafs.LocalFileSystem()), (f"file://{tmp_path}/d", pafs.LocalFileSystem())):
        assert _ids(ParquetBatches(path, ["id"], 5, 0, 1, filesystem=fs).epoch(0)) == want, (path, fs)
    mem = fsspec.filesystem("memory")
    for f in sorted((tmp_path / "d").glob("*.parquet")):
        mem.pipe(f"/perseus-reader/{f.name}", f.read_bytes())
    assert _ids(ParquetBatches("memory://perseus-reader", ["id"], 5, 0, 1, filesystem=mem).epoch(0)) == want


def test_cache_keeps_what_was_read(tmp_path):
    _write(tmp_path / "d")
    r = ParquetBatches(str(tmp_path / "d"), ["id"], 5, 0, 1, cache=True)
    first = _ids(r.epoch(0))
    for f in (tmp_path / "d").glob("*.parquet"):
        f.unlink()
    r.close()
    assert _ids(r.epoch(1)) == first
