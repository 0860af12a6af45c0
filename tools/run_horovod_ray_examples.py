#!/usr/bin/env python3
"""Run Horovod's Ray example scripts (examples/ray in a Horovod checkout) on perseus, unchanged but for their data.

    python tools/run_horovod_ray_examples.py --horovod /path/to/horovod [--address RAY_ADDRESS]
        [--only NAME ...] [--output benchmarks/results/horovod_ray_examples.jsonl] [--timeout SECONDS]

Each script is copied into a fresh temporary folder; there, the few textual substitutions listed in EXAMPLES
below replace its MNIST download with synthetic data of the same shapes, types and label range (this machine
has no internet), and nothing else of the script changes, apart from fixes named as such. A substitution whose
text is no longer found (a newer Horovod) stops the tool with an error instead of running a script that would
download. The copy runs as ``python -m perseus.compat.horovod_alias COPY ARGS`` (``import horovod...`` loads
perseus), one example at a time, under a timeout; one JSON line per example (its name, arguments, the
substitutions, seconds, exit status, the last lines of its output) goes to the output file, rewritten by each run.

Arguments: each script's defaults, except where it would not finish in minutes on a 2-core machine (``--epochs``;
each such change is listed with its reason in the JSON as ``changed_args``).

The Ray cluster: with ``--address``, the scripts use that cluster (set as RAY_ADDRESS; its nodes' environment
must already carry what the ranks need, e.g. TF_USE_LEGACY_KERAS for the Keras example). Without it, each example
gets a cluster of its own on this machine: a head and a second node, both started with Ray's own
``ray start --block`` in a temporary folder (``--temp-dir``), with *logical* resources: the scripts ask for GPUs
(``use_gpu=True``) and many CPUs per slot (``cpus_per_slot=8``, ``num_hosts=2``), and Ray's resources are only
counts, so ``--num-cpus``/``--num-gpus`` (per node) satisfy them while torch and TensorFlow, seeing no CUDA
device, train on the CPU. Both nodes are one machine: perseus groups their actors into one MPI node. The cluster
is stopped (its ``ray start`` processes signalled, by process id) after the example, so no checkpoint or actor
of one example is seen by the next.

Needs, besides perseus: ray, torch, tensorflow (with tf-keras for the Keras example), tqdm, filelock and
tensorboard (basic_ray_elastic.py's SummaryWriter). torchvision: the torch scripts import it; where it cannot
be imported (PyPI's torchvision wheels need a CUDA build of torch), the import line is replaced with a stand-in
for the ``transforms`` calls left after the data substitution, and the JSON says so.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join("benchmarks", "results", "horovod_ray_examples.jsonl")
BASE_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
TAIL_LINES = 40

# MNIST's sizes: 60000 training and 10000 test images of 28x28, labels 0-9.
TRAIN, TEST = 60000, 10000


class SubstitutionError(RuntimeError):
    """A substitution's text is no longer in the script (or is there a different number of times)."""


@dataclass
class Substitution:
    """Replace what ``find`` locates in the source (a list of ``(start, end)`` offsets) with ``replace(text)``;
    ``count``: how many matches the script must have."""

    what: str
    find: Callable[[str], List[tuple]]
    replace: Callable[[str], str]
    count: int = 1

    def apply(self, source: str, script: str) -> str:
        spans = self.find(source)
        if len(spans) != self.count:
            raise SubstitutionError(f"{script}: substitution '{self.what}' expected {self.count} match(es), found "
                                    f"{len(spans)}: the script changed; update EXAMPLES in {__file__}")
        for start, end in sorted(spans, reverse=True):
            source = source[:start] + self.replace(source[start:end]) + source[end:]
        return source


def _offsets(source: str):
    """(line, col) -> offset in ``source`` (ast's columns are UTF-8 byte offsets; these scripts are ASCII)."""
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return lambda line, col: starts[line - 1] + col


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def calls_to(name: str) -> Callable[[str], List[tuple]]:
    """A finder: every call of the dotted name ``name`` (the whole call expression, arguments included)."""

    def find(source: str) -> List[tuple]:
        at = _offsets(source)
        return [(at(n.lineno, n.col_offset), at(n.end_lineno, n.end_col_offset))
                for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.Call) and _dotted(n.func) == name]

    return find


def statements(pattern: str) -> Callable[[str], List[tuple]]:
    """A finder: every whole statement (all its lines) whose source matches the regular expression ``pattern``."""

    def find(source: str) -> List[tuple]:
        at = _offsets(source)
        out = []
        for n in ast.walk(ast.parse(source)):
            if isinstance(n, ast.stmt) and not isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.If, ast.For,
                                                                 ast.While, ast.With, ast.Try)):
                start, end = at(n.lineno, n.col_offset), at(n.end_lineno, n.end_col_offset)
                if re.fullmatch(pattern, source[start:end], re.DOTALL):
                    out.append((start, end))
        return out

    return find


def _train_flag(call_text: str) -> bool:
    """Whether a ``datasets.MNIST(...)`` call asks for the training split (``train=True``, the default)."""
    call = ast.parse(call_text, mode="eval").body
    for kw in call.keywords:
        if kw.arg == "train":
            return bool(ast.literal_eval(kw.value))
    return True


def synthetic_torch_mnist(call_text: str) -> str:
    """``datasets.MNIST(...)`` -> a TensorDataset of what the call's transform (ToTensor, Normalize) would give:
    float32 1x28x28 images and int64 labels 0-9, as many as the split has; seeded, so every rank has the same."""
    n, seed = (TRAIN, 0) if _train_flag(call_text) else (TEST, 1)
    return (f"torch.utils.data.TensorDataset(torch.randn({n}, 1, 28, 28, generator=torch.Generator().manual_seed("
            f"{seed})), torch.randint(0, 10, ({n},), generator=torch.Generator().manual_seed({seed + 10})))")


def synthetic_keras_mnist(_call_text: str) -> str:
    """``tf.keras.datasets.mnist.load_data(...)`` -> ``((x_train, y_train), (x_test, y_test))`` of uint8 arrays
    shaped (60000, 28, 28), (60000,), (10000, 28, 28), (10000,) with labels 0-9; seeded."""
    rng = "__import__('numpy').random.default_rng({})"
    return (f"(({rng.format(0)}.integers(0, 256, ({TRAIN}, 28, 28), dtype='uint8'), "
            f"{rng.format(1)}.integers(0, 10, ({TRAIN},), dtype='uint8')), "
            f"({rng.format(2)}.integers(0, 256, ({TEST}, 28, 28), dtype='uint8'), "
            f"{rng.format(3)}.integers(0, 10, ({TEST},), dtype='uint8')))")


def torch_mnist(count: int) -> Substitution:
    return Substitution("datasets.MNIST(...) -> TensorDataset of seeded torch.randn 1x28x28 float32 images and "
                        "torch.randint 0-9 int64 labels (60000 for train=True, 10000 for train=False)",
                        calls_to("datasets.MNIST"), synthetic_torch_mnist, count)

# Only where torchvision cannot be imported: the ``transforms`` calls left after torch_mnist build objects that
# nothing uses any more, and ``datasets`` is not used at all.
TORCHVISION_STAND_IN = Substitution(
    "from torchvision import datasets, transforms -> a stand-in 'transforms' whose Compose/ToTensor/Normalize "
    "return None (torchvision cannot be imported here; after the data substitution nothing uses what they build)",
    statements(r"from torchvision import datasets, transforms"),
    lambda _: ("transforms = __import__('types').SimpleNamespace(Compose=lambda *a, **k: None, "
               "ToTensor=lambda *a, **k: None, Normalize=lambda *a, **k: None)"))

KERAS_MNIST = Substitution("tf.keras.datasets.mnist.load_data(...) -> seeded numpy uint8 arrays of MNIST's shapes "
                           "((60000, 28, 28), (60000,), (10000, 28, 28), (10000,)), labels 0-9",
                           calls_to("tf.keras.datasets.mnist.load_data"), synthetic_keras_mnist)

# basic_ray_elastic.py defines --data-dir twice, which argparse rejects before anything runs (under Horovod too):
# the second definition (no default; the code's `args.data_dir or './data'`) goes.
DUPLICATE_DATA_DIR = Substitution(
    "fix of the script's own bug: the second parser.add_argument('--data-dir', ...) removed (argparse raises "
    "'conflicting option string: --data-dir' on the duplicate, under Horovod as well)",
    statements(r"parser\.add_argument\(\s*'--data-dir',\s*help=.*\)"), lambda _: "pass  # duplicate --data-dir removed")


@dataclass
class Example:
    name: str
    path: str                      # relative to the Horovod checkout
    substitutions: List[Substitution]
    args: List[str] = field(default_factory=list)
    changed_args: Dict[str, str] = field(default_factory=dict)   # argument -> why it differs from the default
    env: Dict[str, str] = field(default_factory=dict)            # for the script and the Ray nodes
    env_reason: str = ""
    uses_torchvision: bool = False
    requires: List[str] = field(default_factory=list)          # modules the script imports (checked first)
    address_arg: bool = False      # the script takes the cluster's address as --address
    timeout: int = 1200


EXAMPLES = [
    Example("basic_ray_elastic", "examples/ray/basic_ray_elastic.py", [DUPLICATE_DATA_DIR, torch_mnist(1)],
            args=["--epochs", "1"],
            changed_args={"--epochs": "1 instead of 90 (one epoch of 60000 images in batches of 8 takes minutes "
                                      "here)"},
            uses_torchvision=True, requires=["torch", "numpy", "tqdm", "filelock", "tensorboard", "ray"]),
    Example("pytorch_ray_elastic", "examples/ray/pytorch_ray_elastic.py", [torch_mnist(2)], uses_torchvision=True,
            requires=["torch", "filelock", "ray"]),
    Example("tensorflow2_mnist_ray", "examples/ray/tensorflow2_mnist_ray.py", [KERAS_MNIST],
            env={"TF_USE_LEGACY_KERAS": "1"},
            env_reason="Keras 3 (TensorFlow's default) rejects compile(..., experimental_run_tf_function=False); "
                       "tf-keras 2 accepts it",
            address_arg=True, requires=["tensorflow", "tf_keras", "ray"]),
]


# -- the Ray cluster ---------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    """A head and more nodes on this machine, each a ``ray start --block`` process in a session of its own;
    stopped by signalling those processes (and their process groups) only."""

    def __init__(self, python: str, folder: str, env: dict, nodes: int, num_cpus: int, num_gpus: int,
                 object_store_bytes: int):
        self.ray = os.path.join(os.path.dirname(python), "ray")
        if not os.path.exists(self.ray):
            raise SystemExit(f"no 'ray' command beside {python}: pip install 'ray[default]'")
        self.folder, self.env = folder, env
        self.temp_dir = os.path.join(folder, "ray")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"  # Ray itself gives its nodes this machine's reachable address
        self.procs: List[subprocess.Popen] = []
        self.logs: List[str] = []
        self.common = ["--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus),
                       "--object-store-memory", str(object_store_bytes), "--temp-dir", self.temp_dir,
                       "--disable-usage-stats", "--block"]
        self.nodes = nodes
        self.description = (f"{nodes} Ray nodes on this machine, each --num-cpus {num_cpus} --num-gpus "
                            f"{num_gpus} (logical), started by this tool")

    def _start(self, extra: List[str], index: int) -> None:
        log = os.path.join(self.folder, f"ray-node-{index}.log")
        self.logs.append(log)
        with open(log, "w") as out:
            self.procs.append(subprocess.Popen([self.ray, "start", *extra, *self.common], cwd=self.folder,
                                               env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            with open(log, errors="replace") as f:
                if "Ray runtime started" in f.read():
                    return
            if self.procs[-1].poll() is not None:
                break
            time.sleep(1)
        with open(log, errors="replace") as f:
            text = f.read()[-3000:]
        raise RuntimeError(f"ray start (node {index}) did not start:\n{text}")

    def start(self) -> None:
        self._start(["--head", "--port", str(self.port), "--include-dashboard", "false"], 0)
        for i in range(1, self.nodes):
            self._start(["--address", self.address], i)

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the other nodes, then the head
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    pass
            try:  # whatever of that node is left in its session (pgid = the ray start process's pid)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        self.procs = []


# -- one example ------------------------------------------------------------------------------------------------

def _can_import(python: str, module: str, env: dict) -> tuple:
    done = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, env=env)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return done.returncode == 0, last


def _tail(path: str, lines: int) -> List[str]:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 400_000))
        text = f.read().decode("utf-8", errors="replace")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\b", "\r")  # tqdm and Keras progress bars
    out = [part.rstrip() for line in text.split("\n") for part in line.split("\r")[-1:]]
    return [line for line in out if line.strip()][-lines:]


def _git_head(folder: str) -> Optional[str]:
    """The checkout's commit (with "-dirty" when it has changes), or None outside a git checkout."""
    done = subprocess.run(["git", "-C", folder, "describe", "--always", "--dirty", "--abbrev=40"],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def _last_error(path: str) -> Optional[str]:
    """The last line of the output that names an exception (``SomeError: ...``), if any."""
    found = None
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", "replace").strip()
            if re.match(r"^([\w.]+\.)?\w*(Error|Exception|Interrupt)(: |$)", line):
                found = line[:1000]
    return found


def prepare(example: Example, horovod: str, folder: str, torchvision_ok: bool) -> tuple:
    """Copy the example into ``folder`` with its substitutions; returns ``(copy path, what was substituted,
    the original's sha256)``."""
    source_path = os.path.join(horovod, example.path)
    if not os.path.exists(source_path):
        raise SystemExit(f"{source_path} is missing: --horovod must name a Horovod checkout (with examples/)")
    with open(source_path) as f:
        source = f.read()
    digest = hashlib.sha256(source.encode()).hexdigest()
    subs = list(example.substitutions)
    if example.uses_torchvision and not torchvision_ok:
        subs.append(TORCHVISION_STAND_IN)
    text = source
    for sub in subs:
        text = sub.apply(text, example.path)
    if example.uses_torchvision and not torchvision_ok:
        left = [n.lineno for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name) and n.id == "datasets"]
        if left:
            raise SubstitutionError(f"{example.path}: 'datasets' still used on line(s) {left} after the "
                                    f"substitutions, and torchvision cannot be imported here")
    copy = os.path.join(folder, os.path.basename(example.path))
    with open(copy, "w") as f:
        f.write(text)
    return copy, [f"{s.what} (x{s.count})" if s.count > 1 else s.what for s in subs], digest


def run_example(example: Example, opts, env: dict, torchvision: tuple) -> dict:
    folder = tempfile.mkdtemp(prefix=f"hvdray-{example.name[:12]}-")
    copy, substituted, digest = prepare(example, opts.horovod, folder, torchvision[0])
    run_env = {**env, **example.env}
    cluster = None
    if opts.address:
        address, cluster_text = opts.address, f"the cluster at {opts.address} (--address)"
    else:
        cluster = LocalCluster(opts.python, folder, run_env, 2, opts.num_cpus, opts.num_gpus,
                               opts.object_store_bytes)
        address, cluster_text = cluster.address, cluster.description
    run_env["RAY_ADDRESS"] = address
    args = list(example.args) + (["--address", address] if example.address_arg else [])
    timeout = opts.timeout or example.timeout
    log = os.path.join(folder, "output.log")
    record = {"name": example.name, "script": example.path, "script_sha256": digest, "args": args,
              "changed_args": example.changed_args, "substitutions": substituted,
              "env": {k: v for k, v in example.env.items()}, "env_reason": example.env_reason,
              "ray_cluster": cluster_text, "timeout_s": timeout}
    if example.uses_torchvision:
        record["torchvision"] = "imported" if torchvision[0] else f"not importable here ({torchvision[1]})"
    print(f"== {example.name}: {' '.join(args)} (in {folder})", flush=True)
    start = time.monotonic()
    missing = [m for m in example.requires if not _can_import(opts.python, m, env)[0]]
    try:
        if missing:
            raise RuntimeError(f"not run: {opts.python} cannot import {', '.join(missing)}, which the script needs")
        if cluster is not None:
            cluster.start()
        cmd = [opts.python, "-m", "perseus.compat.horovod_alias", os.path.basename(copy), *args]
        record["command"] = " ".join(cmd)
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=folder, env=run_env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            begun = time.monotonic()
            try:
                status = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                status = "timeout"
            record["seconds"] = round(time.monotonic() - begun, 1)
    except (RuntimeError, OSError) as exc:
        status = f"error: {exc}"
        with open(log, "a") as out:
            out.write(f"\n{exc}\n")
    finally:
        if cluster is not None:
            cluster.stop()
    record["seconds_with_cluster_start"] = round(time.monotonic() - start, 1)
    record["exit_status"] = status
    record["passed"] = status == 0
    record["output_tail"] = _tail(log, TAIL_LINES)
    if status != 0:
        record["error"] = _last_error(log)
    with open(log, "rb") as f:  # the elastic driver's lines: generations (ranks, hosts) and re-forms
        record["perseus_elastic"] = [line.decode("utf-8", "replace").strip() for line in f
                                     if line.startswith(b"perseusrun: elastic:")][:20]
    if opts.keep:
        record["folder"] = folder
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return record


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--horovod", required=True, help="a Horovod checkout (its examples/ray scripts are run)")
    p.add_argument("--horovod-commit", help="the checkout's commit, recorded (default: asked of git there)")
    p.add_argument("--address", help="an existing Ray cluster (default: a 2-node cluster started per example)")
    p.add_argument("--output", default=os.path.join(ROOT, DEFAULT_OUTPUT), help="JSON lines written here")
    p.add_argument("--only", action="append", choices=[e.name for e in EXAMPLES], help="run only these")
    p.add_argument("--timeout", type=int, default=0, help="seconds per example (default: each example's own)")
    p.add_argument("--python", default=sys.executable, help="the Python that runs the scripts and Ray")
    p.add_argument("--num-cpus", type=int, default=64, help="logical CPUs per Ray node started here")
    p.add_argument("--num-gpus", type=int, default=4, help="logical GPUs per Ray node started here")
    p.add_argument("--object-store-bytes", type=int, default=300_000_000, help="per Ray node started here")
    p.add_argument("--keep", action="store_true", help="keep each example's temporary folder (logs, copy)")
    opts = p.parse_args(argv)
    opts.horovod = os.path.abspath(opts.horovod)

    env = dict(os.environ)
    env.update(BASE_ENV)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    env.pop("RAY_ADDRESS", None)
    examples = [e for e in EXAMPLES if not opts.only or e.name in opts.only]
    torchvision = _can_import(opts.python, "torchvision", env) if any(e.uses_torchvision for e in examples) \
        else (True, "")
    for e in examples:  # every substitution must match before anything runs
        with tempfile.TemporaryDirectory() as d:
            prepare(e, opts.horovod, d, torchvision[0])

    common = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "horovod_commit": opts.horovod_commit or _git_head(opts.horovod), "perseus_commit": _git_head(ROOT),
              "cpus": os.cpu_count()}
    os.makedirs(os.path.dirname(os.path.abspath(opts.output)), exist_ok=True)
    failed = 0
    with open(opts.output, "w") as out:
        for e in examples:
            record = {**run_example(e, opts, env, torchvision), **common}
            out.write(json.dumps(record) + "\n")
            out.flush()
            failed += not record["passed"]
            print(f"{'PASS' if record['passed'] else 'FAIL'} {e.name} {record.get('seconds', '-')} s "
                  f"(exit {record['exit_status']})", flush=True)
            if not record["passed"]:
                print("\n".join("    " + line for line in record["output_tail"][-15:]), flush=True)
    print(f"{len(examples) - failed} passed, {failed} failed; results in {opts.output}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
