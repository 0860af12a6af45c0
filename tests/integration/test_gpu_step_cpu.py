"""benchmarks/gpu_step.py on CPU (--backend gloo) end to end at a tiny size: a real 2-rank mpirun job of every
mode (no communication, the launcher with and without device buckets, perseus's CPU channels, DDP on Gloo),
with and without an injected launch cost. The test checks what the script wrote, never how fast: one row per
run with every mode's step times; the launcher with device buckets makes exactly DDP's launches per step (the
same sizes grouped in the same order); every mode ends with DDP's
parameters; and the injected cost reaches the measurement the bucket budget is chosen from. The time limit is
there for a hang.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_step.py")


def mpirun():
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [local if os.path.exists(local) else "mpirun", "--oversubscribe", "--bind-to", "none", "-np", "2"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


@pytest.mark.parametrize("cost_ms", [0.0, 20.0])
def test_launcher_over_gloo_matches_ddp_launches_and_parameters(tmp_path, cost_ms):
    out = str(tmp_path / "device.jsonl")
    cmd = mpirun() + [sys.executable, SCRIPT, "--backend", "gloo", "--models", "mlp", "--rounds", "1", "--steps",
                      "2", "--batch", "8", "--launch-cost-ms", str(cost_ms), "--jsonl", out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    with open(out) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 1 and rows[0]["backend"] == "gloo" and rows[0]["launch_cost_ms"] == cost_ms, rows
    mlp = rows[0]["models"]["mlp"]
    modes = {"local", "perseus", "perseus_rounds", "perseus_host", "ddp"}
    assert set(mlp["median_step_ms"]) == modes and all(v > 0 for v in mlp["median_step_ms"].values()), mlp
    launches = mlp["launches_per_step"]
    # (How many launches one per negotiation round makes depends on how fast rounds go here: not compared.)
    assert launches["ddp"] == 2 and launches["perseus"] == launches["ddp"], launches
    assert launches["perseus_rounds"] >= 1 and launches["perseus_host"] == 0, launches
    assert all(d < 1e-5 for d in mlp["max_param_diff_vs_ddp"].values()), mlp["max_param_diff_vs_ddp"]
    # The budget was measured: at least DDP's 25 MiB; with a launch that costs 20 ms, larger than that.
    assert mlp["device_bucket_bytes"] >= 25 << 20 and mlp["measured_launch_cost_ms"] > 0, mlp
    if cost_ms:
        assert mlp["measured_launch_cost_ms"] >= cost_ms and mlp["device_bucket_bytes"] > 25 << 20, mlp
