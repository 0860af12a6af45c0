"""Process sets: static (at init), dynamic (add/remove), and collectives restricted to a set."""

import pytest
import torch

pytestmark = [pytest.mark.timeout(120), pytest.mark.rank_count]


def test_global_set(hvd):
    assert hvd.global_process_set.process_set_id == 0
    assert hvd.global_process_set.size() == hvd.size()
    assert hvd.global_process_set.rank() == hvd.rank()
    assert hvd.global_process_set.included()
    ids = hvd.mpi_ops._basics._get_process_set_ids_and_ranks()
    assert ids[0] == list(range(hvd.size()))


def test_dynamic_sets_from_mpi4py_communicators(hvd):
    """add_process_set(comm): each rank passes its own communicator (Split: one per colour; Create_group: null
    outside it); every distinct set is registered on every rank, each rank gets its own."""
    from mpi4py import MPI

    from perseus.runtime.state import runtime

    size, rank = hvd.size(), hvd.rank()
    before = set(runtime()._sets)
    split = MPI.COMM_WORLD.Split(rank % 2, rank)
    first = MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl([0]))
    try:
        mine = hvd.add_process_set(split)
        assert mine.ranks == list(range(rank % 2, size, 2)) and mine.included()
        added = sorted(ps.ranks for ps_id, ps in runtime()._sets.items() if ps_id not in before)
        assert added == sorted([list(range(c, size, 2)) for c in range(min(size, 2))])
        out = hvd.allreduce(torch.full((3,), float(rank)), op=hvd.Sum, name="ps_comm", process_set=mine)
        assert out.tolist() == [float(sum(mine.ranks))] * 3
        if size > 2:  # ([0] alone is one of the split sets at 1 and 2 ranks)
            solo = hvd.add_process_set(hvd.ProcessSet(first))
            assert solo.ranks == [0] and solo.included() == (rank == 0)
    finally:
        for ps_id in sorted(set(runtime()._sets) - before):  # (the same order on every rank)
            assert hvd.remove_process_set(runtime()._sets[ps_id])
        split.Free()
        if first != MPI.COMM_NULL:
            first.Free()


def test_dynamic_sets(hvd):
    size, rank = hvd.size(), hvd.rank()
    evens = hvd.add_process_set(list(range(0, size, 2)))
    odds = hvd.add_process_set(hvd.ProcessSet(list(range(1, size, 2)))) if size > 1 else None
    try:
        ids = hvd.mpi_ops._basics._get_process_set_ids_and_ranks()
        assert ids[evens.process_set_id] == list(range(0, size, 2))
        for ps in (evens, odds):
            if ps is None:
                continue
            if rank in ps.ranks:
                assert ps.included() and ps.rank() == ps.ranks.index(rank) and ps.size() == len(ps.ranks)
                x = torch.full((5,), float(rank))
                out = hvd.allreduce(x, op=hvd.Sum, name="ps_sum", process_set=ps)
                assert out.tolist() == [float(sum(ps.ranks))] * 5
                g = hvd.allgather(torch.tensor([rank]), name="ps_gather", process_set=ps)
                assert g.tolist() == ps.ranks
                b = hvd.broadcast(torch.tensor([rank]), ps.ranks[0], name="ps_bcast", process_set=ps)
                assert b.tolist() == [ps.ranks[0]]
                rs = hvd.reducescatter(torch.ones(ps.size() * 2), op=hvd.Sum, name="ps_rs", process_set=ps)
                assert rs.tolist() == [float(ps.size())] * 2
                a2a = hvd.alltoall(torch.full((ps.size(),), float(rank)), name="ps_a2a", process_set=ps)
                assert a2a.tolist() == [float(r) for r in ps.ranks]
                hvd.barrier(process_set=ps)
            else:
                assert ps.included() is False and ps.rank() == -1
                with pytest.raises(ValueError, match="not a member"):
                    hvd.allreduce(torch.ones(1), name="ps_not_member", process_set=ps)
        # The same names on the global set do not collide with the set's names.
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="ps_sum").item() == size
        with pytest.raises(ValueError, match="already been registered"):
            hvd.add_process_set(list(range(0, size, 2)))
        with pytest.raises(ValueError, match="subset"):
            hvd.add_process_set([size + 5])
    finally:
        assert hvd.remove_process_set(evens)
        if odds is not None:
            assert hvd.remove_process_set(odds)
    assert evens.process_set_id is None
    assert not hvd.remove_process_set(evens)
    assert not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError):
        hvd.allreduce(torch.ones(1), name="removed", process_set=evens)


def test_static_sets_at_init(hvd):
    size, rank = hvd.size(), hvd.rank()
    hvd.shutdown()
    with pytest.raises(ValueError, match="not been initialized"):  # the global set needs a running perseus
        hvd.global_process_set.rank()
    first = hvd.ProcessSet([0])
    rest = hvd.ProcessSet(list(range(1, size))) if size > 1 else None
    sets = [first] + ([rest] if rest else [])
    hvd.init(process_sets=sets)
    try:
        assert first.process_set_id == 1
        assert first.included() == (rank == 0) and hvd.global_process_set.rank() == rank
        mine = first if rank == 0 else rest
        out = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="static", process_set=mine)
        assert out.tolist() == [float(mine.size())] * 3
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="static").item() == size
    finally:
        hvd.shutdown()
        hvd.init()
    assert first.process_set_id is None


def test_process_set_from_comm(hvd):
    from mpi4py import MPI

    size, rank = hvd.size(), hvd.rank()
    if size < 2:
        pytest.skip("needs 2+ ranks")
    sub = MPI.COMM_WORLD.Split(0 if rank % 2 == 0 else MPI.UNDEFINED, rank)
    hvd.shutdown()
    ps = hvd.ProcessSet(sub)
    hvd.init(process_sets=[ps])
    try:
        assert ps.ranks == list(range(0, size, 2))
        if rank % 2 == 0:
            out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="from_comm", process_set=ps)
            assert out.tolist() == [float(ps.size())] * 2
    finally:
        hvd.shutdown()
        hvd.init()


def test_init_with_comm(hvd):
    from mpi4py import MPI

    hvd.shutdown()
    hvd.init(comm=MPI.COMM_WORLD)
    try:
        assert hvd.size() == MPI.COMM_WORLD.Get_size()
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="init_comm").item() == hvd.size()
    finally:
        hvd.shutdown()
        hvd.init()

