"""benchmarks/report_cluster.py and run_all's dear, embrace, elastic_commit and compression phases: tables from
result lines shaped as the benchmark scripts write them, and the phases' wiring."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import compression  # noqa: E402
import dear  # noqa: E402
import report  # noqa: E402
import run_all  # noqa: E402

NEW = ("dear", "embrace", "elastic_commit", "compression")


def dear_lines():
    raw = []
    for rnd in range(2):
        for m, t in (("default", 0.4), ("dear", 0.36), ("horovod", 0.6)):
            raw.append({"method": m, "ranks": 2, "layers": 2, "width": 4, "batch": 8, "round": rnd, "compute_s": 0.1,
                        "step_s": [t, t], "phases_s": [0.1, 0.1, 0.2]})
        raw.append({"method": "rsag", "ranks": 2, "round": rnd, "rsag": [
            {"size": "model", "bytes": 2 << 20, "ar_s": 0.2, "rs_s": 0.1, "ag_s": 0.12, "rsag_over_ar": 1.1}]})
    meta = {"bench": "dear", "hosts": "perseus-h0,perseus-h1", "ranks_per_host": 1, "layers": 2, "width": 4,
            "batch": 8, "rounds": 2}
    table = dear.summarize(raw, ["default", "dear", "horovod", "rsag"])
    return [{**meta, "raw": r} for r in raw] + [{**meta, **r} for r in table]


def embrace_lines():
    meta = {"bench": "sparse", "hosts": "perseus-h0,perseus-h1", "vocab": 1000, "dim": 8, "tokens": 64,
            "zipf": 1.1, "rounds": 1}
    rows = [{"method": m, "ranks": 4, "median_ms": ms, "vs_allgather": ms / 200, "sent_mb": sent, "link_mb": 2 * ms / 100}
            for m, ms, sent in (("allgather", 200.0, 1.0), ("embrace", 100.0, 0.5), ("horovod", 400.0, None))]
    return [{**meta, "raw": {"method": "allgather", "step_s": [0.2]}}] + [{**meta, **r} for r in rows]


def commit_lines():
    return [{"bench": "elastic_commit", "round": rnd, "state_mb": 32.0, "batch": 256, "mode": m, "step_s": t,
             "steps": 25} for rnd in range(2) for m, t in (("none", 0.2), ("gemini", 0.22), ("eager", 0.3))]


def compression_lines():
    raw = [{"method": m, "optimizer": "sgd", "ranks": 2, "compute_ms": 400.0, "density": 0.01, "params": 1000,
            "step_s": [t], "sent_bytes_per_step": b, "round": 0}
           for m, t, b in (("dense", 1.0, 4e6), ("topk", 0.5, 8e4), ("horovod-dense", 4.0, None),
                           ("horovod-fp16", 2.0, None))]
    meta = {"bench": "compression", "hosts": "perseus-h0,perseus-h1", "ranks_per_host": 1, "compute_ms": 400.0,
            "optimizer": "sgd", "density": 0.01, "rounds": 1}
    table = compression.summarize(raw, [r["method"] for r in raw])
    return [{**meta, "raw": r} for r in raw] + [{**meta, **r} for r in table]


def test_tables_ratios_and_sources(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "IMG", str(tmp_path / "img"))
    for name, lines in (("dear", dear_lines()), ("embrace", embrace_lines()), ("elastic_commit", commit_lines()),
                        ("compression", compression_lines())):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    found = report.sections(str(tmp_path))
    assert set(found) == set(NEW)
    rel = os.path.relpath(str(tmp_path), ROOT)
    for name in NEW:
        assert found[name].rstrip().endswith(f"Source: `{rel}/{name}.jsonl`."), found[name][-200:]
    assert "DeAR / default: **0.90x**; Horovod / DeAR: **1.67x**" in found["dear"]
    assert "| the model's gradients | 2.0 | 200.0 | 100.0 | 120.0 | **1.10** |" in found["dear"]
    assert "| perseus, EmbRace (`DistributedEmbedding`) | 100.0 | 0.50x | 0.25x | 0.50 | 2.00 |" in found["embrace"]
    assert "| Horovod 0.28.1 (allgather) | 400.0 | 2.00x | 1.00x | - | 8.00 |" in found["embrace"]
    assert "| 300.0 | 1.50x |" in found["elastic_commit"] and "medians over 2 rounds" in found["elastic_commit"]
    assert "| perseus topk(0.01) | 0.500 | 0.50x | 0.25x | 0.12x | 0.08 | 0.020 |" in found["compression"]
    assert "| Horovod 0.28.1 fp16 | 2.000 | 2.00x | 1.00x | 0.50x | - | - |" in found["compression"]


def test_phases_run_with_cluster_and_count_a_failed_job(tmp_path, monkeypatch):
    assert set(NEW) <= set(run_all.CLUSTER_PHASES) <= set(run_all.PHASES) == set(run_all.RUNNERS)
    out = tmp_path / "x.jsonl"
    monkeypatch.setattr(run_all, "run", lambda cmd, timeout, env=None: "round 0 dear: ok (3 s)\n")
    with pytest.raises(RuntimeError, match="no results"):
        run_all.run_driver(["python", "dear.py"], str(out), 10)
    out.write_text("{}\n")
    run_all.run_driver(["python", "dear.py"], str(out), 10)
    monkeypatch.setattr(run_all, "run", lambda cmd, timeout, env=None: "round 1 horovod: FAILED rc=1 (3 s)\n")
    with pytest.raises(RuntimeError, match="1 job"):
        run_all.run_driver(["python", "dear.py"], str(out), 10)
