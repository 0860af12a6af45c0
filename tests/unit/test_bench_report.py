"""benchmarks/report.py: the core summary's ratios, the docs' marker sections, the plots."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import report  # noqa: E402


def core_rows():
    rows = []
    for rnd in range(2):
        rows.append({"bench": "core", "lib": "perseus", "round": rnd, "workload": "resnet50", "unit": "ms",
                     "samples": {"mpi_flat": [10.0, 20.0], "mpi_tensor": [20.0, 40.0], "perseus": [15.0, 30.0]}})
        rows.append({"bench": "core", "lib": "horovod", "round": rnd, "workload": "resnet50", "unit": "ms",
                     "samples": {"mpi_flat": [30.0, 30.0], "mpi_tensor": [60.0, 60.0], "horovod": [60.0, 60.0]}})
        rows.append({"bench": "core", "lib": "none", "round": rnd, "workload": "resnet50", "unit": "ms",
                     "samples": {"mpi_flat": [10.0, 10.0], "mpi_tensor": [20.0, 20.0], "gloo": [40.0, 40.0]}})
    return rows


def test_ratios_are_per_step_against_the_same_jobs_bound():
    s = report.core_summary(core_rows())["resnet50"]
    per = s["methods"]["perseus"]
    assert per["x_mpi_flat"] == pytest.approx(1.5) and per["x_mpi_tensor"] == pytest.approx(0.75)
    assert s["methods"]["horovod"]["x_mpi_flat"] == pytest.approx(2.0)
    # Horovod's idle cost (its bound 30 vs 10 with no library) shows in the no-library column
    assert s["methods"]["horovod"]["x_none_flat"] == pytest.approx(6.0)
    assert s["bounds"][("horovod", "mpi_flat")] / s["bounds"][("none", "mpi_flat")] == pytest.approx(3.0)
    assert per["faster_than_horovod"] == pytest.approx(60.0 / 22.5)
    table = report.core_tables(report.core_summary(core_rows()), "x/core.jsonl")
    assert "1.50x" in table and "3.00x" in table and "`x/core.jsonl`" in table


def test_sections_replace_only_their_markers():
    text = "a\n<!-- BEGIN run_all:core -->\nold\n<!-- END run_all:core -->\nb\n<!-- BEGIN run_all:x -->\nkeep\n<!-- END run_all:x -->\n"
    new, found = report.replace_section(text, "core", "new table")
    assert found and "new table" in new and "old" not in new and "keep" in new
    assert report.replace_section(text, "missing", "y") == (text, False)


def test_sections_from_a_results_folder_draw_plots(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.setattr(report, "IMG", str(tmp_path / "img"))
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "core.jsonl").write_text("".join(json.dumps(r) + "\n" for r in core_rows()))
    (folder / "recovery.jsonl").write_text(json.dumps(
        {"bench": "elastic_recovery", "method": "inprocess", "recovery_s": 0.2, "lost_s": 0.3, "step_s": 0.1}) + "\n")
    found = report.sections(str(folder))
    assert set(found) == {"core", "headline", "recovery"}
    assert (tmp_path / "img" / "core_vs_bound.png").stat().st_size > 1000
    assert (tmp_path / "img" / "recovery.png").stat().st_size > 1000


def convergence_rows():
    """Two variants of one task at 2 and 3 ranks, two seeds each, with curves (as compression_convergence
    writes them)."""
    rows = []
    for ranks in (2, 3):
        for variant, label, accs, sent in (("dense", "dense", (0.90, 0.92), 1.0),
                                           ("topk:0.01", "topk(0.01)", (0.89, 0.90), 0.02)):
            runs = [{"accuracy": a, "sent": sent,
                     "curves": [[50, {"accuracy": a - 0.1, "train_loss": 1.0}], [100, {"accuracy": a, "train_loss": 0.5}]]}
                    for a in accs]
            row = {"task": "mlp", "variant": variant, "label": label, "metric": "accuracy", "ranks": ranks,
                   "seeds": 2, "mean": sum(accs) / 2, "sent": sent, "runs": runs,
                   "recipe": {"steps": 100, "global_batch": 96}}
            if variant != "dense":
                row.update(diff=-1.5, diff_se=0.5)
            rows.append(row)
    return rows


def test_convergence_table_has_every_rank_count_and_the_paired_difference():
    table = report.convergence_table(convergence_rows(), "x/convergence.jsonl")
    assert "| variant | 2 ranks | vs dense | 3 ranks | vs dense | bytes sent vs dense |" in table
    assert "| topk(0.01) | 89.50% | -1.50 ± 0.50 pp | 89.50% | -1.50 ± 0.50 pp | 0.020 |" in table
    assert "100 steps, global batch 96, 2 seeds" in table and "`x/convergence.jsonl`" in table


def test_convergence_plots_one_per_task(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    assert report.convergence_plots(convergence_rows(), str(tmp_path)) == ["convergence_mlp.png"]
    assert (tmp_path / "convergence_mlp.png").stat().st_size > 1000
