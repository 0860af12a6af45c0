"""Tables of the run_all phases that wrap a benchmark across the emulated hosts: dear, embrace, elastic_commit and
compression (benchmarks/report.py calls these; each takes the phase's JSON lines and the path to name as source).

dear.py, sparse.py and compression.py write, per run, one line per job (``{..., "raw": {...}}``) and then one
summary line per method (the medians and ratios the script prints); elastic_commit.py writes one line per run
of a mode. When a file holds more than one run, a method's last summary line is the one shown.
"""

from __future__ import annotations

import statistics

HORO = "Horovod 0.28.1"
CLUSTER = "2 emulated hosts (800 Mbit/s links, 200 Mbit/s per TCP flow)"


def _summaries(rows: list[dict]) -> dict:
    """method -> its last summary line (the lines without "raw"), in the order the methods first appear."""
    out = {}
    for r in rows:
        if "raw" not in r and "method" in r:
            out[r["method"]] = r
    return out


def _x(num, den) -> str:
    return f"{num / den:.2f}x" if num is not None and den else "-"


def _n(v) -> str:
    return f"{v:,}" if isinstance(v, int) else str(v)


def _mb(v) -> str:
    return "-" if v is None else f"{v:.2f}"


# ------------------------------------------------------------------------------------------------- dear
def _dear_label(method: str, groups) -> str:
    if method == "default":
        return "perseus, default schedule"
    if method == "horovod":
        return HORO
    name, _, threshold = method.partition(":")
    if name == "dear":  # PERSEUS_DEAR_THRESHOLD_BYTES: 4 MiB unless the method names it
        size = f"{int(threshold) / 2 ** 20:g} MiB" if threshold else "4 MiB"
        return f"perseus, DeAR ({f'{groups} groups' if groups else 'groups'} of up to {size})"
    return method


def dear_table(rows: list[dict], source: str) -> str:
    """benchmarks/dear.py: each method's median step, where its time goes, its ratios to the default schedule and
    to Horovod; then (RS + AG) / AR from the rsag jobs."""
    summ = _summaries(rows)
    med = {m: r["median_step_s"] for m, r in summ.items()}
    lines = ["| method | median s per step | x default | Horovod's time / this | forward s | backward s | "
             "`step()` s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for m, r in summ.items():
        lines.append(f"| {_dear_label(m, r.get('groups'))} | {r['median_step_s']:.3f} | {_x(med[m], med.get('default'))} | "
                     f"{_x(med.get('horovod'), med[m])} | {r['forward_s']:.3f} | {r['backward_s']:.3f} | "
                     f"{r['step_call_s']:.3f} |")
    said = []
    if "dear" in med and "default" in med:
        said.append(f"DeAR / default: **{med['dear'] / med['default']:.2f}x**")
    if "dear" in med and "horovod" in med:
        said.append(f"Horovod / DeAR: **{med['horovod'] / med['dear']:.2f}x**")
    if said:
        lines += ["", "; ".join(said) + "."]
    splits = [x for r in rows if "rsag" in r.get("raw", {}) for x in r["raw"]["rsag"]]
    if splits:
        lines += ["", "| buffer | MiB | all-reduce ms | reduce-scatter ms | all-gather ms | (RS + AG) / AR |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for label, what in (("model", "the model's gradients"), ("group", "one DeAR group")):
            sel = [x for x in splits if x["size"] == label]
            if sel:
                ar, rs, ag = (statistics.median(x[k] for x in sel) for k in ("ar_s", "rs_s", "ag_s"))
                lines.append(f"| {what} | {sel[0]['bytes'] / 2 ** 20:.1f} | {ar * 1e3:.1f} | {rs * 1e3:.1f} | "
                             f"{ag * 1e3:.1f} | **{(rs + ag) / ar:.2f}** |")
    first = next(iter(summ.values()), rows[0])
    layers, width = first.get("layers"), first.get("width")
    model = (f"An MLP of {layers} Linear({width}, {width}) + ReLU "
             f"({layers * (width * width + width) * 4 / 2 ** 20:.1f} MiB of float32 gradients)" if layers else "An MLP")
    compute = summ.get("default", first).get("compute_s")
    lines += ["", f"{model}, batch {first.get('batch')} per rank, SGD with momentum, {CLUSTER}, "
              f"{first.get('ranks_per_host', 1)} rank per host; one job per method and round, {first.get('rounds')} "
              "rounds in rotating order; medians over every timed window of the slowest rank's time per step. "
              "Forward includes DeAR's all-gather waits and per-group updates"
              + (f"; forward + backward with no communication take {compute:.3f} s" if compute else "")
              + ". The (RS + AG) / AR rows: perseus's reduce-scatter and all-gather of the same buffer against "
              f"its all-reduce (medians of the rsag jobs). Source: `{source}`."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- embrace
SPARSE_LABELS = {"allgather": "perseus, sparse gradients allgathered", "dense": "perseus, `sparse_as_dense`",
                 "zen": "perseus, Zen", "auto": "perseus, `auto`",
                 "embrace": "perseus, EmbRace (`DistributedEmbedding`)", "horovod": f"{HORO} (allgather)"}


def embrace_table(rows: list[dict], source: str) -> str:
    """benchmarks/sparse.py across hosts: per method the median step, ratios to perseus's allgather path and to
    Horovod, the bytes perseus's counters saw and the bytes that crossed between the hosts."""
    summ = _summaries(rows)
    med = {m: r["median_ms"] for m, r in summ.items()}
    lines = ["| method | median ms per step | x allgather | x Horovod | sent MB per step | "
             "MB per step between hosts |", "| --- | --- | --- | --- | --- | --- |"]
    for m, r in summ.items():
        lines.append(f"| {SPARSE_LABELS.get(m, m)} | {r['median_ms']:.1f} | {_x(med[m], med.get('allgather'))} | "
                     f"{_x(med[m], med.get('horovod'))} | {_mb(r.get('sent_mb'))} | {_mb(r.get('link_mb'))} |")
    f = next(iter(summ.values()), rows[0])
    vocab, dim = f.get("vocab"), f.get("dim")
    table_mb = f" ({vocab * dim * 4 / 1e6:.1f} MB)" if vocab and dim else ""
    lines += ["", f"An embedding table of {_n(vocab)} x {_n(dim)} float32{table_mb} and a small dense head, SGD; "
              f"every rank draws {_n(f.get('tokens'))} token ids per step from a Zipf law (exponent {f.get('zipf')}) over one "
              f"shared permutation of the vocabulary. {f.get('ranks', 4)} ranks, 2 on each of {CLUSTER}; one job "
              f"per method and round, {f.get('rounds')} rounds in rotating order; median step of the slowest rank. "
              "Sent: the largest rank's bytes by perseus's counters (`hvd.wire_bytes()`, perseus only); between "
              "hosts: the hosts' interface transmit counters summed (TCP/IP headers included, every method). "
              f"Source: `{source}`."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- elastic_commit
COMMIT_MODES = {"none": "no commit", "gemini": "`state.commit()` every step, the defaults (background copy, "
                "chunks sent in the job's network gaps)",
                "eager": "`state.commit()` every step, all at once (`PERSEUS_ELASTIC_SNAPSHOT=sync`, "
                "`PERSEUS_GEMINI_MAX_DEFER_MS=0`)"}


def elastic_commit_table(rows: list[dict], source: str) -> str:
    """benchmarks/elastic_commit.py: per mode the median over rounds of each run's median step, and its ratio
    to ``none`` (as the script reports them)."""
    modes = list(dict.fromkeys(r["mode"] for r in rows if "mode" in r))
    med = {m: statistics.median(r["step_s"] for r in rows if r.get("mode") == m) for m in modes}
    lines = ["| mode | median ms per step | x none |", "| --- | --- | --- |"]
    for m in sorted(modes, key=lambda m: list(COMMIT_MODES).index(m) if m in COMMIT_MODES else len(COMMIT_MODES)):
        lines.append(f"| `{m}`: {COMMIT_MODES.get(m, m)} | {med[m] * 1e3:.1f} | {_x(med[m], med.get('none'))} |")
    r0 = rows[0]
    n = max(sum(1 for r in rows if r.get("mode") == m) for m in modes) if modes else 0
    lines += ["", f"A {r0.get('state_mb', 0):g} MB state (MLP parameters + SGD momentum), batch {r0.get('batch')} per "
              "rank, one rank on each of 2 emulated hosts (unshaped links) under perseusrun's elastic launcher; "
              f"medians over {n} rounds (modes interleaved) of each run's median step after its warm-up steps. "
              f"Source: `{source}`."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- compression
def _compression_label(method: str, density) -> str:
    lib, name = (HORO, method[len("horovod-"):]) if method.startswith("horovod-") else ("perseus", method)
    d = f"{density:g}" if density is not None else "?"
    name = {"dense": "dense", "topk": f"topk({d})", "topk-noef": f"topk({d}), no error feedback",
            "hitopk": f"hitopk({d})", "randomk": f"randomk({d})", "powersgd": "powersgd(4)",
            "espresso": f"espresso (density {d})", "cupcake": f"cupcake(topk({d}))"}.get(name, name)
    return f"{lib} {name}"


OPTIMIZERS = {"sgd": "plain SGD", "momentum": "SGD with momentum 0.9", "adamw": "AdamW"}


def compression_table(rows: list[dict], source: str) -> str:
    """benchmarks/compression.py: per method the median step, its ratios to perseus's dense step and to
    Horovod's fp16 and dense steps, and the bytes per step (perseus's counters)."""
    summ = _summaries(rows)
    med = {m: r["median_s"] for m, r in summ.items()}
    lines = ["| method | median s per step | x perseus dense | x Horovod fp16 | x Horovod dense | sent MB per step | "
             "bytes x dense |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for m, r in summ.items():
        sent = r.get("sent_vs_dense")
        lines.append(f"| {_compression_label(m, r.get('density'))} | {r['median_s']:.3f} | "
                     f"{_x(med[m], med.get('dense'))} | {_x(med[m], med.get('horovod-fp16'))} | "
                     f"{_x(med[m], med.get('horovod-dense'))} | {_mb(r.get('sent_mb_per_step'))} | "
                     f"{'-' if sent is None else f'{sent:.3f}'} |")
    f = next(iter(summ.values()), rows[0])
    params = next((r["raw"]["params"] for r in rows if "params" in r.get("raw", {})), None)
    shapes = f"ResNet-50's parameter shapes ({params / 1e6:.1f}M parameters)" if params else "ResNet-50's parameter shapes"
    lines += ["", f"A training step of {shapes} through DistributedOptimizer ({OPTIMIZERS.get(f.get('optimizer'), f.get('optimizer'))}), "
              f"{f.get('compute_ms', 0):g} ms of CPU work standing in for forward and backward; "
              f"{f.get('ranks_per_host', 1)} rank on each of {CLUSTER}; one job per method and round, "
              f"{f.get('rounds')} rounds in rotating order; median step of the slowest rank. Sent: this rank's bytes "
              f"per step by perseus's counters (`hvd.wire_bytes()`; not counted for Horovod). Source: `{source}`."]
    return "\n".join(lines)
