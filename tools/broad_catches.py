#!/usr/bin/env python3
"""Broad exception handlers in perseus/ (Python) and native/ (C++) that do not say why they are safe.

A broad handler is ``except:``, ``except Exception``, ``except BaseException`` (alone or in a tuple) in Python
and ``catch (...)`` or ``catch (const std::exception&)`` in C++. It is accepted when

- it re-raises: its body ends with a bare ``raise`` (Python) or ``throw;`` (C++), or
- a comment on the handler's line, or on the first line of its body, gives a reason (a lint marker such as
  ``# noqa: BLE001`` alone is not a reason: ``# noqa: BLE001 - the reason`` is).

Anything else can turn a failure into silence, so ``--check`` exits 1 and lists it.

Usage: python tools/broad_catches.py [--check] [paths...]
"""
from __future__ import annotations

import argparse
import ast
import io
import os
import re
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BROAD = {"Exception", "BaseException"}
_LINT_ONLY = re.compile(r"^\s*(noqa(:\s*[A-Z0-9, ]+)?|pylint:\s*disable=[\w,-]+|type:\s*ignore)\s*$")


def _comments(source: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _has_reason(comment: str | None) -> bool:
    if not comment:
        return False
    text = re.sub(r"^noqa(:\s*[A-Z0-9, ]+)?\s*(-|:|—)?\s*", "", comment)
    return bool(text.strip()) and not _LINT_ONLY.match(text)


def _is_broad(node: ast.ExceptHandler) -> bool:
    if node.type is None:
        return True
    names = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
    return any(isinstance(n, ast.Name) and n.id in BROAD for n in names)


def python_findings(path: str):
    """(line, text) for each broad handler in ``path`` that neither re-raises nor says why."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    comments = _comments(source)
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source, path)):
        if not isinstance(node, ast.ExceptHandler) or not _is_broad(node):
            continue
        last = node.body[-1]
        if isinstance(last, ast.Raise) and last.exc is None:
            continue
        if _has_reason(comments.get(node.lineno)) or _has_reason(comments.get(node.body[0].lineno)) or \
                _has_reason(comments.get(node.body[0].lineno - 1)) and node.body[0].lineno - 1 > node.lineno:
            continue
        yield node.lineno, lines[node.lineno - 1].strip()


_CATCH = re.compile(r"catch\s*\(\s*(\.\.\.|const\s+std::exception\s*&\s*\w*)\s*\)\s*\{")


def _rethrows(source: str, start: int) -> bool:
    """Whether the catch body that opens just before ``start`` ends with ``throw;``."""
    depth, i = 1, start
    while depth and i < len(source):
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        i += 1
    return bool(re.search(r"throw\s*;\s*}$", source[start - 1:i]))


def cpp_findings(path: str):
    """(line, text) for each ``catch (...)`` / ``catch (const std::exception&)`` that neither rethrows nor
    carries a comment (``//``) on its line or the next."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    lines = source.splitlines()
    for m in _CATCH.finditer(source):
        line = source.count("\n", 0, m.start()) + 1
        here = lines[line - 1]
        following = lines[line] if line < len(lines) else ""
        if "//" in here or following.strip().startswith("//") or _rethrows(source, m.end()):
            continue
        yield line, here.strip()


def scan(paths):
    for top in paths:
        for dirpath, _, files in os.walk(top):
            for name in sorted(files):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ROOT)
                if name.endswith(".py"):
                    yield from ((rel, n, t) for n, t in python_findings(path))
                elif name.endswith((".cc", ".h")) and os.sep + "tests" + os.sep not in path:
                    yield from ((rel, n, t) for n, t in cpp_findings(path))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when any broad handler gives no reason")
    parser.add_argument("paths", nargs="*", default=[os.path.join(ROOT, "perseus"), os.path.join(ROOT, "native")])
    args = parser.parse_args(argv)
    found = list(scan(args.paths))
    for rel, line, text in found:
        print(f"{rel}:{line}: {text}")
    print(f"{len(found)} broad handler(s) without a stated reason")
    return 1 if (args.check and found) else 0


if __name__ == "__main__":
    sys.exit(main())
