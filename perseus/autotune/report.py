"""``perseus-autotune-report LOG -o tune.png``: draw an autotune log (HOROVOD_AUTOTUNE_LOG / --autotune-log-file).

One point per sample (seconds per step, by technique), the best so far as a line, and the setting chosen in
the title. Needs matplotlib (``pip install matplotlib`` or ``perseus[report]``).
"""

from __future__ import annotations

import argparse
import csv
import sys
from typing import Sequence

__all__ = ["main", "read_log"]


def read_log(path: str) -> list[dict]:
    """The log's rows (dicts keyed by column); raises ValueError when it is not an autotune log."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and "seconds_per_step" not in rows[0]:
        raise ValueError(f"{path} is not a perseus autotune log (no seconds_per_step column)")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="perseus-autotune-report", description=__doc__.splitlines()[0])
    ap.add_argument("log", help="the CSV log written with HOROVOD_AUTOTUNE_LOG / --autotune-log-file")
    ap.add_argument("-o", "--output", default="autotune.png", help="image to write (default autotune.png)")
    args = ap.parse_args(argv)
    try:
        rows = read_log(args.log)
    except (OSError, ValueError) as exc:
        print(f"perseus-autotune-report: error: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print(f"perseus-autotune-report: error: {args.log} has no samples yet", file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("perseus-autotune-report: error: drawing needs matplotlib; pip install matplotlib", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(9, 4.5))
    techniques = sorted({r["technique"] for r in rows})
    for t in techniques:
        mine = [(i + 1, float(r["seconds_per_step"]) * 1e3) for i, r in enumerate(rows) if r["technique"] == t]
        ax.scatter([m[0] for m in mine], [m[1] for m in mine], label=t, s=24)
    ax.plot(range(1, len(rows) + 1), [float(r["best_seconds_per_step"]) * 1e3 for r in rows], color="black",
            linewidth=1, label="best so far")
    best = min(rows, key=lambda r: float(r["seconds_per_step"]))
    ax.set_xlabel("sample")
    ax.set_ylabel("ms per step (slowest rank, median)")
    policy = f", policy {best['compression_policy']}" if best.get("compression_policy") else ""
    if best.get("sparse_algorithm"):
        policy += f", sparse {best['sparse_algorithm']}"
    ax.set_title(f"best: unit {int(best['tensor_fusion_threshold']) / (1 << 20):g} MB, {best['channels']} channels, "
                 f"{best['algorithm']}, cycle {best['cycle_time_ms']} ms{policy}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output} ({len(rows)} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
