"""Tables and plots from a results folder that benchmarks/run_all.py wrote.

    python benchmarks/report.py benchmarks/results/run_all [--print] [--root DIR]

Rewrites, in docs/benchmarks.md, docs/compression.md, docs/gpu.md and README.md, the text between ``<!-- BEGIN run_all:NAME -->`` and
``<!-- END run_all:NAME -->`` for every NAME whose phase has results in the folder (a phase without results
leaves its section as it is), and draws docs/img/*.png with matplotlib. Every table names its result file.
--print writes the tables to stdout instead of the docs (the plots are still drawn). --root DIR rewrites the docs
under DIR and draws the plots into DIR/docs/img instead (a copy of the docs, to look at a results folder's
tables without touching these). The tables of the dear, embrace, elastic_commit and compression phases come
from benchmarks/report_cluster.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convergence_report import convergence_plots, convergence_table  # noqa: E402
from report_cluster import compression_table, dear_table, elastic_commit_table, embrace_table  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
IMG = os.path.join(ROOT, "docs", "img")
WORKLOADS = {"resnet50": "ResNet-50 gradient set (161 tensors, 102 MB), ms per step",
             "bert_large": "BERT-large gradient set (391 tensors, 1.34 GB), ms per step",
             "many": "1000 x 1 KB async all-reduce, us per tensor",
             "one": "1-float synchronous all-reduce, us per round trip"}
LIBS = (("perseus", "perseus"), ("horovod", "Horovod 0.28.1"), ("gloo", "torch.distributed gloo"))
GOALS = {"resnet50": "<= 1.15x flat bound", "bert_large": "<= 1.08x flat bound", "many": "<= 3 us",
         "one": "<= 10 us"}


def load(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def fmt(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


# ------------------------------------------------------------------------------------------------- core
def core_summary(rows: list[dict]) -> dict:
    """Per workload and method: pooled median, and the medians of per-step ratios to each bound measured
    in the same job (same step index). Also the bounds with no library and the idle library's cost."""
    out = {}
    for w in WORKLOADS:
        wrows = [r for r in rows if r["workload"] == w]
        if not wrows:
            continue
        entry = out[w] = {"unit": wrows[0]["unit"], "methods": {}, "bounds": {}}
        for key, _ in LIBS:
            jobs = [r for r in wrows if key in r["samples"]]
            if not jobs:
                continue
            m = {"median": statistics.median([t for r in jobs for t in r["samples"][key]]), "rounds": len(jobs)}
            for bound in ("mpi_flat", "mpi_tensor"):
                ratios = [t / b for r in jobs if bound in r["samples"]
                          for t, b in zip(r["samples"][key], r["samples"][bound])]
                if ratios:
                    m[f"x_{bound}"] = statistics.median(ratios)
            entry["methods"][key] = m
        for lib in ("none", "perseus", "horovod"):
            jobs = [r for r in wrows if r["lib"] == lib]
            for bound in ("mpi_flat", "mpi_tensor"):
                vals = [t for r in jobs for t in r["samples"].get(bound, [])]
                if vals:
                    entry["bounds"][(lib, bound)] = statistics.median(vals)
        ms = entry["methods"]
        # one float: the flat buffer is the tensor itself
        none_bound = entry["bounds"].get(("none", "mpi_flat"), entry["bounds"].get(("none", "mpi_tensor")))
        for m in ms.values():
            if none_bound:
                m["x_none_flat"] = m["median"] / none_bound
        if "perseus" in ms and "horovod" in ms:  # per-round ratio of the paired jobs, then the median
            per = {r["round"]: statistics.median(r["samples"]["perseus"]) for r in wrows if r["lib"] == "perseus"}
            hv = {r["round"]: statistics.median(r["samples"]["horovod"]) for r in wrows if r["lib"] == "horovod"}
            ms["perseus"]["faster_than_horovod"] = statistics.median([hv[k] / per[k] for k in per if k in hv])
    return out


def ratio(m: dict, key: str) -> str:
    return f"{m[key]:.2f}x" if key in m else "-"


def core_tables(summary: dict, source: str) -> str:
    lines = ["| workload | method | median | x flat bound | x per-tensor bound | x flat bound, no library | goal |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for w, e in summary.items():
        for key, label in LIBS:
            m = e["methods"].get(key)
            if not m:
                continue
            extra = f" ({m['faster_than_horovod']:.1f}x faster than Horovod)" if "faster_than_horovod" in m else ""
            goal = GOALS[w] if key == "perseus" else ""
            lines.append(f"| {WORKLOADS[w]} | {label}{extra} | {fmt(m['median'])} | {ratio(m, 'x_mpi_flat')} | "
                         f"{ratio(m, 'x_mpi_tensor')} | {ratio(m, 'x_none_flat')} | {goal} |")
    lines += ["", "The bounds: raw MPI on the same bytes, medians, measured in each library's own job with the "
              "library initialised and idle, and in a job with no library. A library's idle cost is its bound "
              "over the bound with no library. The first two ratios above are medians of per-step ratios to the "
              "bounds in the library's own job; the third divides the library's median by the flat bound of "
              "the job with no library (what compares libraries whose idle costs differ). In perseus's job the "
              "gradients have been collapsed into huge pages by perseus (see \"Where the time goes\"), so the "
              "per-tensor bound there runs on the same faster memory and reads below the no-library one.", "",
              "| workload | bound | no library | perseus idle | Horovod idle | idle cost, perseus | idle cost, Horovod |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for w, e in summary.items():
        b = e["bounds"]
        for bound, label in (("mpi_flat", "flat"), ("mpi_tensor", "per tensor")):
            if ("none", bound) not in b:
                continue
            base = b[("none", bound)]
            cells = [fmt(b[(lib, bound)]) if (lib, bound) in b else "-" for lib in ("none", "perseus", "horovod")]
            costs = [f"{b[(lib, bound)] / base:.2f}x" if (lib, bound) in b else "-" for lib in ("perseus", "horovod")]
            lines.append(f"| {w} ({e['unit']}) | {label} | {' | '.join(cells)} | {' | '.join(costs)} |")
    lines += ["", f"Source: `{source}`."]
    return "\n".join(lines)


def core_plot(summary: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    names = [w for w in WORKLOADS if w in summary]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(LIBS)
    for i, (key, label) in enumerate(LIBS):
        vals = [summary[w]["methods"].get(key, {}).get("x_none_flat", 0) for w in names]
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=label)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks([j + width for j in range(len(names))])
    ax.set_xticklabels({"resnet50": "ResNet-50 set", "bert_large": "BERT-large set", "many": "1000 x 1 KB",
                        "one": "1-float sync"}[w] for w in names)
    ax.set_ylabel("time / raw MPI, flat, no library (log)")
    ax.set_title("All-reduce time against the raw-MPI bound, 2 ranks (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------- other phases
def profile_table(rows: list[dict], source: str) -> str:
    mem = {hp: [r["median_ms"] for r in rows if r.get("case") == "memory" and r.get("huge_pages") == hp]
           for hp in ("0", "1")}
    lines = ["| the same 102 MB, 2 ranks | median ms per step |", "| --- | --- |"]
    labels = {"mpi_numpy_pages": "raw MPI, a NumPy buffer (huge pages)", "mpi_torch_pages": "raw MPI, a torch buffer (4 KiB pages)",
              "mpi_torch_collapsed": "raw MPI, a torch buffer after MADV_COLLAPSE", "mpi_flat": "raw MPI, flat bound"}
    every = mem["0"] + mem["1"]
    for key, label in labels.items():
        vals = [m[key] for m in every if key in m]
        if vals:
            lines.append(f"| {label} | {statistics.median(vals):.1f} |")
    for hp, label in (("0", "perseus, ResNet-50 set, huge pages off"), ("1", "perseus, ResNet-50 set, huge pages on")):
        if mem[hp]:
            per = statistics.median(m["perseus"] for m in mem[hp])
            ratio = statistics.median(m["perseus"] / m["mpi_flat"] for m in mem[hp])
            lines.append(f"| {label} | {per:.1f} ({ratio:.2f}x the flat bound of the same job) |")
    lat = [r for r in rows if r.get("case") == "latency"]
    if lat:
        lines += ["", "| 1-float synchronous all-reduce | us per round trip | context switches per round trip | cores busy |",
                  "| --- | --- | --- | --- |"]
        for name in ("perseus", "mpi"):
            med = {k: statistics.median(r[name][k] for r in lat)
                   for k in ("us_per_round_trip", "context_switches_per_round_trip", "cores_busy")}
            lines.append(f"| {name} | {med['us_per_round_trip']:.1f} | {med['context_switches_per_round_trip']:.1f} | "
                         f"{med['cores_busy']:.2f} |")
    lines += ["", f"Source: `{source}`."]
    return "\n".join(lines)



def training_table(rows: list[dict], source: str) -> str:
    lines = ["| model | method | throughput (samples/s) | scaling efficiency | vs Horovod | vs DDP | "
             "CPU ms per step beside the training thread |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "method" not in r or "median_throughput" not in r:
            continue
        def g(k, f="{:.2f}"):
            return f.format(r[k]) if r.get(k) is not None else ""
        beside = [v for v in r.get("beside_cpu_per_step") or [] if v is not None]
        beside_ms = f"{max(0.0, 1e3 * statistics.median(beside)):.1f}" if beside else ""  # clock ticks: >= 0
        lines.append(f"| {r['model']} | {r['method']} | {g('median_throughput', '{:.1f}')} | {g('efficiency')} | "
                     f"{g('vs_horovod', '{:.2f}x')} | {g('vs_ddp', '{:.2f}x')} | {beside_ms} |")
    lines += ["", f"Source: `{source}`."]
    return "\n".join(lines)


def training_plot(rows: list[dict], path: str) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("median_throughput") is not None]
    models = sorted({r["model"] for r in rows})
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        mr = [r for r in rows if r["model"] == model]
        ax.bar([r["method"] for r in mr], [r["median_throughput"] for r in mr], color="tab:blue")
        ax.set_title(model)
        ax.set_ylabel("samples/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def multihost_table(rows: list[dict], source: str) -> str:
    lines = ["| method | median s per step | x link bound | Horovod's time / this |", "| --- | --- | --- | --- |"]
    for r in rows:
        if "median_s" in r:
            hv = f"{r['speedup_vs_horovod']:.2f}x" if "speedup_vs_horovod" in r else ""
            lines.append(f"| {r['method']} | {r['median_s']:.3f} | {r['over_bound']:.2f}x | {hv} |")
    lines += ["", "ResNet-50 set, 2 emulated hosts, one rank each (800 Mbit/s links, 200 Mbit/s per TCP flow); "
              "perseus-default sets nothing (8 channels, chosen by topology), perseus-Nch sets PERSEUS_NUM_CHANNELS; "
              f"the link bound is the bytes a ring must send per host over the link rate. Source: `{source}`."]
    return "\n".join(lines)


def multihost_plot(rows: list[dict], path: str) -> None:
    import matplotlib.pyplot as plt

    per = {int(r["method"].split("-")[1][:-2]): r["over_bound"] for r in rows
           if "median_s" in r and re.fullmatch(r"perseus-\d+ch", r["method"])}
    if not per:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = sorted(per)
    ax.plot(xs, [per[x] for x in xs], marker="o", label="perseus, N channels")
    for r in rows:
        if "median_s" in r and not re.fullmatch(r"perseus-\d+ch", r["method"]):
            ax.axhline(r["over_bound"], ls="--", lw=0.8, color="gray")
            ax.text(xs[-1], r["over_bound"], f" {r['method']}", va="center", fontsize=8)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels(xs)
    ax.set_xlabel("channels (concurrent TCP flows)")
    ax.set_ylabel("step time / link bound")
    ax.set_title("ResNet-50 set across 2 emulated hosts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recovery_table(rows: list[dict], source: str) -> str:
    methods = sorted({r["method"] for r in rows if "method" in r})
    lines = ["| method | recovery s | time lost s | step s |", "| --- | --- | --- | --- |"]
    for m in methods:
        mr = [r for r in rows if r.get("method") == m]
        med = {k: statistics.median([r[k] for r in mr if r.get(k) is not None] or [float("nan")])
               for k in ("recovery_s", "lost_s", "step_s")}
        lines.append(f"| {m} | {med['recovery_s']:.2f} | {med['lost_s']:.2f} | {med['step_s']:.3f} |")
    lines += ["", f"kill -9 of one of 2 emulated hosts' ranks; medians of {len(rows) // max(len(methods), 1)} rounds. "
              f"Source: `{source}`."]
    return "\n".join(lines)


def recovery_plot(rows: list[dict], path: str) -> None:
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in rows if "method" in r})
    if not methods:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.boxplot([[r["recovery_s"] for r in rows if r.get("method") == m and r.get("recovery_s") is not None]
                for m in methods])
    ax.set_xticks(range(1, len(methods) + 1))
    ax.set_xticklabels(methods)
    ax.set_ylabel("seconds from kill -9 to training again")
    ax.set_title("Elastic recovery")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------------------- docs
DEVICE_MODES = (("local", "no communication"), ("perseus", "perseus, launcher with device buckets"),
                ("perseus_rounds", "perseus, launcher, one launch per round (buckets off)"),
                ("perseus_host", "perseus, CPU channels (no launcher)"), ("ddp", "torch DDP"))


def device_table(rows: list[dict], source: str) -> str:
    """benchmarks/gpu_step.py --backend gloo runs: per model and injected launch cost, each mode's median step,
    its ratio to DDP's, its launches per step, and how far its parameters ended from DDP's."""
    lines = ["| model | launch cost | mode | ms per step | vs DDP | launches per step | max parameter difference vs DDP |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for model, m in r.get("models", {}).items():
            for key, label in DEVICE_MODES:
                if key not in m["median_step_ms"]:
                    continue
                launches = m["launches_per_step"].get(key)
                diff = m.get("max_param_diff_vs_ddp", {}).get(key)
                lines.append(f"| {model} | {r['launch_cost_ms']:g} ms | {label} | {m['median_step_ms'][key]:.1f} | "
                             f"{m.get('ratio_to_ddp', {}).get(key, float('nan')):.2f}x | "
                             f"{'' if launches is None or key == 'perseus_host' else f'{launches:g}'} | "
                             f"{'' if diff is None else f'{diff:.1e}'} |")
    lines += ["", f"Source: `{source}` ({rows[0]['ranks']} ranks, CPU tensors, modes interleaved, medians of "
              f"{rows[0]['rounds']} rounds of {rows[0]['steps_per_round']} steps)."]
    return "\n".join(lines)


def replace_section(text: str, name: str, body: str) -> tuple[str, bool]:
    pattern = re.compile(rf"(<!-- BEGIN run_all:{name} -->\n).*?(<!-- END run_all:{name} -->)", re.S)
    new, n = pattern.subn(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), text)
    return new, n > 0


def sections(folder: str) -> dict:
    """NAME -> markdown for every phase with results in folder; draws the plots on the way."""
    os.makedirs(IMG, exist_ok=True)
    rel = os.path.relpath(folder, ROOT)
    out = {}
    core = load(os.path.join(folder, "core.jsonl"))
    if core:
        summary = core_summary(core)
        out["core"] = core_tables(summary, f"{rel}/core.jsonl")
        core_plot(summary, os.path.join(IMG, "core_vs_bound.png"))
        p = summary.get("resnet50", {}).get("methods", {})
        if p:
            parts = [f"{label} {p[k]['x_none_flat']:.2f}x" for k, label in LIBS if k in p and "x_none_flat" in p[k]]
            short = {"resnet50": "ResNet-50 set", "bert_large": "BERT-large set", "many": "1 KB async tensors",
                     "one": "synchronous round trip"}
            faster = [f"{summary[w]['methods']['perseus']['faster_than_horovod']:.1f}x ({short[w]})" for w in WORKLOADS
                      if "faster_than_horovod" in summary.get(w, {}).get("methods", {}).get("perseus", {})]
            out["headline"] = ("![All-reduce time against the raw-MPI bound](docs/img/core_vs_bound.png)\n\n"
                               f"ResNet-50 gradient set on 2 ranks, time over raw MPI on one flat buffer with no library "
                               f"loaded: {', '.join(parts)}. perseus is faster than Horovod by {', '.join(faster)} "
                               f"(`{rel}/core.jsonl`; method, bounds and goals in [docs/benchmarks.md](docs/benchmarks.md)).")
    phases = {"profile": (profile_table, None, None),
              "training": (training_table, training_plot, "training.png"),
              "training_cluster": (training_table, None, None),
              "multihost": (multihost_table, multihost_plot, "multihost_channels.png"),
              "recovery": (recovery_table, recovery_plot, "recovery.png"),
              "device": (device_table, None, None),
              "dear": (dear_table, None, None),
              "embrace": (embrace_table, None, None),
              "elastic_commit": (elastic_commit_table, None, None),
              "compression": (compression_table, None, None)}
    rows = load(os.path.join(folder, "convergence.jsonl"))
    if rows:
        out["convergence"] = convergence_table(rows, f"{rel}/convergence.jsonl")
        for img in convergence_plots(rows, IMG):
            out["convergence"] += f"\n\n![{img[:-4]}](img/{img})"
    for name, (table, plot, img) in phases.items():
        rows = load(os.path.join(folder, f"{name}.jsonl"))
        if not rows:
            continue
        out[name] = table(rows, f"{rel}/{name}.jsonl")
        if plot:
            plot(rows, os.path.join(IMG, img))
            out[name] += f"\n\n![{name}](img/{img})"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--print", action="store_true")
    ap.add_argument("--root", default=ROOT, help="the tree whose docs are rewritten (default: this repository)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    global IMG
    IMG = os.path.join(os.path.abspath(args.root), "docs", "img")
    found = sections(os.path.abspath(args.folder))
    if args.print:
        for name, body in found.items():
            print(f"## {name}\n\n{body}\n")
        return 0
    for doc in ("docs/benchmarks.md", "docs/compression.md", "docs/gpu.md", "README.md"):
        path = os.path.join(args.root, doc)
        if not os.path.exists(path):
            continue
        text = open(path).read()
        for name, body in found.items():
            text, _ = replace_section(text, name, body)
        with open(path, "w") as f:
            f.write(text)
    print(f"regenerated: {', '.join(found) or 'nothing'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
