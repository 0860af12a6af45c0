"""Summarise a benchmarks/results/*.jsonl file into the tables of docs/benchmarks.md."""

import json
import sys
from collections import defaultdict

import numpy as np


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    grads = [r for r in rows if r.get("bench") == "gradient_sets"]
    idle = [r for r in rows if r.get("bench") == "idle_overhead"]
    bound = {r["set"]: r["mpi_chunked_ms"] for r in grads if not r.get("tag") and "mpi_chunked_ms" in r}
    print("\n| gradient set | method | median ms | x chunked-MPI bound | x faster than Horovod |")
    print("| --- | --- | --- | --- | --- |")
    hvd = {r["set"]: r["horovod_ms"] for r in grads if "horovod_ms" in r}
    for r in grads:
        for key in ("mpi_chunked", "perseus", "gloo", "horovod"):
            if f"{key}_ms" not in r or (key == "mpi_chunked" and r.get("tag")):
                continue
            name = key + (f" ({r['tag']})" if r.get("tag") and key == "perseus" else "")
            ratio = r.get(f"{key}_over_bound") or (r[f"{key}_ms"] / bound[r["set"]] if r["set"] in bound else None)
            ratio_s = f"{ratio:.2f}" if ratio and key != "mpi_chunked" else ("1.00" if key == "mpi_chunked" else "")
            faster = f"{hvd[r['set']] / r[f'{key}_ms']:.1f}" if r["set"] in hvd and key != "horovod" else ""
            print(f"| {r['set']} | {name} | {r[f'{key}_ms']:.1f} | {ratio_s} | {faster} |")
    by_lib = defaultdict(lambda: defaultdict(list))
    for r in idle:
        for k in ("torch_s", "python_s", "other_threads_cpu_share"):
            by_lib[r["lib"]][k].append(r[k])
    if idle:
        base = {k: np.median(v) for k, v in by_lib["none"].items()}
        print("\n| library | torch loop x none | Python loop x none | library threads' CPU (share of a core) |")
        print("| --- | --- | --- | --- |")
        for lib, vals in by_lib.items():
            t, p, c = (np.median(vals[k]) for k in ("torch_s", "python_s", "other_threads_cpu_share"))
            print(f"| {lib} | {t / base['torch_s']:.2f} | {p / base['python_s']:.2f} | {100 * c:.1f}% |")


if __name__ == "__main__":
    main(sys.argv[1])
