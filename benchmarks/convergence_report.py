"""Tables and curves of benchmarks/compression_convergence.py's JSON lines (the run_all convergence phase).

Used by benchmarks/report.py: :func:`convergence_table` gives one Markdown table per task (every variant at
every rank count, the mean over seeds and the paired difference to dense with its standard error), and
:func:`convergence_plots` draws, per task, the held-out metric and the training loss against the step
(median over seeds) for every variant, into docs/img/convergence_<task>.png.
"""

from __future__ import annotations

import os
import statistics

TITLES = {"mlp": "MLP, SGD momentum 0.9 (test accuracy)",
          "mlp_short": "Narrower MLP, 300 steps, SGD momentum 0.9 (test accuracy)",
          "digits": "CNN on digits, SGD momentum 0.9 (test accuracy)",
          "transformer": "Transformer encoder LM, AdamW (held-out loss, nats/token)",
          "lm": "GRU LM (held-out loss, nats/token)",
          "linear": "Least squares, signal in small gradients (relative error)"}


def _rank_counts(rows: list[dict]) -> list[int]:
    return sorted({int(r.get("ranks", 0)) for r in rows})


def _cell(row: dict | None) -> tuple[str, str]:
    if row is None:
        return "", ""
    acc = row["metric"] == "accuracy"
    value = f"{100 * row['mean']:.2f}%" if acc else f"{row['mean']:.4f}"
    if "diff" not in row or row["variant"] == "dense":
        return value, ""
    se = f" ± {row['diff_se']:.2f}" if row.get("diff_se") is not None else ""
    return value, f"{row['diff']:+.2f}{se} {'pp' if acc else '%'}"


def convergence_table(rows: list[dict], source: str) -> str:
    """One table per task: each variant's mean at every rank count, its paired difference to dense over the
    same seeds, and the bytes it submitted relative to dense float32."""
    out = []
    counts = _rank_counts(rows)
    for task in dict.fromkeys(r["task"] for r in rows):
        trows = [r for r in rows if r["task"] == task]
        first = trows[0]
        recipe = first.get("recipe", {})
        head = "| variant | " + " | ".join(f"{n} ranks | vs dense" for n in counts) + " | bytes sent vs dense |"
        out += [f"**{TITLES.get(task, task)}**: {recipe.get('steps', '?')} steps, global batch "
                f"{recipe.get('global_batch', '?')}, {first.get('seeds', '?')} seed{'s' if first.get('seeds') != 1 else ''}.", "",
                head, "| --- |" + " --- | --- |" * len(counts) + " --- |"]
        for variant in dict.fromkeys(r["variant"] for r in trows):
            by_n = {int(r["ranks"]): r for r in trows if r["variant"] == variant}
            label = next(iter(by_n.values())).get("label", variant)
            cells = []
            for n in counts:
                cells += list(_cell(by_n.get(n)))
            sent = statistics.mean(r["sent"] for r in by_n.values())
            out.append(f"| {label} | " + " | ".join(cells) + f" | {sent:.3f} |")
        if "entropy_rate" in recipe:
            out.append(f"\nBest possible held-out loss (the chain's entropy rate): {recipe['entropy_rate']:.4f}.")
        out.append("")
    out.append(f"Source: `{source}`.")
    return "\n".join(out)


def _median_curve(runs: list[dict], key: str) -> tuple[list, list]:
    curves = [run.get("curves") for run in runs if run.get("curves")]
    if not curves:
        return [], []
    steps = [s for s, _ in curves[0]]
    values = [statistics.median(c[i][1][key] for c in curves if i < len(c) and key in c[i][1])
              for i in range(len(steps))]
    return steps, values


def convergence_plots(rows: list[dict], img_dir: str, ranks: int = 2) -> list[str]:
    """Draw docs/img/convergence_<task>.png for every task with curves at ``ranks`` ranks; returns the file
    names drawn."""
    import matplotlib.pyplot as plt

    drawn = []
    for task in dict.fromkeys(r["task"] for r in rows):
        trows = [r for r in rows if r["task"] == task and int(r.get("ranks", 0)) == ranks
                 and any(run.get("curves") for run in r.get("runs", []))]
        if not trows:
            continue
        metric = trows[0]["metric"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
        for r in trows:
            label = r.get("label", r["variant"])
            style = {"color": "black", "linewidth": 2} if r["variant"] == "dense" else {}
            steps, values = _median_curve(r["runs"], metric)
            if metric == "accuracy":
                values = [100 * v for v in values]
            left.plot(steps, values, label=label, **style)
            steps, values = _median_curve(r["runs"], "train_loss")
            right.plot(steps, values, label=label, **style)
        left.set_title(f"{TITLES.get(task, task)}, {ranks} ranks")
        left.set_xlabel("step")
        left.set_ylabel("test accuracy (%)" if metric == "accuracy" else "held-out loss")
        if metric == "accuracy":
            top = max(100 * r["mean"] for r in trows)
            left.set_ylim(max(0.0, top - 25), min(100.0, top + 2))
        right.set_title("training loss (median over seeds)")
        right.set_xlabel("step")
        right.set_yscale("log")
        right.legend(fontsize=7)
        fig.tight_layout()
        name = f"convergence_{task}.png"
        fig.savefig(os.path.join(img_dir, name), dpi=100)
        plt.close(fig)
        drawn.append(name)
    return drawn
