"""The settings init() chooses from the job's topology (perseus.runtime.startup.choose_by_topology): the channel
count when PERSEUS_NUM_CHANNELS is unset, 1 on one host and CROSS_HOST_CHANNELS across hosts, the same on every
rank, and a value the user set left alone. The tests fake the topology each rank sees."""

from __future__ import annotations

import logging

import pytest

from perseus.base.knobs import load_settings
from perseus.runtime.startup import choose_by_topology
from perseus.runtime.state import Topology
from perseus.engine.settings import CROSS_HOST_CHANNELS, topology_channels

pytestmark = pytest.mark.timeout(60)


def ranks_of(per_host: list[int]) -> list[Topology]:
    """The Topology every rank of a job with ``per_host[i]`` ranks on host i sees (ranks fill hosts in order),
    as perseus.runtime.startup.topology computes it."""
    out, first = [], 0
    for host, n in enumerate(per_host):
        for local_rank in range(n):
            cross = [h for h, m in enumerate(per_host) if m > local_rank]  # hosts with a rank of this local rank
            out.append(Topology(rank=first + local_rank, size=sum(per_host), local_rank=local_rank, local_size=n,
                                cross_rank=cross.index(host), cross_size=len(cross),
                                homogeneous=len(set(per_host)) == 1, host_key=first))
        first += n
    return out


def chosen(per_host: list[int], environ: dict | None = None) -> list[int]:
    """The channel count each rank's settings hold after choose_by_topology, rank by rank."""
    counts = []
    for topo in ranks_of(per_host):
        settings = load_settings(environ or {})
        choose_by_topology(settings, topo)
        counts.append(settings.num_channels)
    return counts


@pytest.mark.parametrize("per_host", [[1], [2], [4]])
def test_one_host_gets_one_channel(per_host):
    assert chosen(per_host) == [1] * sum(per_host)


@pytest.mark.parametrize("per_host", [[1, 1], [2, 2], [1, 1, 1, 1], [8, 8, 8]])
def test_several_hosts_get_several_channels(per_host):
    assert CROSS_HOST_CHANNELS > 1
    assert chosen(per_host) == [CROSS_HOST_CHANNELS] * sum(per_host)


@pytest.mark.parametrize("per_host", [[2, 1], [3, 1, 2], [1, 4]])
def test_every_rank_agrees_when_hosts_hold_different_numbers_of_ranks(per_host):
    # cross_size differs between these ranks (a host's second rank has fewer peers); the choice must not.
    assert len({t.cross_size for t in ranks_of(per_host)}) > 1
    assert chosen(per_host) == [CROSS_HOST_CHANNELS] * sum(per_host)


@pytest.mark.parametrize("per_host", [[2], [1, 1], [2, 2]])
@pytest.mark.parametrize("given", [1, 3, 16])
def test_an_explicit_count_wins(per_host, given):
    env = {"PERSEUS_NUM_CHANNELS": str(given)}
    assert chosen(per_host, env) == [given] * sum(per_host)
    settings = load_settings(env)
    choose_by_topology(settings, ranks_of(per_host)[0])
    assert settings.is_explicit("num_channels")  # the autotuner keeps it (perseus.autotune.tuner)


def test_chosen_count_stays_tunable():
    # Chosen, not set by the user: the autotuner starts from it and may change it.
    from perseus.autotune.tuner import tuned_fixed_params

    settings = load_settings({})
    choose_by_topology(settings, ranks_of([1, 1])[0])
    assert settings.num_channels == CROSS_HOST_CHANNELS and not settings.is_explicit("num_channels")
    assert "channels" not in tuned_fixed_params(settings)


def test_zero_means_by_topology_and_negative_is_refused():
    assert topology_channels(0, multi_host=False) == 1
    assert topology_channels(0, multi_host=True) == CROSS_HOST_CHANNELS
    assert topology_channels(2, multi_host=True) == 2 and topology_channels(5, multi_host=False) == 5
    with pytest.raises(ValueError, match="num_channels.*negative"):
        topology_channels(-1, multi_host=True)


def test_rank_0_logs_the_count_in_use(caplog):
    with caplog.at_level(logging.INFO, logger="perseus"):
        for topo in ranks_of([1, 1]):
            choose_by_topology(load_settings({}), topo)
        choose_by_topology(load_settings({"PERSEUS_NUM_CHANNELS": "3"}), ranks_of([2])[0])
    lines = [r.getMessage() for r in caplog.records if r.name == "perseus"]
    assert lines == [f"{CROSS_HOST_CHANNELS} channels per process set, chosen by topology: the job spans 2 hosts",
                     "3 channels per process set, as set (PERSEUS_NUM_CHANNELS)"], lines
