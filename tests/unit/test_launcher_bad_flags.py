"""Wrong flags and values to perseusrun, as a table: each must end the launcher quickly with exit status 2 and
one line ``perseusrun: error: ...`` naming the flag or value and the fix, no traceback, before any rank
starts. Run as the user runs it (``python -m perseus.runner.launch``), in a subprocess.

Also perseus.run's host list: a malformed one is a ValueError before anything starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perseus.runner import mpi_run

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 10.0

# (id, argv (the command "true" follows unless the case gives its own), words the one line must hold)
CASES = [
    ("np_negative", ["-np", "-1"], "-np/--num-proc: must be a positive integer below 2**31, got '-1'"),
    ("np_zero", ["-np", "0"], "must be a positive integer below 2**31, got '0'"),
    ("np_fraction", ["-np", "1.5"], "got '1.5'"),
    ("np_word", ["-np", "two"], "got 'two'"),
    ("np_huge", ["-np", "99999999999999999999"], "below 2**31"),
    ("np_missing", [], "-np/--num-proc is required"),
    ("hosts_two_colons", ["-np", "2", "-H", "a:b:c"], "malformed host entry 'a:b:c': expected one ':'"),
    ("hosts_zero_slots", ["-np", "2", "-H", "host:0"], "'host:0': slots must be a positive integer"),
    ("hosts_negative_slots", ["-np", "2", "-H", "host:-1"], "'host:-1': slots must be a positive integer"),
    ("hosts_empty_entry", ["-np", "2", "-H", "localhost:1,,localhost:1"], "empty host entry"),
    ("hosts_only_commas", ["-np", "2", "-H", ","], "empty host entry"),
    ("hosts_space_in_name", ["-np", "2", "-H", "my host:2"], "'my host' is not a valid host name"),
    ("hosts_too_few_slots", ["-np", "3", "-H", "localhost:2"], "-np 3 needs 3 slots but the hosts offer only 2"),
    ("hosts_unresolvable", ["-np", "2", "-H", "no-such-host.invalid:2"], "cannot resolve host"),
    ("hosts_and_hostfile", ["-np", "2", "-H", "localhost:2", "--hostfile", "{hostfile_ok}"], "use one of them"),
    ("hostfile_missing", ["-np", "2", "--hostfile", "/nonexistent/hosts"],
     "cannot read host file '/nonexistent/hosts'"),
    ("hostfile_directory", ["-np", "2", "--hostfile", "{tmp}"], "cannot read host file"),
    ("hostfile_empty", ["-np", "2", "--hostfile", "{hostfile_empty}"], "lists no hosts"),
    ("hostfile_bad_slots", ["-np", "2", "--hostfile", "{hostfile_bad_slots}"],
     ":2: malformed line 'node2 slots=-1'"),
    ("hostfile_two_colons", ["-np", "2", "--hostfile", "{hostfile_colons}"], ":1: malformed line 'a:b:c'"),
    ("hostfile_unknown_key", ["-np", "2", "--hostfile", "{hostfile_key}"], "unexpected 'cpus=4'"),
    ("unknown_flag", ["-np", "2", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ("abbreviated_flag", ["-np", "2", "--cycle-time", "5"], "unrecognized arguments"),
    ("cycle_time_word", ["-np", "2", "--cycle-time-ms", "abc"], "--cycle-time-ms: must be a non-negative number"),
    ("cycle_time_negative", ["-np", "2", "--cycle-time-ms", "-5"], "got '-5'"),
    ("fusion_word", ["-np", "2", "--fusion-threshold-mb", "lots"], "--fusion-threshold-mb: must be"),
    ("cache_negative", ["-np", "2", "--cache-capacity", "-1"], "--cache-capacity: must be a non-negative integer"),
    ("stall_word", ["-np", "2", "--stall-check-warning-time-seconds", "soon"],
     "--stall-check-warning-time-seconds: must be"),
    ("log_level", ["-np", "2", "--log-level", "LOUD"], "invalid choice: 'LOUD'"),
    ("start_timeout", ["-np", "2", "--start-timeout", "-3"], "--start-timeout: must be a positive integer"),
    ("ssh_port_word", ["-np", "2", "-p", "abc"], "-p/--ssh-port: must be a port number from 1 to 65535"),
    ("ssh_port_too_large", ["-np", "2", "-p", "70000"], "got '70000'"),
    ("nic_missing", ["-np", "2", "--network-interface", "nosuch0"],
     "--network-interface nosuch0: no such network interface on this host"),
    ("nic_empty", ["-np", "2", "--network-interface", ""], "--network-interface '' names no interface"),
    ("nic_commas", ["-np", "2", "--network-interfaces", ",,"], "--network-interface ',,' names no interface"),
    ("mpi_args_quoting", ["-np", "2", "--mpi-args", "'unbalanced"], "--mpi-args", "cannot be split"),
    ("binding_args_quoting", ["-np", "2", "--binding-args", "'x"], "--binding-args"),
    ("config_missing", ["-np", "2", "--config-file", "/nonexistent.yaml"], "--config-file /nonexistent.yaml"),
    ("config_bad_key", ["-np", "2", "--config-file", "{config_bad}"], "unknown key params.fusion_treshold_mb"),
    ("gloo", ["-np", "2", "--gloo"], "perseus runs on MPI, not Gloo"),
    ("jsrun", ["-np", "2", "--jsrun"], "start the job with jsrun yourself"),
    ("elastic_flag_alone", ["-np", "2", "--min-np", "1"], "need(s) --host-discovery-script"),
    ("no_command", ["-np", "2", "NOCMD"], "no command to run"),
    ("no_command_after_dashes", ["-np", "2", "--", "NOCMD"], "no command to run"),
    ("command_missing", ["-np", "2", "/nonexistent/program"],
     "cannot run '/nonexistent/program': it is not an executable file on this host"),
    ("command_not_on_path", ["-np", "2", "no-such-program-xyz"], "'no-such-program-xyz': it is not on PATH"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_flags")
    made = {"tmp": str(tmp)}
    for key, text in {"hostfile_ok": "localhost slots=2\n", "hostfile_empty": "# none\n\n",
                      "hostfile_bad_slots": "node1 slots=2\nnode2 slots=-1\n", "hostfile_colons": "a:b:c\n",
                      "hostfile_key": "node1 cpus=4\n",
                      "config_bad": "params:\n  fusion_treshold_mb: 1\n"}.items():
        (tmp / key).write_text(text)
        made[key] = str(tmp / key)
    return made


def _argv(argv, files):
    argv = [a.format(**files) for a in argv]
    if argv and argv[-1] == "NOCMD":
        return argv[:-1]
    if any(a.startswith("/nonexistent/program") or a == "no-such-program-xyz" for a in argv):
        return argv
    return argv + ["true"]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_flag_is_one_line(files, case):
    name, argv, words = case[0], _argv(case[1], files), case[2:]
    if name.startswith("command_") and mpi_run.find_mpirun() is None:
        pytest.skip("the command is checked once mpirun is found, and this machine has no mpirun")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "perseus.runner.launch", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    took = time.monotonic() - start
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == "", done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("perseusrun: error: "), done.stderr
    assert "Traceback" not in done.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert took < LIMIT_S, f"{took:.1f} s"


@pytest.mark.parametrize("hosts, hostfile, words", [
    ("a:b:c", None, "malformed host entry 'a:b:c'"),
    ("host:0", None, "slots must be a positive integer"),
    ("host:-1", None, "slots must be a positive integer"),
    (",", None, "empty host entry"),
    (None, "/nonexistent/hosts", "cannot read host file"),
    ("localhost:1", "/nonexistent/hosts", "hosts and hostfile were both given"),
])
def test_run_refuses_a_bad_host_list(hosts, hostfile, words):
    import perseus

    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        perseus.run(lambda: 1, np=1, hosts=hosts, hostfile=hostfile)
    message = str(info.value)
    assert message.startswith("perseus.run: ") and words in message, message
    assert time.monotonic() - start < LIMIT_S


def test_run_host_names_of_a_good_list():
    from perseus.runner.run_func import _host_names

    assert _host_names("a:2,b:1", None) == ["a", "b"]
    assert _host_names(None, None) == ["localhost"]


def test_loopback_interfaces_only():
    """Only loopback interfaces: refused across hosts (one sentence), kept for perseus's channels on one host
    while MPI keeps its own choice (Open MPI's daemons refuse loopback alone, with exit status 213)."""
    with pytest.raises(mpi_run.MpiError, match="cannot reach the other hosts"):
        mpi_run.mpi_nics(["lo"], multi_host=True)
    assert mpi_run.mpi_nics(["lo"], multi_host=False) == []
    assert mpi_run.mpi_nics(["eth0", "lo"], multi_host=True) == ["eth0", "lo"]
    assert mpi_run.mpi_nics([], multi_host=True) == []
