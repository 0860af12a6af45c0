#!/usr/bin/env python3
"""The import graph of perseus/ and native/, checked against the layers in docs/architecture.md.

Python: every ``import``/``from ... import`` of a perseus module, at module level or inside a function,
is an edge between files (a package import is an edge to its ``__init__.py``; ``from pkg import name``
is an edge to ``pkg/name.py`` when that file exists, else to ``pkg/__init__.py``). Native: every
``#include "x.h"`` is an edge, and ``x.h`` and ``x.cc`` count as one node (a stage).

Reports, and with --check fails (exit 1) on:
  - a folder whose modules sit in different layers (the folders show the layers), except the package root:
    its __init__ and two leaves that import no perseus module, ``_version`` and the compiled ``_core``;
  - a cycle between top-level packages (perseus/<name>/, the root's modules each on their own): a drawing of
    the tree, one box per package, has every arrow pointing down or sideways and none coming back;
  - a cycle between files (a strongly connected component of more than one node), other than those
    listed in ALLOWED_CYCLES with the reason docs/architecture.md gives;
  - an import from a lower layer to a higher one (LAYERS below);
  - an import inside a function of a perseus module that is not an optional framework or heavy
    third-party package (function-level imports of perseus modules hide the graph).

Usage: python tools/import_graph.py [--check] [--verbose]
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Layer of each module, by longest matching dotted prefix. Lower numbers sit lower; a module may import
# its own layer or any lower one. runner and convert (layer 0) stand apart: they import base only, and
# nothing but the package's own __init__ imports them.
LAYERS = [
    ("perseus.base", 1), ("perseus._version", 1),
    ("perseus.engine", 2), ("perseus.transport", 2), ("perseus.timeline", 2), ("perseus._core", 2),
    ("perseus.runtime", 3),
    ("perseus.compression", 4), ("perseus.sparse", 4),
    ("perseus.autotune", 5), ("perseus.elastic", 5),
    ("perseus.lifecycle", 6),
    ("perseus.torch", 7), ("perseus.tensorflow", 7), ("perseus.keras", 7),
    ("perseus.mxnet", 7), ("perseus.compat", 7),
    ("perseus.common", 7),  # Horovod's horovod.common.* paths: the base, runtime and elastic modules again
    ("perseus.runner", 0), ("perseus.convert", 0),
    ("perseus.ray", 0), ("perseus.spark", 0),  # run jobs on Ray's and Spark's workers: launchers, like perseusrun
    ("perseus", 8),  # the package's own __init__: the version and perseus.run (the launcher's API)
    # Spark ML estimators: they run jobs through the Spark launcher and their ranks train with the framework
    # adapters, so they sit above both; nothing else imports them.
    ("perseus.spark.common", 9), ("perseus.spark.torch", 9), ("perseus.spark.keras", 9),
    ("perseus.spark.lightning", 9),
]
LAYER_NAMES = {0: "tools (runner, convert, ray, spark)", 1: "base", 2: "engine", 3: "runtime", 4: "features",
               5: "services", 6: "lifecycle", 7: "adapters", 8: "package", 9: "estimators (Spark ML)"}

# Cycles kept on purpose; docs/architecture.md says why. Each entry is the set of files in the cycle.
ALLOWED_CYCLES: list[frozenset[str]] = []

# Function-level imports of perseus modules kept on purpose: (importer, imported) -> why.
ALLOWED_LAZY = {
    ("perseus.engine.native", "perseus._core"): "the compiled core is loaded after MPI's library, with a clear "
                                                "error when it was built for another MPI",
    ("perseus.runner", "perseus.runner.run_func"): "perseus.run's implementation imports the launcher, which "
                                                   "`python -m perseus.runner.launch` would otherwise load twice",
    ("perseus.runner.launch", "perseus.runner.elastic_run"): "only elastic jobs load the driver: importing it "
                                                             "up front makes `perseusrun --help` 50 -> 66 ms",
}

# Function-level imports are fine for these top-level packages (optional frameworks, heavy or optional
# third-party modules, or tools that only some paths need).
OPTIONAL_TOPLEVEL = {
    "torch", "tensorflow", "keras", "tf_keras", "mxnet", "horovod", "optuna", "libcst", "mpi4py",
    "numpy", "cupy", "ray", "pyspark", "psutil", "yaml", "matplotlib", "scipy", "sklearn",
}


# The compiled core: a module of the engine layer with no Python imports of its own.
EXTENSION = "perseus._core"


def layer_of(mod: str) -> int:
    best, layer = -1, 7
    for prefix, lay in LAYERS:
        if (mod == prefix or mod.startswith(prefix + ".")) and len(prefix) > best:
            best, layer = len(prefix), lay
    return layer


def _modules(pkg_root: str) -> dict[str, str]:
    """Map dotted module name -> path for every .py file under perseus/."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(pkg_root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
            if rel.endswith(".__init__"):
                rel = rel[: -len(".__init__")]
            out[rel] = path
    return out


def _resolve(name: str, mods: dict[str, str]) -> str | None:
    if name == EXTENSION or name.startswith(EXTENSION + "."):
        return EXTENSION
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


class _Visitor(ast.NodeVisitor):
    def __init__(self, mod: str, is_pkg: bool, mods: dict[str, str]):
        self.mod, self.is_pkg, self.mods = mod, is_pkg, mods
        self.edges: list[tuple[str, int, bool]] = []  # (target module, line, inside a function)
        self.hidden: list[tuple[str, int]] = []  # function-level imports of non-optional modules
        self.depth = 0
        self.type_checking = 0

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node):
        guard = isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" or (
            isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
        if guard:  # typing-only imports are not run, so they are not edges
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _add(self, target: str, line: int):
        inside = self.depth > 0
        top = target.split(".")[0]
        if top == "perseus":
            res = _resolve(target, self.mods)
            if res and res != self.mod:
                self.edges.append((res, line, inside))
                if inside:
                    self.hidden.append((res, line))
        elif inside and top not in OPTIONAL_TOPLEVEL and top not in sys.stdlib_module_names:
            self.hidden.append((target, line))

    def visit_Import(self, node):
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node):
        if node.level:
            parts = self.mod.split(".")
            base = parts if self.is_pkg else parts[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        for alias in node.names:
            full = f"{prefix}.{alias.name}"
            known = full in self.mods or full == EXTENSION
            self._add(full if known else prefix, node.lineno)


def python_graph():
    mods = _modules(os.path.join(ROOT, "perseus"))
    graph: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], int] = {}
    hidden: list[tuple[str, str, int]] = []
    for mod, path in sorted(mods.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        v = _Visitor(mod, path.endswith("__init__.py"), mods)
        v.visit(tree)
        graph[mod]
        graph[EXTENSION]
        for target, line, _inside in v.edges:
            graph[mod].add(target)
            where.setdefault((mod, target), line)
        for target, line in v.hidden:
            if target.startswith("perseus") and (mod, target) not in ALLOWED_LAZY:
                hidden.append((mod, target, line))
    return graph, where, hidden


def native_graph():
    ndir = os.path.join(ROOT, "native")
    graph: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], int] = {}
    inc = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
    for fn in sorted(os.listdir(ndir)):
        if not fn.endswith((".cc", ".h")):
            continue
        node = "native/" + fn.rsplit(".", 1)[0]
        graph[node]
        with open(os.path.join(ndir, fn), encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                m = inc.match(line)
                if m:
                    target = "native/" + os.path.basename(m.group(1)).rsplit(".", 1)[0]
                    if target != node:
                        graph[node].add(target)
                        where.setdefault((node, target), i)
    return graph, where


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative); only those with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


ROOT_LEAVES = {"perseus._version", EXTENSION}


def _folder(mod: str, mods: dict[str, str]) -> str:
    if mod == EXTENSION:
        return "perseus"
    return os.path.relpath(os.path.dirname(mods[mod]), ROOT)


def _package(mod: str) -> str:
    """The box a module is drawn in: its top-level package, or itself for a module at the package root."""
    parts = mod.split(".")
    if len(parts) == 1 or mod in ROOT_LEAVES:
        return mod
    return ".".join(parts[:2])


def folder_problems(graph: dict[str, set[str]]) -> list[str]:
    """Folders that mix layers, root leaves that import, and cycles between top-level packages."""
    mods = _modules(os.path.join(ROOT, "perseus"))
    out = []
    layers: dict[str, set[int]] = defaultdict(set)
    for mod in graph:
        if mod not in ROOT_LEAVES:
            layers[_folder(mod, mods)].add(layer_of(mod))
    for folder, found in sorted(layers.items()):
        if len(found) > 1:
            names = ", ".join(f"{LAYER_NAMES[x]}: " + " ".join(sorted(m for m in graph if m not in ROOT_LEAVES
                                                                    and _folder(m, mods) == folder
                                                                    and layer_of(m) == x))
                              for x in sorted(found))
            out.append(f"folder {folder} mixes layers ({names})")
    for leaf in sorted(ROOT_LEAVES):
        if graph.get(leaf):
            out.append(f"{leaf} sits at the package root as a leaf but imports {sorted(graph[leaf])}")
    boxes: dict[str, set[str]] = defaultdict(set)
    for src, targets in graph.items():
        boxes[_package(src)]
        for dst in targets:
            if _package(dst) != _package(src):
                boxes[_package(src)].add(_package(dst))
    out += [f"cycle between packages: {', '.join(c)}" for c in sccs(boxes)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 on a cycle, an upward or a hidden import")
    ap.add_argument("--verbose", action="store_true", help="list every upward and hidden import")
    args = ap.parse_args(argv)
    problems = 0

    pg, pwhere, hidden = python_graph()
    ng, _ = native_graph()
    for label, graph in (("python", pg), ("native", ng)):
        comps = [c for c in sccs(graph) if frozenset(c) not in ALLOWED_CYCLES]
        print(f"{label}: {len(graph)} files, {sum(len(v) for v in graph.values())} imports, "
              f"{len(comps)} cycle(s)")
        for comp in comps:
            problems += 1
            print(f"  cycle ({len(comp)}): " + ", ".join(comp))

    folders = folder_problems(pg)
    print(f"folders that mix layers, and cycles between packages: {len(folders)}")
    for line in folders:
        problems += 1
        print("  " + line)

    upward = []
    for src, targets in sorted(pg.items()):
        ls = layer_of(src)
        for dst in sorted(targets):
            ld = layer_of(dst)
            if ls == 8:  # the package's __init__ may name anything
                bad = False
            elif ls == 9:  # the estimators: any layer but the package's __init__
                bad = ld == 8
            elif ls == 0:  # the launcher and the converter: themselves and base only
                bad = ld not in (0, 1)
            else:
                bad = ld == 0 or ld > ls
            if bad:
                upward.append((src, dst, pwhere[(src, dst)], ls, ld))
    print(f"upward imports (a lower layer importing a higher one): {len(upward)}")
    for src, dst, line, ls, ld in upward:
        problems += 1
        print(f"  {src}:{line} ({LAYER_NAMES[ls]}) -> {dst} ({LAYER_NAMES[ld]})")

    print(f"imports of perseus modules inside functions: {len(hidden)}")
    if args.verbose or args.check:
        for src, dst, line in hidden:
            print(f"  {src}:{line} -> {dst}")
    problems += len(hidden)
    if args.check and problems:
        print(f"FAILED: {problems} problem(s)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
