"""``perseus-convert``: convert training scripts (files or directories) to distributed perseus scripts.

Exit status: 0 = done and no manual step remains; 1 = ``--check`` found a file that would change, or a
manual step remains (see the warnings); 2 = usage error, or a file that cannot be parsed (left untouched).
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import sys
from typing import Iterator, List

from perseus.convert.context import Options
from perseus.convert.core import convert_source

SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".venv", "venv", "node_modules", ".tox", "build", "dist"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="perseus-convert",
        description="Rewrite single-process PyTorch / TensorFlow / Keras training scripts (and Horovod scripts) "
                    "into distributed perseus scripts. Run the result with: perseusrun -np N python <file>.",
        epilog="exit status: 0 converted, no manual step left; 1 --check would change a file, or manual steps "
               "remain (warnings); 2 usage error or unparsable input (left untouched)")
    p.add_argument("paths", nargs="+", help="files or directories (walked recursively for *.py)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("-o", "--output", help="output file (one input file only); default <name>_perseus.py")
    mode.add_argument("--in-place", action="store_true", help="rewrite the files, keeping <file>.bak")
    mode.add_argument("--diff", action="store_true", help="print a unified diff to stdout; write nothing")
    mode.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file would change")
    p.add_argument("--suffix", default="_perseus", help="suffix of written files (default: _perseus)")
    p.add_argument("--framework", choices=["auto", "torch", "tensorflow", "mxnet"], default="auto")
    p.add_argument("--scale-lr", action="store_true", help="multiply learning rates by size()")
    p.add_argument("--average-metrics", action="store_true",
                   help="average printed losses/accuracies over all ranks before rank 0 prints them")
    p.add_argument("-q", "--quiet", action="store_true", help="print warnings and errors only")
    return p


def _walk(path: str, suffix: str) -> Iterator[str]:
    if os.path.isfile(path):
        yield path
        return
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for f in sorted(files):
            if f.endswith(".py") and not f.endswith(f"{suffix}.py"):
                yield os.path.join(root, f)


def main(argv: List[str] = None) -> int:
    args = _parser().parse_args(argv)
    files: List[str] = []
    for p in args.paths:
        if not os.path.exists(p):
            print(f"perseus-convert: {p}: no such file or directory", file=sys.stderr)
            return 2
        files.extend(_walk(p, args.suffix))
    if args.output and len(files) != 1:
        print("perseus-convert: --output takes exactly one input file", file=sys.stderr)
        return 2
    options = Options(framework=args.framework, scale_lr=args.scale_lr, average_metrics=args.average_metrics)
    status = 0
    for path in files:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        result = convert_source(source, path, options)
        for line in result.lines():
            if not args.quiet or "warning:" in line or "error:" in line:
                print(line, file=sys.stderr)
        if result.error:
            status = 2
            continue
        if result.warnings:
            status = max(status, 1)
        if args.check:
            if result.changed:
                print(f"{path}: would change", file=sys.stderr)
                status = max(status, 1)
        elif args.diff:
            sys.stdout.writelines(difflib.unified_diff(source.splitlines(True), result.converted.splitlines(True),
                                                       f"{path}", f"{path} (perseus)"))
        elif args.in_place:
            if result.changed:
                shutil.copy2(path, path + ".bak")
                with open(path, "w", encoding="utf-8") as f:
                    f.write(result.converted)
                if not args.quiet:
                    print(f"{path}: rewritten (original in {path}.bak)", file=sys.stderr)
        else:
            out = args.output or os.path.splitext(path)[0] + args.suffix + ".py"
            with open(out, "w", encoding="utf-8") as f:
                f.write(result.converted)
            if not args.quiet:
                print(f"{path}: written to {out}" + ("" if result.changed else " (nothing to change)"),
                      file=sys.stderr)
    if status == 1 and not args.check:
        print("perseus-convert: manual steps remain (see the warnings above)", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
