"""init() chooses the channel count from the hosts the job spans when PERSEUS_NUM_CHANNELS is unset: 1 on one
host, CROSS_HOST_CHANNELS across hosts; a count the user sets wins; the autotuner starts from the choice.

The ranks of this job share one host. To see the cross-host rule at work, one test fakes the host grouping:
the start-up's topology exchange is wrapped so that every rank reports a host of its own (as on a cluster with
one rank per host), which also makes the engine connect its channels over TCP links (on loopback), as
between real hosts.
"""

import pytest
import torch

from job_env import restart
from perseus.runtime import startup
from perseus.runtime.state import runtime
from perseus.engine.settings import CROSS_HOST_CHANNELS

pytestmark = pytest.mark.timeout(180)

UNSET = {"PERSEUS_NUM_CHANNELS": None, "PERSEUS_MAX_CHANNELS": None, "PERSEUS_AUTOTUNE": None,
         "HOROVOD_AUTOTUNE": None}
BIG = 1 << 20  # float32 elements: 4 MB, one unit each


def in_use():
    """(channels the settings report, channels the engine runs on the global set, set explicitly)."""
    settings = runtime().settings
    return settings.num_channels, runtime().engine.params(0)[2], settings.is_explicit("num_channels")


@pytest.fixture
def every_rank_a_host(monkeypatch, hvd):
    """Until ``undo()`` is called on the returned monkeypatch, init() sees each rank on a host of its own (a
    test must undo it before its last restart, so that later tests get the real topology)."""
    if hvd.size() < 2:
        pytest.skip("needs at least 2 ranks")
    real = startup.topology

    def fake(MPI, base):
        rank, size = real(MPI, base)[:2]
        return rank, size, 0, 1, rank, size, True, rank  # local 0/1, cross rank/size, host key = rank

    monkeypatch.setattr(startup, "topology", fake)
    yield monkeypatch


def test_one_host_gets_one_channel_by_default(hvd):
    old = restart(hvd, UNSET)
    try:
        assert in_use() == (1, 1, False)
    finally:
        restart(hvd, old)


def test_an_explicit_count_wins_on_one_host(hvd):
    old = restart(hvd, {**UNSET, "PERSEUS_NUM_CHANNELS": "3"})
    try:
        assert in_use() == (3, 3, True)
    finally:
        restart(hvd, old)


def test_ranks_on_several_hosts_get_several_channels(hvd, every_rank_a_host):
    old = restart(hvd, {**UNSET, "PERSEUS_NETWORK_INTERFACE": "lo"})
    try:
        assert hvd.cross_size() == hvd.size() and hvd.local_size() == 1
        assert in_use() == (CROSS_HOST_CHANNELS, CROSS_HOST_CHANNELS, False)
        xs = [torch.full((BIG,), float(hvd.rank() + 1)) for _ in range(2 * CROSS_HOST_CHANNELS)]
        for h in [hvd.allreduce_async_(x, op=hvd.Sum, name=f"by_topology.{i}") for i, x in enumerate(xs)]:
            hvd.synchronize(h)
        want = float(hvd.size() * (hvd.size() + 1) // 2)
        assert all(torch.equal(x, torch.full((BIG,), want)) for x in xs)
        restart(hvd, {"PERSEUS_NUM_CHANNELS": "2"})
        assert in_use() == (2, 2, True)
    finally:
        every_rank_a_host.undo()
        restart(hvd, old)


def test_the_autotuner_starts_from_the_chosen_count(hvd, every_rank_a_host):
    old = restart(hvd, {**UNSET, "PERSEUS_NETWORK_INTERFACE": "lo", "PERSEUS_AUTOTUNE": "1",
                        "PERSEUS_CACHE_DIR": "/proc/perseus-test-no-cache"})
    try:
        tuner = runtime().service("tuner")
        assert tuner is not None and tuner.initial.channels == CROSS_HOST_CHANNELS
        assert len(tuner.space.channels) > 1 and max(tuner.space.channels) >= CROSS_HOST_CHANNELS  # tuned
    finally:
        every_rank_a_host.undo()
        restart(hvd, old)
