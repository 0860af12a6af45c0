"""benchmarks/training.py end to end at tiny sizes: real mpirun jobs for single, perseus and DDP.

Each model runs 2 rounds (--quick) of 2 timed steps on a few images / short sequences, and the test checks the
JSON rows the driver writes: one per method, with positive throughputs, one sample per round, the scaling
efficiency and the per-round ratio to DDP. Horovod is named with a venv that does not exist, so it must come
back as an "unavailable" row rather than a failure. What it checks is what the driver wrote, never how fast:
the time limit is there for a hang. About 30 s per model on 2 cores (the transformer in the full test run).
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "training.py")
TINY = ["--steps", "2", "--warmup", "1", "--batch", "4", "--image-size", "16", "--width", "8", "--seq-batch", "2",
        "--seq-len", "16", "--d-model", "32", "--layers", "1", "--vocab", "64"]


@pytest.mark.parametrize("model", ["resnet", pytest.param("transformer", marks=pytest.mark.full)])
def test_quick_run_writes_rows(tmp_path, model):
    out_json = str(tmp_path / "training.jsonl")
    cmd = [sys.executable, SCRIPT, "--quick", "--models", model, "--methods", "single,perseus,ddp,horovod",
           "--horovod-venv", str(tmp_path / "no-venv"), "--json", out_json, *TINY]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "horovod: unavailable" in out, out
    with open(out_json) as f:
        rows = {(r["model"], r["method"]): r for r in map(json.loads, f)}
    assert set(rows) == {(model, k) for k in ("single", "perseus", "ddp", "horovod")}
    assert rows[(model, "horovod")]["available"] is False and rows[(model, "horovod")]["reason"], rows
    for method in ("single", "perseus", "ddp"):
        row = rows[(model, method)]
        assert row["available"] and row["rounds"] == 2 and row["steps"] == 2, row
        assert row["ranks"] == (1 if method == "single" else 2), row
        assert len(row["throughput"]) == 2 and all(t > 0 for t in row["throughput"]), row
        assert row["median_throughput"] > 0 and row["efficiency"] > 0, row
        assert row["unit"] == ("images/s" if model == "resnet" else "sequences/s"), row
    assert rows[(model, "single")]["efficiency"] == 1.0
    assert rows[(model, "perseus")]["vs_ddp"] > 0, rows[(model, "perseus")]
    assert "vs_horovod" not in rows[(model, "perseus")]
