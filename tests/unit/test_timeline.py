"""Unit tests for perseus.timeline: Chrome-trace JSON written by a background thread."""

import dataclasses
import enum
import json
import os
import threading
import time

import pytest

from perseus.timeline import Timeline
from perseus.timeline import events as ev

pytestmark = pytest.mark.timeout(60)


class OpType(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2


@dataclasses.dataclass
class Signature:
    op_type: OpType


@dataclasses.dataclass
class Entry:
    name: str
    signature: Signature


@dataclasses.dataclass
class Piece:
    entry: Entry


def entry(name, op=OpType.ALLREDUCE):
    return Entry(name, Signature(op))


def run_allreduce(tl, entries):
    for e in entries:
        tl.negotiate_start(e)
    for e in entries:
        tl.negotiate_end(e)
    pieces = [Piece(e) for e in entries]
    for activity in (ev.MEMCPY_IN_FUSION_BUFFER, ev.MPI_ALLREDUCE, ev.MEMCPY_OUT_FUSION_BUFFER):
        tl.activity_start_all(pieces, activity)
    for e in entries:
        tl.op_end(e)


def load(path):
    with open(path, "rb") as f:
        return json.loads(f.read())


def wait_for(path, text, timeout=5.0):
    """Wait until the writer thread has put ``text`` into the file."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            if text in f.read():
                return
        time.sleep(0.01)
    raise AssertionError(f"{text!r} never appeared in {path}")


def rows(events):
    """Map pid -> tensor name from the process_name metadata."""
    return {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}


def check_nesting(events):
    """Assert B/E events balance and never cross per pid; return {pid: [(depth, name), ...]} of begins."""
    stacks, begins, last_ts = {}, {}, {}
    for e in events:
        if e["ph"] not in "BE":
            continue
        pid = e["pid"]
        assert e["tid"] == 0
        assert e["ts"] >= last_ts.get(pid, 0)
        last_ts[pid] = e["ts"]
        stack = stacks.setdefault(pid, [])
        if e["ph"] == "B":
            begins.setdefault(pid, []).append((len(stack), e["name"]))
            stack.append(e["name"])
        else:
            assert stack, f"E without B on pid {pid}"
            stack.pop()
    assert all(not s for s in stacks.values()), stacks
    return begins


def test_names_and_nesting(tmp_path):
    path = tmp_path / "tl.json"
    tl = Timeline(str(path))
    run_allreduce(tl, [entry("allreduce.a"), entry("allreduce.b")])
    gather = entry("allgather.c", OpType.ALLGATHER)
    tl.negotiate_start(gather)
    tl.negotiate_end(gather)
    tl.op_end(gather)
    tl.close()

    events = load(path)
    first = events[0]
    assert first["name"] == "process_name" and first["ph"] == "M" and first["pid"] == 0
    assert first["args"]["name"] == "perseus"
    assert isinstance(first["args"]["start_time_since_epoch_in_micros"], int)
    assert rows(events) == {0: "perseus", 1: "allreduce.a", 2: "allreduce.b", 3: "allgather.c"}
    sort = {e["pid"]: e["args"]["sort_index"] for e in events if e.get("name") == "process_sort_index"}
    assert sort == {1: 1, 2: 2, 3: 3}

    begins = check_nesting(events)
    expected = [(0, "NEGOTIATE_ALLREDUCE"), (0, "ALLREDUCE"), (1, "MEMCPY_IN_FUSION_BUFFER"),
                (1, "MPI_ALLREDUCE"), (1, "MEMCPY_OUT_FUSION_BUFFER")]
    assert begins[1] == expected and begins[2] == expected
    assert begins[3] == [(0, "NEGOTIATE_ALLGATHER"), (0, "ALLGATHER")]
    assert ev.negotiate_name("BROADCAST") == "NEGOTIATE_BROADCAST"


def test_valid_json_while_recording_and_after_close(tmp_path):
    path = tmp_path / "tl.json"
    tl = Timeline(str(path))
    assert load(path)[0]["pid"] == 0  # valid right after construction
    e = entry("allreduce.live")
    tl.negotiate_start(e)
    tl.negotiate_end(e)
    wait_for(path, '"ALLREDUCE"')
    events = load(path)  # mid-run, with ALLREDUCE still open
    assert [x["name"] for x in events if x["ph"] == "B"] == ["NEGOTIATE_ALLREDUCE", "ALLREDUCE"]
    with open(path, "rb") as f:
        assert f.read().endswith(b"\n]")
    tl.close()
    events = load(path)
    check_nesting(events)  # close() ended the open ALLREDUCE


def test_odd_orders_are_tolerated(tmp_path):
    path = tmp_path / "tl.json"
    tl = Timeline(str(path))
    late = entry("allreduce.late")
    tl.op_end(late)  # nothing open: ignored
    tl.activity_start_all([Piece(late)], ev.MPI_ALLREDUCE)  # no op open: ignored
    tl.negotiate_end(late)  # started mid-flight: no NEGOTIATE end, just begins ALLREDUCE
    tl.activity_start_all([Piece(late)], ev.MPI_ALLREDUCE)
    tl.op_end(late)
    tl.op_end(late)
    twice = entry("allreduce.twice")
    tl.negotiate_start(twice)
    tl.negotiate_start(twice)
    tl.negotiate_end(object())  # malformed entry: never raises
    tl.activity_start_all([object()], ev.MPI_ALLREDUCE)
    tl.mark_cycle()
    tl.close()

    events = load(path)
    begins = check_nesting(events)
    names = {v: k for k, v in rows(events).items()}
    assert begins[names["allreduce.late"]] == [(0, "ALLREDUCE"), (1, "MPI_ALLREDUCE")]
    assert begins[names["allreduce.twice"]] == [(0, "NEGOTIATE_ALLREDUCE"), (0, "NEGOTIATE_ALLREDUCE")]


def test_size_bound_truncates(tmp_path):
    path = tmp_path / "tl.json"
    limit = 4096
    tl = Timeline(str(path), mark_cycles=True, max_bytes=limit)
    for i in range(300):
        tl.mark_cycle()
        run_allreduce(tl, [entry(f"allreduce.t{i}")])
    wait_for(path, ev.TIMELINE_TRUNCATED)
    tl.close()

    assert tl.truncated
    assert os.path.getsize(path) <= limit
    events = load(path)
    markers = [e for e in events if e.get("name") == ev.TIMELINE_TRUNCATED]
    assert len(markers) == 1 and events[-1] is markers[0]
    assert markers[0]["ph"] == "i" and markers[0]["args"]["max_bytes"] == limit
    size = os.path.getsize(path)
    tl.negotiate_start(entry("allreduce.after"))
    assert os.path.getsize(path) == size


def test_cycle_start_only_when_marked(tmp_path):
    for mark, expected in ((False, 0), (True, 3)):
        path = tmp_path / f"tl_{mark}.json"
        tl = Timeline(str(path), mark_cycles=mark)
        for _ in range(3):
            tl.mark_cycle()
        tl.close()
        cycles = [e for e in load(path) if e.get("name") == ev.CYCLE_START]
        assert len(cycles) == expected
        assert all(e["ph"] == "i" and e["pid"] == 0 and e["s"] in "gp" for e in cycles)


def test_unusable_path_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="directory") as info:
        Timeline(str(tmp_path))
    assert str(tmp_path) in str(info.value)
    missing = tmp_path / "no" / "such" / "dir" / "tl.json"
    with pytest.raises(ValueError, match="No such file") as info:
        Timeline(str(missing))
    assert str(missing) in str(info.value)


def test_close_is_idempotent_and_final(tmp_path):
    path = tmp_path / "tl.json"
    tl = Timeline(str(path))
    run_allreduce(tl, [entry("allreduce.x")])
    tl.close()
    tl.close()
    assert not tl._thread.is_alive()
    content = path.read_bytes()
    run_allreduce(tl, [entry("allreduce.y")])
    tl.mark_cycle()
    assert path.read_bytes() == content
    json.loads(content)


def test_threads_emitting_concurrently(tmp_path):
    path = tmp_path / "tl.json"
    tl = Timeline(str(path), mark_cycles=True)
    n_threads, n_iters = 8, 100
    errors = []

    def work(t):
        try:
            names = [entry(f"allreduce.w{t}.{k}") for k in range(3)]
            for i in range(n_iters):
                run_allreduce(tl, names[i % 2:])
                tl.mark_cycle()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tl.close()

    assert not errors
    events = load(path)
    names = rows(events)
    assert len(names) == 1 + n_threads * 3
    assert sorted(names) == list(range(len(names)))
    begins = check_nesting(events)
    for pid, name in names.items():
        if pid:
            k = int(name.rsplit(".", 1)[1])
            runs = n_iters // 2 if k == 0 else n_iters  # k == 0 runs on even i only
            assert len(begins[pid]) == 5 * runs
    assert sum(e.get("name") == ev.CYCLE_START for e in events) == n_threads * n_iters
