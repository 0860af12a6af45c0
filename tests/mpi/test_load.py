"""Load: one step of 10,000 small tensors, and eight process sets driven at once from eight threads on each rank.

Every result is checked. Rank 0 prints the figures (run with -s to see them).
"""

import itertools
import threading
import time

import pytest
import torch

from perseus.runtime.state import runtime

pytestmark = pytest.mark.timeout(300)

N_SMALL = 10_000
THREADS = 8
ITERATIONS = 300  # per thread, each a round of every collective kind (9 collectives)


def _say(hvd, text):
    if hvd.rank() == 0:
        print(f"\n[load] {text} ({hvd.size()} ranks)", flush=True)


def _small_step(hvd, step):
    """Start N_SMALL allreduces of 1..64 float32 elements, then synchronize every handle; return the results
    and the seconds the step took."""
    rank = hvd.rank()
    tensors = [torch.full((1 + i % 64,), float(rank + i + step)) for i in range(N_SMALL)]
    started = time.monotonic()
    handles = [hvd.allreduce_async(t, op=hvd.Sum, name=f"load.small.{i}") for i, t in enumerate(tensors)]
    outs = [hvd.synchronize(h) for h in handles]
    return outs, time.monotonic() - started


def test_ten_thousand_small_tensors_in_one_step(hvd):
    size = hvd.size()
    ranks_sum = size * (size - 1) // 2
    times = []
    for step in range(3):  # the first step registers the names; the later ones reuse them
        outs, took = _small_step(hvd, step)
        times.append(took)
        flat = torch.cat(outs)
        counts = torch.tensor([1 + i % 64 for i in range(N_SMALL)])
        expect = torch.repeat_interleave(torch.arange(N_SMALL, dtype=torch.float32) * size + ranks_sum + size * step,
                                         counts)
        assert torch.equal(flat, expect), f"step {step}: wrong sums"
        assert [o.shape[0] for o in outs] == counts.tolist()
    _say(hvd, f"{N_SMALL} small allreduces, async then synchronize: step times "
              f"{', '.join(f'{t * 1e3:.0f} ms' for t in times)}")


def _sets_of_eight(hvd):
    """Process sets such that every rank belongs to eight: the global set, every smaller set of ranks that
    add_process_set admits (each rank list once; at 2 and 3 ranks), and as many more sets over every rank,
    registered the way perseus registers its own sets that may share ranks with another. Every rank registers
    the same sets in the same order."""
    size = hvd.size()
    per_rank = 2 ** (size - 1)  # sets each rank is in: the global one and every smaller set containing it
    subsets = [list(c) for k in range(size - 1, 0, -1) for c in itertools.combinations(range(size), k)] \
        if per_rank <= THREADS else []
    public = [hvd.add_process_set(r) for r in subsets]
    extra = [runtime().register(hvd.ProcessSet(list(range(size))), hidden=True)
             for _ in range(THREADS - (per_rank if subsets else 1))]
    return [hvd.global_process_set] + public + extra


def _drive(hvd, ps, idx, iterations, done):
    """Run iterations rounds of every collective on ps (this rank is a member) and check each result."""
    me, n, ranks = ps.rank(), ps.size(), ps.ranks
    rank = hvd.rank()
    for i in range(iterations):
        tag = f"set{idx}.{i % 7}"
        x = torch.full((3 + i % 5,), float(rank + i))
        out = hvd.allreduce(x, op=hvd.Sum, name=f"{tag}.ar", process_set=ps)
        assert torch.all(out == sum(ranks) + n * i), (idx, i, "allreduce", out)
        g = hvd.allgather(torch.full((1 + i % 2, 2), rank, dtype=torch.int32), name=f"{tag}.ag", process_set=ps)
        assert g[:, 0].tolist() == [r for r in ranks for _ in range(1 + i % 2)], (idx, i, "allgather", g)
        root = ranks[i % n]  # a rank of the job
        b = hvd.broadcast(torch.full((4,), float(rank * 10 + i)), root, name=f"{tag}.bc", process_set=ps)
        assert torch.all(b == root * 10 + i), (idx, i, "broadcast", b)
        a = hvd.alltoall(torch.full((2 * n,), rank, dtype=torch.int64), name=f"{tag}.a2a", process_set=ps)
        assert a.tolist() == [r for r in ranks for _ in range(2)], (idx, i, "alltoall", a)
        rs = hvd.reducescatter(torch.full((2 * n, 3), float(i)), op=hvd.Sum, name=f"{tag}.rs", process_set=ps)
        assert rs.shape == (2, 3) and torch.all(rs == n * i), (idx, i, "reducescatter", rs)
        handles = [hvd.allreduce_async(torch.full((2,), float(k + me)), op=hvd.Sum, name=f"{tag}.async{k}",
                                       process_set=ps) for k in range(4)]
        for k, h in enumerate(handles):
            assert torch.all(hvd.synchronize(h) == n * k + n * (n - 1) // 2), (idx, i, "async", k)
        done[idx] += 1


def test_eight_process_sets_from_eight_threads(hvd):
    sets = _sets_of_eight(hvd)
    assert len({ps.process_set_id for ps in sets}) == len(sets)
    done = [0] * len(sets)
    errors = []

    spans = {}

    def run(idx, ps):
        began = time.monotonic()
        try:
            _drive(hvd, ps, idx, ITERATIONS, done)
        except BaseException as e:  # reported below, with the set
            errors.append((idx, ps.ranks, repr(e)))
        spans[idx] = (began, time.monotonic())

    threads = [threading.Thread(target=run, args=(i, ps), daemon=True, name=f"load-set-{i}")
               for i, ps in enumerate(sets) if ps.included()]
    assert len(threads) == THREADS
    started = time.monotonic()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        took = time.monotonic() - started
        assert not any(t.is_alive() for t in threads), f"threads still running after 240 s; rounds done {done}"
        assert not errors, errors
        mine = [i for i, ps in enumerate(sets) if ps.included()]
        assert [done[i] for i in mine] == [ITERATIONS] * len(mine)
        # Every thread was at work at once (the last one started before the first one finished).
        together = min(e for _, e in spans.values()) - max(b for b, _ in spans.values())
        assert together > 0, spans
    finally:
        for ps in sets[1:]:
            runtime().remove_process_set(ps)
    collectives = len(threads) * ITERATIONS * 9
    _say(hvd, f"{len(threads)} threads, each on its own process set (of {len(sets)}: {[ps.ranks for ps in sets]}): "
              f"{collectives} collectives on rank 0 in {took:.1f} s ({collectives / took:.0f} a second), all eight "
              f"threads at work together for {together:.1f} s")
    # The sets are gone and the global set still works.
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="load.after").item() == hvd.size()
