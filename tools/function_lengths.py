#!/usr/bin/env python3
"""Functions in perseus/ (Python) and native/ (C++) longer than a limit, longest first; and source files
longer than a file limit (500 lines: a file holds one concept).

Python lengths come from the AST (first line of the ``def`` to the last line of its body, nested
functions counted on their own too). C++ lengths come from the braces: a ``{`` whose header has a
parameter list, opened at namespace, class or file scope, starts a function; it ends at its matching
``}`` (lambdas and blocks inside it count toward it). Comments, strings and character literals are
skipped.

Table-like functions (a binding table, a switch that maps one value to one result) may stay long;
they are listed in ALLOWED with the reason. Files are counted in perseus/ and native/, their tests
included; generated files are listed in GENERATED with their generator. ``--check`` exits 1 when any other
function or file is over its limit.

Usage: python tools/function_lengths.py [--limit 80] [--check] [paths...]
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# "path:function" -> why it may stay long.
ALLOWED: dict[str, str] = {}


# Generated files, which may be long: path -> what generates them.
GENERATED = {
    "native/settings.h": "tools/gen_settings.py (one field per engine setting)",
}
FILE_LIMIT = 500


def long_files(paths, limit: int = FILE_LIMIT):
    """(path relative to the repository, lines) of every .py, .cc and .h file under ``paths`` over ``limit``."""
    for top in paths:
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for fn in sorted(filenames):
                if fn.endswith((".py", ".cc", ".h")):
                    path = os.path.join(dirpath, fn)
                    with open(path, encoding="utf-8") as f:
                        lines = sum(1 for _ in f)
                    if lines > limit:
                        yield os.path.relpath(path, ROOT), lines


def python_functions(path: str):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            yield node.name, start, node.end_lineno - start + 1


_TOKEN = re.compile(r'//[^\n]*|/\*.*?\*/|R"(\w*)\(.*?\)\1"|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'',
                    re.S)


def _blank(m: re.Match) -> str:
    text = m.group(0)
    if text.startswith("/"):
        return re.sub(r"[^\n]", " ", text)
    return text[0] + re.sub(r"[^\n]", " ", text[1:-1]) + text[-1]


def cpp_functions(path: str):
    with open(path, encoding="utf-8") as f:
        src = _TOKEN.sub(_blank, f.read())
    src = re.sub(r"^\s*#.*$", lambda m: " " * len(m.group(0)), src, flags=re.M)
    stack: list[tuple[str, str, int]] = []  # (kind, name, start line)
    header_start = 0
    line = 1
    for i, ch in enumerate(src):
        if ch == "\n":
            line += 1
        elif ch in ";":
            header_start = i + 1
        elif ch == "{":
            header = src[header_start:i]
            enclosing = stack[-1][0] if stack else "namespace"
            kind, name = "block", ""
            if enclosing in ("namespace", "type"):
                if re.search(r"\b(namespace|extern)\b", header) and "(" not in header:
                    kind = "namespace"
                elif re.search(r"\b(class|struct|union|enum)\b", header.split("(")[0]):
                    kind = "type"
                elif "(" in header and not re.search(r"=\s*$", header.strip()):
                    kind = "function"
                    m = re.search(r"([~\w:]+)\s*\(", header.split(")")[0] + ")")
                    name = m.group(1) if m else "?"
                    # the header may span lines: report the line of its first non-blank character
                    first = len(header) - len(header.lstrip())
                    start_line = line - src[header_start + first:i].count("\n")
                    stack.append((kind, name, start_line))
                    header_start = i + 1
                    continue
            stack.append((kind, name, line))
            header_start = i + 1
        elif ch == "}":
            if stack:
                kind, name, start = stack.pop()
                if kind == "function":
                    yield name, start, line - start + 1
            header_start = i + 1


def scan(paths):
    for top in paths:
        walk = [(os.path.dirname(top), [], [os.path.basename(top)])] if os.path.isfile(top) else os.walk(top)
        for dirpath, dirnames, filenames in walk:
            dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "tests"))
            for fn in sorted(filenames):
                path = os.path.join(dirpath, fn)
                rel = os.path.relpath(path, ROOT)
                if fn.endswith(".py"):
                    funcs = python_functions(path)
                elif fn.endswith((".cc", ".h")):
                    funcs = cpp_functions(path)
                else:
                    continue
                for name, start, length in funcs:
                    yield rel, name, start, length


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--check", action="store_true", help="exit 1 when a function not in ALLOWED is over")
    ap.add_argument("paths", nargs="*", default=[os.path.join(ROOT, "perseus"), os.path.join(ROOT, "native")])
    args = ap.parse_args(argv)
    over = sorted((x for x in scan(args.paths) if x[3] > args.limit), key=lambda x: -x[3])
    bad = 0
    for rel, name, start, length in over:
        why = ALLOWED.get(f"{rel}:{name}")
        print(f"{length:5d}  {rel}:{start}  {name}" + (f"  (allowed: {why})" if why else ""))
        bad += why is None
    print(f"{len(over)} function(s) over {args.limit} lines, {bad} not allowed")
    files = list(long_files([p for p in args.paths if os.path.isdir(p)]))
    for rel, lines in files:
        why = GENERATED.get(rel)
        print(f"{lines:5d}  {rel}" + (f"  (generated by {why})" if why else ""))
        bad += why is None
    print(f"{len(files)} file(s) over {FILE_LIMIT} lines, {sum(r not in GENERATED for r, _ in files)} not generated")
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
