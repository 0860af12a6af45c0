#!/usr/bin/env python3
"""Compare a run of Horovod's own tests (tools/run_horovod_tests.sh's output) with the counts docs/compatibility.md
records, so that a regression is seen: a file with fewer passing or more failing tests than the table says fails
the check (exit 1), naming it. Files the table does not list, or lists with a collection error, are reported and
not judged.

    python tools/check_horovod_counts.py run.log [--keras 3|tf-keras]    (the Keras of that run; default 3)
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SUMMARY = re.compile(r"^(?:=+ )?(\d+ (?:failed|passed|skipped|errors?|deselected|warnings?)\b.*) in [0-9.]+s")


def run_counts(text: str) -> dict[str, dict[str, int]]:
    """``file -> {"passed": n, "failed": n, "skipped": n, "errors": n}`` from the run's output (the first pytest
    summary line after each ``== file`` header; every rank prints the same one)."""
    counts: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        if line.startswith("== ") and line.endswith(".py"):
            current = line[3:].strip()
            continue
        match = _SUMMARY.match(line)
        if current and match and current not in counts:
            found = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
            for n, what in re.findall(r"(\d+) (\w+)", match.group(1)):
                key = "errors" if what.startswith("error") else what
                if key in found:
                    found[key] = int(n)
            counts[current] = found
    return counts


def documented(keras: str) -> dict[str, dict[str, int]]:
    """``file -> {"passed", "skipped", "failed"}`` from docs/compatibility.md's results table, for the rows of
    this Keras (``3``: rows marked 3, either, or no Keras; ``tf-keras``: rows marked tf-keras 2 or either)."""
    with open(os.path.join(ROOT, "docs", "compatibility.md")) as f:
        text = f.read()
    out = {}
    wanted = ("3", "either", "") if keras == "3" else ("tf-keras 2", "either")
    for line in text.splitlines():
        if not line.startswith("| `test_"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 6:
            continue
        name = re.match(r"`(test_\w+\.py)`", cells[0]).group(1)
        kind, _tests, passed, skipped, failed = cells[1:6]
        if kind not in wanted or not passed.isdigit():
            continue
        out[name] = {"passed": int(passed), "skipped": int(skipped or 0), "failed": int(failed or 0)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--keras", choices=("3", "tf-keras"), default="3")
    args = ap.parse_args(argv)
    with open(args.log, errors="replace") as f:
        got = run_counts(f.read())
    want = documented(args.keras)
    worse = []
    for name, counts in sorted(got.items()):
        expected = want.get(name)
        line = f"{name}: {counts['passed']} passed, {counts['failed'] + counts['errors']} failed, " \
               f"{counts['skipped']} skipped"
        if expected is None:
            print(f"{line} (not in docs/compatibility.md's table)")
            continue
        bad = counts["passed"] < expected["passed"] or counts["failed"] + counts["errors"] > expected["failed"]
        print(f"{line}; documented {expected['passed']} passed, {expected['failed']} failed"
              f"{'  <- WORSE' if bad else ''}")
        if bad:
            worse.append(name)
    if worse:
        print(f"worse than docs/compatibility.md: {', '.join(worse)}", file=sys.stderr)
        return 1
    print("no file is worse than docs/compatibility.md records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
