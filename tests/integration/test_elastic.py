"""The elastic launcher on an emulated cluster of 3 hosts (real ssh launches): recovery from failures, hosts
added and removed, and the fault matrix. Every case is bounded in time; a launcher still running at its
deadline is a hang and fails the case.

Each job trains elastic_job.py's model, committing after every step; a job that recovers must end with the
parameters of a single process that ran the same steps (tolerance for the different summation orders), and
must never restart from before the last commit (see elastic_cluster.check_recovered). A job that cannot
recover must end, on every rank, with a clear error.

The quick test run takes one case of each kind (a rank killed inside a collective, rank 0 killed, a stopped
rank, an error in the training code, fewer hosts than --min-np, a whole host lost, a commit restored from a
peer's keeper, a host added, a host removed); the cases marked "full" (variants of those, and the long ones)
run in the full test run, as CI does.
"""

import os
import signal
import time

import pytest

from cluster_support import host_pids, kill_strays
from elastic_cluster import check_recovered, discovery_fixture, events, finish, link, phases, start, wait_for, worker_pids

# For hangs: a job that starts, fails, re-forms and finishes, on a busy machine (the launcher's own deadline
# is elastic_cluster.finish's 400 s).
pytestmark = pytest.mark.timeout(900)

STEPS = 24


@pytest.fixture
def disc(tmp_path):
    """3 hosts of the emulated cluster for this test alone, and a discovery script reporting the first two."""
    yield from discovery_fixture(tmp_path)


def run(disc, tmp_path, *, env=None, timeout=400, **kw):
    out = str(tmp_path / "out")
    proc = start(disc, out, env=dict(env or {}), **kw)
    code, log = finish(proc, out, timeout)
    assert code != "HANG", f"the launcher hung:\n{log[-4000:]}"
    return code, log, out


def fault(kind, at="step", rank=1, step=5, gen="0", **more):
    env = dict(FAULT_KIND=kind, FAULT_AT=at, FAULT_RANK=str(rank), FAULT_STEP=str(step), FAULT_GEN=gen)
    env.update({k: str(v) for k, v in more.items()})
    return env


# ---------------------------------------------------------------------------------------------------------
# Faults a rank injects into itself (elastic_job.py's FAULT_* variables)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,at,rank", [
    pytest.param("kill", "step", 1, marks=pytest.mark.full),      # kill -9 between collectives
    ("kill", "backward", 1),                                      # kill -9 while gradients are being reduced
    pytest.param("kill", "commit", 1, marks=pytest.mark.full),    # kill -9 while the commit travels to the keepers
    pytest.param("kill", "random", 1, marks=pytest.mark.full),    # kill -9 at a random moment of a step
    ("kill", "step", 0),                                          # rank 0 itself
    pytest.param("exit", "step", 1, marks=pytest.mark.full),      # a worker that exits with an error status
], ids=["kill-between-collectives", "kill-in-collective", "kill-during-commit", "kill-random", "kill-rank0",
        "worker-exits"])
def test_worker_failure_recovers_on_the_survivors(disc, tmp_path, kind, at, rank):
    code, log, out = run(disc, tmp_path, env=fault(kind, at, rank))
    assert code == 0, log[-4000:]
    ev = check_recovered(out, STEPS, tmp_path)
    gens = phases(ev)
    failed_host = disc.hosts[rank]
    assert len(gens) >= 2 and gens[-1][0] == 1, gens
    assert failed_host not in gens[-1][1], gens  # blacklisted
    assert "blacklist" in log, log[-3000:]


@pytest.mark.full
def test_kill_before_the_first_commit_starts_over(disc, tmp_path):
    code, log, out = run(disc, tmp_path, env=fault("kill", "step", 1, step=0))
    assert code == 0, log[-4000:]
    check_recovered(out, STEPS, tmp_path)


@pytest.mark.full
def test_two_failures_in_a_row(disc, tmp_path):
    """Rank 1 dies in generation 0 (3 ranks), then rank 1 of the re-formed job dies too."""
    H0, H1, H2 = disc.hosts
    disc.set(H0, H1, H2)
    code, log, out = run(disc, tmp_path, np_=3, env=fault("kill", "step", rank=1, step=4, gen="all"))
    assert code == 0, log[-4000:]
    ev = check_recovered(out, STEPS, tmp_path)
    gens = phases(ev)
    assert gens[0][0] == 3 and gens[-1] == (1, [H0]), gens


@pytest.mark.full
def test_two_ranks_die_at_once(disc, tmp_path):
    H0, H1, H2 = disc.hosts
    disc.set(H0, H1, H2)
    out = str(tmp_path / "out")
    proc = start(disc, out, np_=3, env=dict(STEPS="60", STEP_SLEEP="0.1"))
    wait_for(lambda: any(e["kind"] == "step" and e["step"] >= 4 for e in events(out)), 240, "step 4")
    for r in (1, 2):
        for pid in worker_pids(out, r):
            os.kill(pid, signal.SIGKILL)
    code, log = finish(proc, out)
    assert code == 0, log[-4000:]
    ev = check_recovered(out, 60, tmp_path)
    assert phases(ev)[-1] == (1, [H0]), phases(ev)


def test_stopped_worker_is_taken_as_failed(disc, tmp_path):
    code, log, out = run(disc, tmp_path, env=fault("stop", "step", 1))
    assert code == 0, log[-4000:]
    check_recovered(out, STEPS, tmp_path)
    assert "silent" in log or "heartbeat" in log, log[-3000:]


def test_exception_in_training_code_fails_every_rank_clearly(disc, tmp_path):
    code, log, out = run(disc, tmp_path, env=fault("raise", "step", 1))
    ended = time.time()
    assert code not in (0, "HANG"), log[-3000:]
    assert "ValueError: injected failure at step 5" in log, log[-3000:]
    assert "rank 1" in log, log[-3000:]
    # Every rank fails within seconds of the raise (the last step a rank recorded), not after a timeout.
    assert ended - max(e["t"] for e in events(out) if e["kind"] == "step") < 30


@pytest.mark.full
def test_exception_inside_backward_fails_clearly(disc, tmp_path):
    code, log, out = run(disc, tmp_path, env=fault("raise", "backward", 1))
    assert code not in (0, "HANG"), log[-3000:]
    assert "injected failure" in log, log[-3000:]


@pytest.mark.full
def test_exception_outside_the_elastic_function_fails_clearly(disc, tmp_path):
    code, log, out = run(disc, tmp_path, env=fault("raise", "outside", 1))
    assert code not in (0, "HANG"), log[-3000:]
    assert "rank 1" in log and "injected failure outside elastic.run" in log, log[-3000:]
    assert "generation 1" not in log, log[-3000:]  # not taken for a failed host and retried


@pytest.mark.full
def test_a_script_without_elastic_run_finishes(disc, tmp_path):
    code, log, out = run(disc, tmp_path, mode="plain")
    assert code == 0, log[-3000:]
    with open(os.path.join(out, "plain.txt")) as f:
        assert f.read().strip() == "2"


@pytest.mark.full
def test_repeated_failure_hits_the_reset_limit(disc, tmp_path):
    H0, H1, H2 = disc.hosts
    disc.set(H0, H1, H2)
    code, log, out = run(disc, tmp_path, np_=3, extra=("--reset-limit", "1"),
                         env=fault("kill", "step", rank=1, step=3, gen="all"))
    assert code != 0, log[-3000:]
    assert "reset limit" in log.lower() or "reset-limit" in log, log[-3000:]


def test_below_min_np_waits_then_fails_clearly(disc, tmp_path):
    code, log, out = run(disc, tmp_path, min_np=2, extra=("--elastic-timeout", "5"),
                         env=fault("kill", "step", 1))
    assert code != 0, log[-3000:]
    assert "min-np" in log or "min_np" in log, log[-3000:]


@pytest.mark.full
def test_collective_mismatch_is_reported_not_looped(disc, tmp_path):
    """A collective only one rank makes stalls every rank; the stall shutdown fails them all, the job re-forms,
    the same happens again, and the reset limit ends it with a clear error instead of a loop."""
    env = dict(fault("mismatch", "step", 1, gen="all"), PERSEUS_STALL_CHECK_TIME_SECONDS="1",
               PERSEUS_STALL_SHUTDOWN_TIME_SECONDS="3")
    code, log, out = run(disc, tmp_path, extra=("--reset-limit", "2"), env=env)
    assert code != 0, log[-3000:]
    assert "only.on.one.rank" in log and "reset limit" in log, log[-3000:]


# ---------------------------------------------------------------------------------------------------------
# Faults from outside: hosts, links, the discovery script, keepers
# ---------------------------------------------------------------------------------------------------------

def _started(out, step=3, timeout=240):
    wait_for(lambda: any(e["kind"] == "step" and e["step"] >= step for e in events(out)), timeout, f"step {step}")


@pytest.mark.full
def test_host_link_down(disc, tmp_path):
    H0, H1, H2 = disc.hosts
    out = str(tmp_path / "out")
    proc = start(disc, out, env=dict(STEPS="40", STEP_SLEEP="0.1"))
    _started(out)
    link(H1, False)
    code, log = finish(proc, out)
    link(H1, True)
    assert code == 0, log[-4000:]
    ev = check_recovered(out, 40, tmp_path)
    assert H1 not in phases(ev)[-1][1]


def _kill_keeper(host):
    """The keeper of one host (a network namespace shares the process table: pkill there would kill them all)."""
    for pid in host_pids(host):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"perseus.runner.elastic.keeper" in f.read():
                    os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_whole_host_dies(disc, tmp_path):
    """Rank 0's host dies whole (worker, keeper, MPI daemon); the other two go on."""
    H0, H1, H2 = disc.hosts
    disc.set(H0, H1, H2)
    out = str(tmp_path / "out")
    proc = start(disc, out, np_=3, env=dict(STEPS="40", STEP_SLEEP="0.1"))
    _started(out)
    disc.set(H1, H2)
    kill_strays([H0])  # its worker, its keeper and its MPI daemon
    code, log = finish(proc, out)
    assert code == 0, log[-4000:]
    ev = check_recovered(out, 40, tmp_path)
    assert H0 not in phases(ev)[-1][1]


def test_state_comes_from_a_peer_when_the_local_copy_is_gone(disc, tmp_path):
    """The keeper of rank 0's host dies, then rank 1's worker: the job is started again (relaunch) on rank 0's
    host, whose new keeper is empty, and restores the newest commit from the keeper of rank 1's host."""
    H0, H1, H2 = disc.hosts
    out = str(tmp_path / "out")
    proc = start(disc, out, env=dict(STEPS="30", STEP_SLEEP="0.1", PERSEUS_ELASTIC_IN_PROCESS="0"))
    _started(out)
    _kill_keeper(H0)
    time.sleep(1.0)
    for pid in worker_pids(out, 1):
        os.kill(pid, signal.SIGKILL)
    code, log = finish(proc, out)
    assert code == 0, log[-4000:]
    ev = check_recovered(out, 30, tmp_path)
    assert phases(ev)[-1] == (1, [H0]), phases(ev)
    assert "from a peer host's keeper" in log, log[-3000:]


@pytest.mark.full
def test_whole_group_lost_falls_back_to_disk(disc, tmp_path):
    """Both copies of the commit are lost (rank 0's keeper, then rank 1's whole host): the job restores the
    last commit written to disk (PERSEUS_GEMINI_DISK_DIR)."""
    H0, H1, H2 = disc.hosts
    out = str(tmp_path / "out")
    disk = str(tmp_path / "disk")
    proc = start(disc, out, env=dict(STEPS="30", STEP_SLEEP="0.1", PERSEUS_ELASTIC_IN_PROCESS="0",
                                     PERSEUS_GEMINI_DISK_DIR=disk, PERSEUS_GEMINI_DISK_EVERY="1"))
    _started(out)
    _kill_keeper(H0)
    time.sleep(1.0)
    disc.set(H0)
    kill_strays([H1])
    code, log = finish(proc, out)
    assert code == 0, log[-4000:]
    check_recovered(out, 30, tmp_path)
    assert "from disk" in log, log[-3000:]


@pytest.mark.full
def test_keepers_die_training_goes_on(disc, tmp_path):
    out = str(tmp_path / "out")
    proc = start(disc, out, env=dict(STEPS="30", STEP_SLEEP="0.1"))
    _started(out)
    for host in disc.hosts:  # every keeper of the job
        _kill_keeper(host)
    code, log = finish(proc, out)
    assert code == 0, log[-4000:]
    check_recovered(out, 30, tmp_path)


@pytest.mark.full
def test_discovery_failing_for_a_while_changes_nothing(disc, tmp_path):
    out = str(tmp_path / "out")
    proc = start(disc, out, env=dict(STEPS="30", STEP_SLEEP="0.1"))
    _started(out)
    disc.fail(True)
    time.sleep(3)
    disc.fail(False)
    code, log = finish(proc, out)
    assert code == 0, log[-4000:]
    ev = check_recovered(out, 30, tmp_path)
    assert len(phases(ev)) == 1, phases(ev)
    assert "discovery" in log and "unavailable" in log, log[-3000:]


@pytest.mark.full
def test_discovery_garbage_changes_nothing(disc, tmp_path):
    H0, H1, H2 = disc.hosts
    out = str(tmp_path / "out")
    proc = start(disc, out, env=dict(STEPS="30", STEP_SLEEP="0.1"))
    _started(out)
    disc.garbage()
    time.sleep(3)
    disc.set(H0, H1)
    code, log = finish(proc, out)
    assert code == 0, log[-4000:]
    ev = check_recovered(out, 30, tmp_path)
    assert len(phases(ev)) == 1, phases(ev)
    assert "not a host line" in log, log[-3000:]


@pytest.mark.full
def test_discovery_failing_from_the_start_is_a_clear_error(disc, tmp_path):
    disc.fail(True)
    start_t = time.monotonic()
    code, log, out = run(disc, tmp_path, extra=("--elastic-timeout", "4"))
    assert code != 0 and "unavailable" in log, log[-3000:]
    assert time.monotonic() - start_t < 60  # the 4 s timeout, not the default 600 s (a busy machine's start aside)


def test_host_added_mid_epoch_grows_the_job(disc, tmp_path):
    H0, H1, H2 = disc.hosts
    out = str(tmp_path / "out")
    proc = start(disc, out, env=dict(STEPS="30", STEP_SLEEP="0.1", FAULT_STEP="5",
                                     WAIT_FILE=str(tmp_path / "go")))
    _started(out, 5)
    disc.set(H0, H1, H2)
    # The ranks wait at step 5 until the launcher has seen the new host, then go on (mid-epoch).
    wait_for(lambda: f"+{H2}" in open(os.path.join(out, "log")).read(), 240, "the launcher seeing the new host")
    (tmp_path / "go").touch()
    code, log = finish(proc, out)
    assert code == 0, log[-4000:]
    ev = check_recovered(out, 30, tmp_path)
    gens = phases(ev)
    assert gens[0] == (2, [H0, H1]) and gens[-1] == (3, [H0, H1, H2]), gens


def test_host_removed_shrinks_the_job(disc, tmp_path):
    H0, H1, H2 = disc.hosts
    out = str(tmp_path / "out")
    proc = start(disc, out, env=dict(STEPS="30", STEP_SLEEP="0.1"))
    _started(out)
    disc.set(H0)
    code, log = finish(proc, out)
    assert code == 0, log[-4000:]
    ev = check_recovered(out, 30, tmp_path)
    assert phases(ev)[-1] == (1, [H0]), phases(ev)


@pytest.mark.full
def test_blacklisted_host_returns_after_its_cooldown(disc, tmp_path):
    H0, H1, H2 = disc.hosts
    disc.set(H0, H1, H2)
    code, log, out = run(disc, tmp_path, np_=3, extra=("--blacklist-cooldown-range", "1", "2"),
                         env=dict(fault("kill", "step", rank=2, step=3), STEPS="60", STEP_SLEEP="0.15"))
    assert code == 0, log[-4000:]
    ev = check_recovered(out, 60, tmp_path)
    gens = phases(ev)
    assert H2 not in gens[1][1] and gens[-1][0] == 3, gens


@pytest.mark.full
def test_acceptance_add_one_host_remove_one(disc, tmp_path):
    """2 hosts x 1 rank; a third host joins, then one of the first two leaves; the job keeps training and
    ends with the reference's parameters."""
    H0, H1, H2 = disc.hosts
    out = str(tmp_path / "out")
    proc = start(disc, out, env=dict(STEPS="40", STEP_SLEEP="0.1"))
    _started(out, 4)
    disc.set(H0, H1, H2)
    wait_for(lambda: any(e["kind"] == "start" and e["size"] == 3 for e in events(out)), 240, "3 ranks")
    _started(out, max(e["step"] for e in events(out) if e["kind"] == "step") + 3)
    disc.set(H0, H2)
    code, log = finish(proc, out)
    assert code == 0, log[-4000:]
    ev = check_recovered(out, 40, tmp_path)
    gens = phases(ev)
    sizes = gens
    assert sizes[0] == (2, [H0, H1]) and (3, [H0, H1, H2]) in sizes and sizes[-1] == (2, [H0, H2]), sizes
