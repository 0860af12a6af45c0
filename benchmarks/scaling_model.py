"""An alpha-beta model of a data-parallel training step under perseus, fitted to committed measurements,
checked against the emulated cluster, and projected to 8-512 GPUs.

    python benchmarks/scaling_model.py                    # print the tables
    python benchmarks/scaling_model.py --write docs/scaling.md   # replace the generated block there

Inputs measured here (committed results, read by this script):
  * the emulated cluster (benchmarks/results/run_all/multihost.jsonl: 2 hosts, 800 Mbit/s links, each TCP
    flow capped at 200 Mbit/s; benchmarks/results/multihost_default_*.jsonl for 2 ranks per host): the
    fraction of a flow's rate a ring reaches (eta) and the per-byte cost of the work on the host (c), fitted on
    two of the measured configurations (1 and 8 channels, 1 rank per host); every other configuration is a
    check of the model, not an input;
  * the engine's software cost per tensor (benchmarks/results/run_all/core.jsonl: 1000 x 1 KB asynchronous
    all-reduces on 2 ranks, not oversubscribed).
Inputs assumed for the projection (not measured here, printed with the tables): the target cluster's message
latency, link and per-flow rates, GPUs per node and their intra-node bandwidth, and the compute time of a
step. The model:

  wire(S, H, flows)  = 2 (H-1)/H * S / (eta * min(link, flows * flow_rate))     ring across H hosts
  latency(H, units)  = units * 2 (H-1) * alpha / channels                          ring steps, units spread
  intra(S, g)        = 2 (g-1)/g * S / intra_bandwidth                             reduce-scatter + allgather
  comm               = intra + wire + latency (+ c * S on the host, for the emulated check only)
  control(P)         = tensors * t_tensor + units * ceil(log2 P) * alpha           negotiation, per step
  exposed            = max(comm / units, comm - overlap * compute)                 the last unit never hides
  efficiency         = compute / (compute + exposed + control)
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
START, END = "<!-- scaling-model:start -->", "<!-- scaling-model:end -->"

SETS = {"resnet50": {"bytes": 102228128, "tensors": 161, "label": "ResNet-50"},
        "bert_large": {"bytes": 1340567552, "tensors": 391, "label": "BERT-large"}}

# The projection's assumptions: a cluster of 8-GPU nodes on TCP.
ASSUMED = {
    "gpus_per_node": 8,
    "intra_node_GBps": 150.0,        # NVLink-class all-reduce bandwidth inside a node
    "alpha_us": 10.0,                # one message across the network (TCP)
    "flow_share": 0.3,               # one TCP flow reaches at most this share of the link (AIACC's measurement)
    "channels": 4,                   # perseus channels per rank
    "device_fusion_bytes": 64 << 20,  # perseus's default fusion unit for device tensors
    "overlap": 2.0 / 3.0,            # share of a step's compute (the backward pass) that communication may hide
    "compute_s": {"resnet50": 0.18, "bert_large": 0.25},  # per step on one V100-class GPU (ResNet-50 batch 64
                                                          # fp32; BERT-large seq 128 batch 16 mixed precision)
}
GPUS = (8, 16, 32, 64, 128, 256, 512)
LINKS_GBIT = (25, 100, 400)

# Published scaling efficiencies (their own setups; not run here).
PUBLISHED = [
    ("Horovod (its README)", "ResNet-101, Inception V3", "512 P100, 25 Gbit/s RoCE", "0.90"),
    ("Horovod (its README)", "VGG-16", "512 P100, 25 Gbit/s RoCE", "0.68"),
    ("Horovod (AIACC-Training paper)", "ResNet-50", "32 V100, 30 Gbit/s TCP", "0.75"),
    ("Horovod (AIACC-Training paper)", "BERT, VGG-16", "32 V100, 30 Gbit/s TCP", "0.40"),
    ("AIACC-Training (its paper)", "ResNet-50", "32 V100, 30 Gbit/s TCP", "> 0.96"),
    ("AIACC-Training (its paper)", "ResNet-50", "256 V100, 30 Gbit/s TCP", "> 0.95"),
]


# ----------------------------------------------------------------------------------------------- measurements
def _rows(path: str):
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def multihost_medians(paths) -> dict:
    """(method, set, ranks) -> (median step seconds, link Mbit/s, flow Mbit/s, channels) over the given files."""
    steps, meta = collections.defaultdict(list), {}
    for path in paths:
        for row in _rows(path):
            raw = row.get("raw", row)
            if "step_s" not in raw:
                continue
            key = (raw["method"], raw["set"], raw["ranks"])
            steps[key] += raw["step_s"]
            meta[key] = (float(row["link_mbit"]), float(row["flow_mbit"]), raw.get("channels"))
    return {k: (statistics.median(v),) + meta[k] for k, v in steps.items()}


def per_tensor_us(path: str) -> float:
    """Median perseus microseconds per 1 KB asynchronous all-reduce (2 ranks) in a run_all core file."""
    samples = []
    for row in _rows(path):
        if row.get("bench") == "core" and row.get("workload") == "many" and row.get("lib") == "perseus":
            samples += row["samples"]["perseus"]
    return statistics.median(samples)


# ----------------------------------------------------------------------------------------------- the model
def wire_s(nbytes: float, hosts: int, link_bps: float, flow_bps: float, flows: int, eta: float) -> float:
    """Seconds a ring across ``hosts`` needs to move its bytes over each host's link."""
    if hosts <= 1:
        return 0.0
    return 2.0 * (hosts - 1) / hosts * nbytes * 8 / (eta * min(link_bps, flows * flow_bps))


def fit(measured: dict) -> dict:
    """eta and c from the 1- and 8-channel ResNet-50 steps at 1 rank per host (two equations, two unknowns)."""
    t1, link, flow, _ = measured[("perseus-1ch", "resnet50", 2)]
    t8 = measured[("perseus-8ch", "resnet50", 2)][0]
    nbytes = SETS["resnet50"]["bytes"]
    w1 = wire_s(nbytes, 2, link * 1e6, flow * 1e6, 1, 1.0)
    w8 = wire_s(nbytes, 2, link * 1e6, flow * 1e6, 8, 1.0)
    eta = (w1 - w8) / (t1 - t8)
    c = (t8 - w8 / eta) / nbytes
    return {"eta": eta, "c_s_per_byte": c}


def emulated_step(method: str, set_name: str, ranks: int, link_mbit: float, flow_mbit: float, channels: int,
                  p: dict) -> float:
    """The model's step time on the emulated cluster (2 hosts, no added latency, host-side work c per byte per
    rank on the shared cores)."""
    nbytes, hosts = SETS[set_name]["bytes"], 2
    per_host = ranks // hosts
    link, flow = link_mbit * 1e6, flow_mbit * 1e6
    local = p["c_s_per_byte"] * nbytes * per_host  # the host's cores do every local rank's share
    if "-ring-" in method and per_host > 1:
        # one ring over all ranks: 2(P-1) steps of S/P each, every step limited by the one cross-host pair
        return 2.0 * (ranks - 1) / ranks * nbytes * 8 / (p["eta"] * min(link, channels * flow)) + local
    flows = channels * per_host
    return wire_s(nbytes, hosts, link, flow, flows, p["eta"]) + local


def project(set_name: str, gpus: int, link_gbit: float, p: dict, a: dict) -> dict:
    """Projected communication, control and efficiency of one step at ``gpus`` GPUs (hierarchical)."""
    nbytes, tensors = SETS[set_name]["bytes"], SETS[set_name]["tensors"]
    g = a["gpus_per_node"]
    hosts = max(1, gpus // g)
    alpha = a["alpha_us"] * 1e-6
    units = max(1, math.ceil(nbytes / a["device_fusion_bytes"]))
    intra = 2.0 * (g - 1) / g * nbytes / (a["intra_node_GBps"] * 1e9)
    link = link_gbit * 1e9
    wire = wire_s(nbytes, hosts, link, a["flow_share"] * link, g * a["channels"], p["eta"])
    latency = units * 2 * (hosts - 1) * alpha / a["channels"]
    comm = intra + wire + latency
    control = tensors * p["t_tensor_s"] + units * math.ceil(math.log2(gpus)) * alpha
    compute = a["compute_s"][set_name]
    exposed = max(comm / units, comm - a["overlap"] * compute)
    return {"comm_ms": comm * 1e3, "control_ms": control * 1e3, "exposed_ms": exposed * 1e3,
            "efficiency": compute / (compute + exposed + control)}


# ----------------------------------------------------------------------------------------------- report
def report(root: str = RESULTS) -> str:
    multihost = [os.path.join(root, "run_all", "multihost.jsonl")]
    multihost += sorted(os.path.join(root, f) for f in os.listdir(root) if f.startswith("multihost_default_"))
    measured = multihost_medians(multihost)
    p = fit(measured)
    p["t_tensor_s"] = per_tensor_us(os.path.join(root, "run_all", "core.jsonl")) * 1e-6
    out = [START, "",
           "Generated by `benchmarks/scaling_model.py` from the committed results; do not edit by hand.", "",
           "### Parameters measured here", "",
           "| parameter | value | from |", "| --- | --- | --- |",
           f"| eta: share of a flow's rate a ring reaches | {p['eta']:.3f} | emulated cluster, ResNet-50 set, "
           "1 and 8 channels, 1 rank per host |",
           f"| c: host-side work per byte per rank | {p['c_s_per_byte'] * 1e9:.2f} ns | the same two runs |",
           f"| t_tensor: engine software per tensor | {p['t_tensor_s'] * 1e6:.1f} us | 1000 x 1 KB async, 2 ranks "
           "(run_all core) |", "",
           "### The model against the emulated cluster", "",
           "Median step of the whole gradient set (seconds); the two fitted rows match by construction.", "",
           "| method | set | ranks | channels | measured | model | model / measured |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for key in sorted(measured, key=lambda k: (k[2], k[1], k[0])):
        method, set_name, ranks = key
        step, link, flow, channels = measured[key]
        if not method.startswith("perseus") or channels is None:
            continue
        model = emulated_step(method, set_name, ranks, link, flow, channels, p)
        fitted = " (fitted)" if key in {("perseus-1ch", "resnet50", 2), ("perseus-8ch", "resnet50", 2)} else ""
        out.append(f"| {method}{fitted} | {set_name} | {ranks} | {channels} | {step:.3f} | {model:.3f} | "
                   f"{model / step:.2f} |")
    for method in ("mpi", "horovod"):
        key = (method, "resnet50", 2)
        if key in measured:
            step, link, flow, _ = measured[key]
            w = wire_s(SETS["resnet50"]["bytes"], 2, link * 1e6, flow * 1e6, 1, 1.0)
            out.append(f"| {method} (not modelled: one flow) | resnet50 | 2 | - | {step:.3f} | - | its flow "
                       f"reaches {w / step:.2f} of the cap |")
    a = ASSUMED
    out += ["", "### Assumed for the projection (not measured here)", "",
            f"- {a['gpus_per_node']} GPUs per node, all-reduce inside a node at {a['intra_node_GBps']:.0f} GB/s; "
            "the hierarchical algorithm (reduce inside the node, ring across nodes per local rank, gather).",
            f"- A message across the network costs {a['alpha_us']:.0f} us; one TCP flow reaches at most "
            f"{a['flow_share']:.0%} of the link; {a['channels']} channels per rank, so "
            f"{a['gpus_per_node'] * a['channels']} flows leave each node.",
            f"- Gradients in float32, fused into units of {a['device_fusion_bytes'] >> 20} MiB; communication "
            f"hides behind {a['overlap']:.0%} of the compute, never the last unit's.",
            "- Compute per step on one GPU: " + ", ".join(
                f"{SETS[s]['label']} {t * 1e3:.0f} ms" for s, t in a["compute_s"].items())
            + " (V100-class figures: the GPUs of the published results below).",
            "- The host-side cost c is left out: on GPUs the reduction runs on the device.", "",
            "### Projection: scaling efficiency (communication per step, ms)", ""]
    for set_name in SETS:
        out += [f"**{SETS[set_name]['label']}** ({SETS[set_name]['bytes'] / 1e6:.0f} MB of gradients, "
                f"{SETS[set_name]['tensors']} tensors)", "",
                "| GPUs | " + " | ".join(f"{link} Gbit/s" for link in LINKS_GBIT) + " |",
                "| --- | " + " | ".join("---" for _ in LINKS_GBIT) + " |"]
        for gpus in GPUS:
            cells = []
            for link in LINKS_GBIT:
                r = project(set_name, gpus, link, p, a)
                cells.append(f"{r['efficiency']:.2f} ({r['comm_ms']:.0f} ms)")
            out.append(f"| {gpus} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["### Published figures beside it (their setups; not run here)", "",
            "| library | model | setup | scaling efficiency |", "| --- | --- | --- | --- |"]
    out += [f"| {lib} | {model} | {setup} | {eff} |" for lib, model, setup, eff in PUBLISHED]
    out += ["", END]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=RESULTS, help="the results folder (default: benchmarks/results)")
    ap.add_argument("--write", metavar="MARKDOWN", help="replace the generated block in this file")
    args = ap.parse_args(argv)
    text = report(args.results)
    if not args.write:
        print(text)
        return 0
    with open(args.write) as f:
        doc = f.read()
    if START not in doc or END not in doc:
        raise SystemExit(f"{args.write} has no {START} ... {END} block to replace")
    head, rest = doc.split(START, 1)
    with open(args.write, "w") as f:
        f.write(head + text + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
