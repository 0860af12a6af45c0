"""Unit tests for perseus.engine.negotiation, without MPI.

Every test simulates a process set of N ranks in one process: each rank has its own Negotiator and its own
``pending`` dict. One simulated round does what the engine does over MPI:

1. every rank's ``build_words`` (copied, since the negotiator reuses its buffer);
2. the bitwise AND of all ranks' words (what the band all-reduce computes);
3. every rank's ``decode`` of a copy of the AND;
4. if an exchange is needed, every rank's ``exchange_payload`` is gathered and passed to ``apply_exchange``.

After each round the harness checks that every rank reached the same decision, then removes the ready and
failed names from each rank's pending dict, as the engine does.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from perseus.engine.messages import DType, Entry, OpType, make_signature
from perseus.engine.negotiation import (FLAG_JOINED, FLAG_NONE_JOINED, FLAG_NO_EXCHANGE, FLAG_NOT_DIRTY, Negotiator, Registry,
                                        RoundResult)

pytestmark = pytest.mark.timeout(60)

SIZES = [1, 2, 3, 5]
MULTI = [2, 3, 5]


# ----------------------------------------------------------------------------- helpers

def _np_dtype(dtype: DType):
    return {DType.FLOAT32: np.float32, DType.FLOAT64: np.float64, DType.INT32: np.int32,
            DType.FLOAT16: np.float16, DType.BFLOAT16: np.uint16, DType.UINT8: np.uint8}[dtype]


def allreduce(name, shape=(4,), dtype=DType.FLOAT32, reduce_op=1, prescale=1.0, postscale=1.0, priority=0):
    sig = make_signature(OpType.ALLREDUCE, dtype, tuple(shape), reduce_op, -1, prescale, postscale, priority)
    return Entry(name, sig, tuple(shape), input=np.zeros(shape, _np_dtype(dtype)))


def allgather(name, shape, dtype=DType.FLOAT32, priority=0):
    shape = tuple(shape)
    # as perseus.common.collectives does: the signature excludes the first dimension
    sig = make_signature(OpType.ALLGATHER, dtype, shape[1:], priority=priority)
    return Entry(name, sig, shape, input=np.zeros(shape, _np_dtype(dtype)))


def broadcast(name, shape=(4,), root_rank=0, dtype=DType.FLOAT32):
    sig = make_signature(OpType.BROADCAST, dtype, tuple(shape), root_rank=root_rank)
    return Entry(name, sig, tuple(shape), input=np.zeros(shape, _np_dtype(dtype)))


class Rank:
    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.neg = Negotiator(rank, size)
        self.pending: dict[str, Entry] = {}
        self.dirty = False
        self.joined = False

    def submit(self, *entries: Entry) -> None:
        for e in entries:
            assert e.name not in self.pending
            self.pending[e.name] = e
        self.dirty = True


class Outcome:
    """What one simulated round decided (identical on every rank, checked by the harness)."""

    def __init__(self, result: RoundResult, words: np.ndarray, needs: list[bool], exchanged: bool,
                 ordered: list[str]):
        self.result = result
        self.ready = result.ready
        self.errors = result.errors
        self.words = words
        self.needs = needs
        self.exchanged = exchanged
        self.ordered = ordered


def make_ranks(n: int) -> list[Rank]:
    return [Rank(r, n) for r in range(n)]


def run_round(ranks: list[Rank], rank_names=None) -> Outcome:
    built = []
    for r in ranks:
        words, needs = r.neg.build_words(r.pending, r.dirty, r.joined)
        built.append((words.copy(), needs))
    lengths = {w.size for w, _ in built}
    assert len(lengths) == 1, f"ranks built word vectors of different lengths: {lengths}"
    anded = built[0][0].copy()
    for w, _ in built[1:]:
        anded &= w
    decoded = [r.neg.decode(anded.copy()) for r in ranks]
    exchange_flags = {ex for _, ex in decoded}
    assert len(exchange_flags) == 1
    (exchange,) = exchange_flags
    # the AND of the active-low NO_EXCHANGE flag: an exchange happens iff any rank needs one
    assert exchange == any(needs for _, needs in built)
    if exchange:
        payloads = [Negotiator.exchange_payload(r.pending, r.joined) for r in ranks]
        for r, (res, _) in zip(ranks, decoded):
            r.neg.apply_exchange(res, list(payloads), rank_names)
    results = [res for res, _ in decoded]
    first = results[0]
    orders = [r.neg.order(res.ready) for r, res in zip(ranks, results)]
    for r, res, ordered in zip(ranks, results, orders):
        assert res.ready == first.ready, f"rank {r.rank} ready {res.ready} != rank 0 ready {first.ready}"
        assert res.errors == first.errors, f"rank {r.rank} errors differ from rank 0"
        assert res.any_dirty == first.any_dirty
        assert res.all_joined == first.all_joined
        assert res.exchanged == first.exchanged == exchange
        assert ordered == orders[0]
        assert r.neg.registry.names == ranks[0].neg.registry.names
        assert r.neg.registry.signatures == ranks[0].neg.registry.signatures
        assert r.neg.registry.index == ranks[0].neg.registry.index
        assert set(res.ready).isdisjoint(res.errors)
        assert len(set(res.ready)) == len(res.ready), f"duplicate ready names {res.ready}"
    for r in ranks:
        for name in first.errors:
            r.pending.pop(name, None)
        for name in orders[0]:
            r.pending.pop(name, None)
        r.dirty = False
    return Outcome(first, anded, [needs for _, needs in built], exchange, orders[0])


def registry_of(ranks):
    return list(ranks[0].neg.registry.names)


def dedupe(seq):
    out = []
    for x in seq:
        if x not in out:
            out.append(x)
    return out


# ----------------------------------------------------------------------------- imports

@pytest.mark.parametrize("module", ["perseus.engine.negotiation", "perseus.engine.fusion",
                                    "perseus.engine.messages", "perseus.transport.kernels",
                                    "perseus.common.knobs"])
def test_module_imports_without_mpi4py(module):
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            "bad = sorted(m for m in sys.modules if m == 'mpi4py' or m.startswith('mpi4py.')); "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {module} pulled in {out.stdout.strip()}"


# ----------------------------------------------------------------------------- flags and words

def test_flags_are_distinct_single_bits():
    flags = [int(FLAG_NO_EXCHANGE), int(FLAG_NOT_DIRTY), int(FLAG_JOINED), int(FLAG_NONE_JOINED)]
    assert all(f and f & (f - 1) == 0 for f in flags)
    assert len(set(flags)) == 4


@pytest.mark.parametrize("dirty", [False, True])
@pytest.mark.parametrize("joined", [False, True])
def test_build_words_flags_of_idle_rank(dirty, joined):
    neg = Negotiator(0, 1)
    words, needs = neg.build_words({}, dirty, joined)
    assert needs is False
    assert words.dtype == np.uint64 and words.size == neg.registry.num_words
    expected = int(FLAG_NO_EXCHANGE)
    if not dirty:
        expected |= int(FLAG_NOT_DIRTY)
    if joined:
        expected |= int(FLAG_JOINED)
    else:
        expected |= int(FLAG_NONE_JOINED)
    assert int(words[0]) == expected


def test_build_words_new_name_clears_no_exchange():
    neg = Negotiator(0, 2)
    words, needs = neg.build_words({"a": allreduce("a")}, False, False)
    assert needs is True
    assert not int(words[0]) & int(FLAG_NO_EXCHANGE)
    assert int(words[0]) & int(FLAG_NOT_DIRTY)


def test_registry_num_words():
    reg = Registry()
    assert reg.num_words == 1 and len(reg) == 0
    sig = make_signature(OpType.ALLREDUCE, DType.FLOAT32, (1,))
    previous = reg.num_words
    for i in range(130):
        assert reg.add(f"t{i}", sig) == i
        # one flag word plus at least one readiness bit per index
        assert reg.num_words >= 1 + (i + 1 + 63) // 64
        assert reg.num_words >= previous
        previous = reg.num_words
    assert reg.names[129] == "t129" and reg.index["t64"] == 64


# ----------------------------------------------------------------------------- first round / steady state

@pytest.mark.parametrize("n", SIZES)
def test_first_round_exchanges_and_assigns_indices_in_first_appearance_order(n):
    ranks = make_ranks(n)
    base = ["w", "x", "y", "z"]
    for r in ranks:
        rotated = base[r.rank % 4:] + base[:r.rank % 4]
        r.submit(*[allreduce(name) for name in rotated])
    out = run_round(ranks)
    assert out.exchanged
    assert all(out.needs)
    assert registry_of(ranks) == base  # rank 0's order
    for r in ranks:
        assert r.neg.registry.index == {"w": 0, "x": 1, "y": 2, "z": 3}
    assert sorted(out.ready) == sorted(base)
    assert out.ordered == base  # same priority: by index
    assert out.errors == {}
    assert all(not r.pending for r in ranks)


@pytest.mark.parametrize("n", MULTI)
def test_indices_follow_rank0_then_later_ranks_new_names(n):
    ranks = make_ranks(n)
    per_rank = []
    for r in ranks:
        names = [f"common{k}" for k in ((0, 1, 2) if r.rank % 2 == 0 else (2, 1, 0))] + [f"only{r.rank}", "shared"]
        per_rank.append(names)
        r.submit(*[allreduce(nm) for nm in names])
    out = run_round(ranks)
    assert out.exchanged
    expected_registry = dedupe([nm for names in per_rank for nm in names])
    assert registry_of(ranks) == expected_registry
    assert registry_of(ranks)[:5] == ["common0", "common1", "common2", "only0", "shared"]
    # names submitted everywhere are ready; rank-only names stay pending on their own rank
    assert sorted(out.ready) == ["common0", "common1", "common2", "shared"]
    assert out.ordered == ["common0", "common1", "common2", "shared"]
    for r in ranks:
        assert list(r.pending) == [f"only{r.rank}"]


@pytest.mark.parametrize("n", SIZES)
def test_steady_state_needs_no_exchange_and_readiness_comes_from_bits(n):
    ranks = make_ranks(n)
    names = ["a", "b", "c"]
    for r in ranks:
        r.submit(*[allreduce(nm, shape=(3, i + 1)) for i, nm in enumerate(names)])
    run_round(ranks)
    registry_before = registry_of(ranks)
    sigs_before = list(ranks[0].neg.registry.signatures)
    for step in range(3):
        for r in ranks:
            r.submit(*[allreduce(nm, shape=(3, i + 1)) for i, nm in enumerate(names)])
        out = run_round(ranks)
        assert not out.exchanged
        assert out.needs == [False] * n
        assert int(out.words[0]) & int(FLAG_NO_EXCHANGE)
        assert out.ready == names
        assert out.result.exchanged is False
        assert registry_of(ranks) == registry_before
        assert ranks[0].neg.registry.signatures == sigs_before
        assert all(not r.pending for r in ranks)


@pytest.mark.parametrize("n", SIZES)
def test_steady_state_subset_ready_in_index_order(n):
    ranks = make_ranks(n)
    names = [f"t{i}" for i in range(6)]
    for r in ranks:
        r.submit(*[allreduce(nm) for nm in names])
    run_round(ranks)
    for r in ranks:  # submission order differs from index order
        r.submit(allreduce("t4"), allreduce("t1"), allreduce("t3"))
    out = run_round(ranks)
    assert not out.exchanged
    assert out.ready == ["t1", "t3", "t4"]


@pytest.mark.parametrize("n", MULTI)
def test_name_pending_on_some_ranks_is_not_ready_and_stays_pending(n):
    ranks = make_ranks(n)
    for r in ranks:
        r.submit(allreduce("known"))
    run_round(ranks)

    # a known name pending only on rank 0: bits are not all set, no exchange is needed
    ranks[0].submit(allreduce("known"))
    out = run_round(ranks)
    assert not out.exchanged and out.ready == [] and out.errors == {}
    assert list(ranks[0].pending) == ["known"]

    # a new name pending only on the first n-1 ranks: exchange, indexed, but not ready
    for r in ranks[:-1]:
        r.submit(allreduce("new"))
    out = run_round(ranks)
    assert out.exchanged
    assert out.ready == [] and out.errors == {}
    assert registry_of(ranks) == ["known", "new"]
    for r in ranks[:-1]:
        assert sorted(r.pending) == (["known", "new"] if r.rank == 0 else ["new"])
    assert ranks[-1].pending == {}

    # nothing changes in another round (no livelock of exchanges either: everything is indexed)
    out = run_round(ranks)
    assert not out.exchanged and out.ready == []

    # the last rank submits both: they become ready from the bits alone
    ranks[-1].submit(allreduce("new"))
    for r in ranks[1:]:
        r.submit(allreduce("known"))
    out = run_round(ranks)
    assert not out.exchanged
    assert out.ready == ["known", "new"]
    assert all(not r.pending for r in ranks)


def test_single_rank_round_trip():
    (r,) = ranks = make_ranks(1)
    r.submit(allreduce("only"))
    out = run_round(ranks)
    assert out.exchanged and out.ready == ["only"]
    r.submit(allreduce("only"))
    out = run_round(ranks)
    assert not out.exchanged and out.ready == ["only"]


# ----------------------------------------------------------------------------- mismatches

MISMATCHES = {
    # kind: (entry on the agreeing ranks, entry on the last rank, field label, value shown for A, for B)
    "shape": (lambda: allreduce("t", shape=(2, 3)), lambda: allreduce("t", shape=(2, 4)),
              "shape", "(2, 3)", "(2, 4)"),
    "dtype": (lambda: allreduce("t", dtype=DType.FLOAT32), lambda: allreduce("t", dtype=DType.FLOAT64),
              "dtype", "float32", "float64"),
    "op": (lambda: allreduce("t"), lambda: broadcast("t", root_rank=0),
           "op_type", "allreduce", "broadcast"),
    "root": (lambda: broadcast("t", root_rank=0), lambda: broadcast("t", root_rank=1),
             "root_rank", "0", "1"),
    "reduce_op": (lambda: allreduce("t", reduce_op=1), lambda: allreduce("t", reduce_op=4),
                  "reduce_op", "Sum", "Max"),
    "prescale": (lambda: allreduce("t", prescale=1.0), lambda: allreduce("t", prescale=0.5),
                 "prescale_factor", "1.0", "0.5"),
    "priority": (lambda: allreduce("t", priority=0), lambda: allreduce("t", priority=3),
                 "priority", "0", "3"),
}


@pytest.mark.parametrize("n", MULTI)
@pytest.mark.parametrize("kind", sorted(MISMATCHES))
def test_mismatch_raised_on_every_rank_only_once_everyone_submitted(n, kind):
    make_a, make_b, label, shown_a, shown_b = MISMATCHES[kind]
    ranks = make_ranks(n)
    ranks[0].submit(make_a())
    ranks[-1].submit(make_b())
    out = run_round(ranks)
    if n > 2:
        # ranks 1..n-2 have not submitted: no error yet, and no index for the disputed name
        assert out.errors == {} and out.ready == []
        assert "t" not in ranks[0].neg.registry.index
        assert "t" in ranks[0].pending and "t" in ranks[-1].pending
        out2 = run_round(ranks)  # still waiting
        assert out2.errors == {} and out2.ready == []
        for r in ranks[1:-1]:
            r.submit(make_a())
        out = run_round(ranks)
    assert list(out.errors) == ["t"]
    assert out.ready == []
    msg = out.errors["t"]
    agreeing = list(range(n - 1))
    assert "'t'" in msg
    assert f"ranks {[n - 1]}" in msg
    assert f"ranks {agreeing}" in msg
    assert f"{label} {shown_b}" in msg
    assert shown_a in msg
    assert msg.index(f"ranks {[n - 1]}") < msg.index(shown_b) < msg.index(f"ranks {agreeing}") < msg.rindex(shown_a)
    # every rank dropped the failed request
    assert all("t" not in r.pending for r in ranks)


def test_mismatch_message_exact_text_for_shape():
    ranks = make_ranks(2)
    ranks[0].submit(allreduce("grad/w", shape=(2, 3)))
    ranks[1].submit(allreduce("grad/w", shape=(3, 2)))
    out = run_round(ranks)
    assert out.errors == {
        "grad/w": "perseus.allreduce('grad/w'): ranks [1] sent shape (3, 2) but ranks [0] sent (2, 3); "
                  "every rank must submit the same shape for a name."}


def test_mismatch_message_uses_rank_names():
    ranks = make_ranks(3)
    ranks[0].submit(allreduce("t", dtype=DType.FLOAT32))
    ranks[1].submit(allreduce("t", dtype=DType.INT32))
    ranks[2].submit(allreduce("t", dtype=DType.FLOAT32))
    out = run_round(ranks, rank_names=[4, 7, 9])
    msg = out.errors["t"]
    assert "ranks [7] sent dtype int32" in msg
    assert "ranks [4, 9] sent float32" in msg


@pytest.mark.parametrize("n", MULTI)
def test_mismatch_of_one_name_does_not_block_others(n):
    ranks = make_ranks(n)
    for r in ranks:
        r.submit(allreduce("good1"), allreduce("bad", shape=(r.rank + 1,)), allreduce("good2"))
    out = run_round(ranks)
    assert sorted(out.ready) == ["good1", "good2"]
    assert list(out.errors) == ["bad"]
    assert "(1,)" in out.errors["bad"] and "(2,)" in out.errors["bad"]


@pytest.mark.parametrize("n", SIZES)
def test_allgather_first_dimension_may_differ(n):
    ranks = make_ranks(n)
    for r in ranks:
        r.submit(allgather("g", (r.rank + 1, 3)))
    out = run_round(ranks)
    assert out.errors == {} and out.ready == ["g"]
    assert ranks[0].neg.registry.signatures[0].shape == (3,)
    # the next step, with other first dimensions on every rank: steady state, no exchange
    for r in ranks:
        r.submit(allgather("g", (2 * r.rank + 5, 3)))
    out = run_round(ranks)
    assert not out.exchanged and out.errors == {} and out.ready == ["g"]


@pytest.mark.parametrize("n", MULTI)
def test_allgather_trailing_dimension_mismatch(n):
    ranks = make_ranks(n)
    for r in ranks:
        r.submit(allgather("g", (r.rank + 1, 3 if r.rank < n - 1 else 4)))
    out = run_round(ranks)
    assert out.ready == []
    msg = out.errors["g"]
    assert "shape after the first dimension (4,)" in msg and "(3,)" in msg
    assert "perseus.allgather('g')" in msg


@pytest.mark.parametrize("n", MULTI)
def test_changed_signature_on_one_rank_against_cache_is_a_mismatch(n):
    ranks = make_ranks(n)
    for r in ranks:
        r.submit(allreduce("t", shape=(8,)))
    run_round(ranks)
    # rank 0 changes the shape; the others send the cached signature (their readiness bit is set)
    ranks[0].submit(allreduce("t", shape=(9,)))
    for r in ranks[1:]:
        r.submit(allreduce("t", shape=(8,)))
    out = run_round(ranks)
    assert out.needs[0] is True and not any(out.needs[1:])
    assert out.exchanged
    assert out.ready == []
    msg = out.errors["t"]
    assert f"ranks {list(range(1, n))} sent shape (8,)" in msg and "ranks [0] sent (9,)" in msg
    assert all(not r.pending for r in ranks)


@pytest.mark.parametrize("n", MULTI)
def test_changed_signature_submitted_before_the_others_still_errors(n):
    ranks = make_ranks(n)
    for r in ranks:
        r.submit(allreduce("t", shape=(8,)))
    run_round(ranks)
    ranks[-1].submit(allreduce("t", shape=(2, 4)))
    for _ in range(3):  # nobody else has submitted: waits, no error, no ready
        out = run_round(ranks)
        assert out.errors == {} and out.ready == []
    assert ranks[0].neg.registry.signatures[0].shape == (8,)
    for r in ranks[:-1]:
        r.submit(allreduce("t", shape=(8,)))
    out = run_round(ranks)
    assert list(out.errors) == ["t"] and out.ready == []
    assert "(2, 4)" in out.errors["t"] and "(8,)" in out.errors["t"]


@pytest.mark.parametrize("n", SIZES)
def test_signature_changed_on_every_rank_is_accepted_and_recorded(n):
    ranks = make_ranks(n)
    for r in ranks:
        r.submit(allreduce("t", shape=(8,)))
    run_round(ranks)
    for r in ranks:
        r.submit(allreduce("t", shape=(16,)))
    out = run_round(ranks)
    assert out.exchanged and out.errors == {} and out.ready == ["t"]
    assert registry_of(ranks) == ["t"]
    assert ranks[0].neg.registry.signatures[0].shape == (16,)
    for r in ranks:
        r.submit(allreduce("t", shape=(16,)))
    out = run_round(ranks)
    assert not out.exchanged and out.ready == ["t"]


# ----------------------------------------------------------------------------- join

@pytest.mark.parametrize("n", MULTI)
def test_joined_ranks_make_tensors_of_the_others_ready(n):
    ranks = make_ranks(n)
    joined = {n - 1} if n < 5 else {1, 4}
    for r in ranks:
        r.joined = r.rank in joined
    active = [r for r in ranks if not r.joined]
    for r in active:
        r.submit(allreduce("g"), allgather("h", (r.rank + 1, 2)))
    out = run_round(ranks)
    assert out.exchanged
    assert sorted(out.ready) == ["g", "h"]
    assert out.result.all_joined is False
    assert not int(out.words[0]) & int(FLAG_JOINED)
    # steady state: the joined ranks set every bit, the others set the bits of what they submitted
    for r in active:
        r.submit(allreduce("g"), allgather("h", (1, 2)))
    out = run_round(ranks)
    assert not out.exchanged and out.ready == ["g", "h"]
    if len(active) >= 2:
        # a name only some active ranks submitted is not ready
        active[0].submit(allreduce("g"))
        out = run_round(ranks)
        assert out.ready == []
        assert list(active[0].pending) == ["g"]
        for r in active[1:]:
            r.submit(allreduce("g"))
        out = run_round(ranks)
        assert out.ready == ["g"] and not out.exchanged
    # a known name no rank submitted is never ready, even though the joined ranks set every bit
    out = run_round(ranks)
    assert out.ready == []


@pytest.mark.parametrize("n", MULTI)
def test_joined_rank_does_not_make_names_pending_nowhere_ready(n):
    ranks = make_ranks(n)
    for r in ranks:
        r.submit(allreduce("a"), allreduce("b"))
    run_round(ranks)
    ranks[-1].joined = True
    for r in ranks[:-1]:
        r.submit(allreduce("b"))
    out = run_round(ranks)
    assert out.ready == ["b"]


@pytest.mark.parametrize("n", SIZES)
def test_joined_flag_survives_only_when_every_rank_joined(n):
    ranks = make_ranks(n)
    for k in range(n + 1):
        for r in ranks:
            r.joined = r.rank < k
        out = run_round(ranks)
        assert out.result.all_joined is (k == n)
        assert bool(int(out.words[0]) & int(FLAG_JOINED)) is (k == n)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_all_joined_with_nothing_pending_makes_nothing_ready(n):
    # Regression: a joined rank sets every readiness bit; when every rank has joined, known names that no
    # rank submitted must not be reported ready (the engine would run a phantom collective for each, and
    # abort on the root rank of a registered broadcast).
    ranks = make_ranks(n)
    for r in ranks:
        r.submit(allreduce("a"), broadcast("b", root_rank=0))
    out = run_round(ranks)
    assert sorted(out.ready) == ["a", "b"]
    for r in ranks:
        r.joined = True
    out = run_round(ranks)
    assert out.result.all_joined
    assert out.ready == []


# ----------------------------------------------------------------------------- dirty

@pytest.mark.parametrize("n", SIZES)
def test_any_dirty_reflects_every_rank(n):
    ranks = make_ranks(n)
    for dirty_set in [set(), {0}, {n - 1}, set(range(n))]:
        for r in ranks:
            r.dirty = r.rank in dirty_set
        words = [r.neg.build_words(r.pending, r.dirty, r.joined)[0].copy() for r in ranks]
        anded = words[0].copy()
        for w in words[1:]:
            anded &= w
        for r in ranks:
            res, exchange = r.neg.decode(anded.copy())
            assert res.any_dirty is bool(dirty_set)
            assert exchange is False
            assert res.ready == []


# ----------------------------------------------------------------------------- order

def test_order_by_priority_then_index():
    ranks = make_ranks(2)
    prios = {"a": 0, "b": 5, "c": 0, "d": -1, "e": 5, "f": 2}
    for r in ranks:
        r.submit(*[allreduce(nm, priority=p) for nm, p in prios.items()])
    out = run_round(ranks)
    expected = ["b", "e", "f", "a", "c", "d"]
    assert out.ordered == expected
    neg = ranks[1].neg
    assert neg.order(["d", "c", "e", "a"]) == ["e", "a", "c", "d"]
    assert neg.order([]) == []


# ----------------------------------------------------------------------------- many names

@pytest.mark.parametrize("n", SIZES)
def test_two_hundred_names_over_several_words(n):
    ranks = make_ranks(n)
    names = [f"layer{i:03d}" for i in range(200)]
    for r in ranks:
        order = names if r.rank == 0 else names[r.rank:] + names[:r.rank]
        r.submit(*[allreduce(nm, shape=(i % 7 + 1,)) for nm, i in ((nm, int(nm[5:])) for nm in order)])
    out = run_round(ranks)
    assert out.exchanged
    assert registry_of(ranks) == names
    assert sorted(out.ready) == names
    assert ranks[0].neg.registry.num_words >= 1 + 4

    subset = sorted({0, 1, 62, 63, 64, 65, 127, 128, 129, 190, 191, 192, 199} | set(range(3, 200, 17)))
    for r in ranks:
        for i in reversed(subset):
            r.submit(allreduce(names[i], shape=(i % 7 + 1,)))
    # one extra name only on rank 0, in the 4th data word
    ranks[0].submit(allreduce(names[150], shape=(150 % 7 + 1,)))
    out = run_round(ranks)
    assert not out.exchanged
    assert out.words.size == ranks[0].neg.registry.num_words
    expected_ready = sorted(subset + ([150] if n == 1 else []))
    assert out.ready == [names[i] for i in expected_ready]
    if n > 1:
        assert list(ranks[0].pending) == [names[150]]


@pytest.mark.parametrize("n", [2, 3])
def test_names_added_over_rounds_grow_the_word_vector(n):
    ranks = make_ranks(n)
    total = 0
    for batch in range(4):
        new = [f"b{batch}_{k}" for k in range(50)]
        total += len(new)
        for r in ranks:
            r.submit(*[allreduce(nm) for nm in new])
        out = run_round(ranks)
        assert out.exchanged and sorted(out.ready) == sorted(new)
        assert len(ranks[0].neg.registry) == total
        words, _ = ranks[0].neg.build_words({}, False, False)
        assert words.size == ranks[0].neg.registry.num_words >= 1 + (total + 63) // 64
    # steady state with all 200: one name from each batch
    picks = ["b0_49", "b1_13", "b2_0", "b3_49"]
    for r in ranks:
        r.submit(*[allreduce(nm) for nm in picks])
    out = run_round(ranks)
    assert not out.exchanged and out.ready == picks
    assert [ranks[0].neg.registry.index[p] for p in picks] == [49, 63, 100, 199]


# ----------------------------------------------------------------------------- bounded registry

def evict_all(ranks, capacity, round_):
    dropped = [r.neg.registry.evict(capacity) for r in ranks]
    assert all(d == dropped[0] for d in dropped)
    return dropped[0]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_registry_evicts_least_recently_used_identically(n):
    ranks = make_ranks(n)
    for step, names in enumerate([["a", "b", "c"], ["a", "d"], ["a", "b"]]):
        for r in ranks:
            r.submit(*[allreduce(x) for x in names])
        out = run_round(ranks)
        assert sorted(out.ready) == sorted(names)
        for r in ranks:
            r.neg.registry.touch(out.ready, step)
        dropped = evict_all(ranks, 3, step)
        for r in ranks:
            assert r.neg.registry.live <= 3
        # round 1: b and c were last used in round 0 and b has the lower index; round 2: c is the oldest
        assert dropped == {0: [], 1: ["b"], 2: ["c"]}[step]
    # Indices stay identical on every rank; b came back through an exchange into its old (lowest free) slot.
    assert registry_of(ranks) == ["a", "b", None, "d"]


def test_evicted_name_is_renegotiated_and_slot_reused():
    ranks = make_ranks(2)
    for r in ranks:
        r.submit(allreduce("a"), allreduce("b"))
    run_round(ranks)
    for r in ranks:
        r.neg.registry.touch(["a"], 5)  # a used more recently than b
    assert evict_all(ranks, 1, 5) == ["b"]
    freed = ranks[0].neg.registry.names.index(None)
    for r in ranks:
        r.submit(allreduce("c"))
    out = run_round(ranks)
    assert out.exchanged and out.ready == ["c"]
    assert ranks[0].neg.registry.index["c"] == freed  # the lowest free index is reused
    for r in ranks:
        r.submit(allreduce("b"))
    out = run_round(ranks)
    assert out.exchanged and out.ready == ["b"]


def test_capacity_zero_negotiates_every_time():
    ranks = make_ranks(2)
    for _ in range(3):
        for r in ranks:
            r.submit(allreduce("x"))
        out = run_round(ranks)
        assert out.exchanged and out.ready == ["x"]
        evict_all(ranks, 0, 0)
        assert ranks[0].neg.registry.live == 0
