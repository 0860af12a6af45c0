"""Reads of files that the converted script writes on rank 0 only: rank 0 reads them and sends them on.

Once the converter has put a checkpoint save under ``if hvd.rank() == 0:``, a later read of that file on every
rank (the best model reloaded for a final test, a checkpoint to resume from) finds nothing on the other ranks:
the file is not written yet (a race on one host) or never will be (another host, no shared file system). In a
script with such rank-0-only writes, every checkpoint read (``torch.load``, ``load_model``, ``load_weights``,
``load_parameters``...) takes its path through :func:`perseus.common.files.root_file`: rank 0 reads the
file, every rank gets a local copy and loads it as before. A plain ``open(path)`` read is rewritten when its
path shares a name or a literal with a rank-0 write. The file-system questions that decide whether such a read
happens (``os.path.exists``, ``glob.glob``, ``tf.train.latest_checkpoint``... in the tests of the ``if``,
``while``, ``for`` and comprehensions around it, or in the assignment of a name those tests use) are asked on
rank 0 through :func:`perseus.common.files.root_call`, so that every rank takes the same branch.

Never rewritten, because only some ranks, or each rank a different number of times, would reach them (and
``root_file`` must be called by every rank): reads under a test of the rank, in statements this conversion
puts under one, in lambdas, and in data-set classes (``__getitem__``/``__iter__``, ``*Dataset``/``Sequence``
bases) and the module-level functions those classes call.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from perseus.convert.context import Context
from perseus.convert.syntax import arg, call_name, code_of, dotted, find_all, free_name

HELPERS = "perseus.common.files"

# framework -> resolved function name -> (argument keyword, position) of each path it reads
FUNCTIONS: Dict[str, Dict[str, List[Tuple[str, int]]]] = {
    "torch": {
        "torch.load": [("f", 0)],
        "torch.jit.load": [("f", 0)],
    },
    "tensorflow": {
        "tensorflow.keras.models.load_model": [("filepath", 0)],
        "tensorflow.keras.saving.load_model": [("filepath", 0)],
        "keras.models.load_model": [("filepath", 0)],
        "keras.saving.load_model": [("filepath", 0)],
        "tensorflow.saved_model.load": [("export_dir", 0)],
    },
    "mxnet": {
        "mxnet.nd.load": [("fname", 0)],
        "mxnet.ndarray.load": [("fname", 0)],
        "mxnet.model.load_checkpoint": [("prefix", 0)],
        "mxnet.gluon.SymbolBlock.imports": [("symbol_file", 0), ("param_file", 2)],
    },
}
# framework -> method name -> path arguments (any receiver: net.load_parameters, model.load_weights)
METHODS: Dict[str, Dict[str, List[Tuple[str, int]]]] = {
    "torch": {},
    "tensorflow": {"load_weights": [("filepath", 0)]},
    "mxnet": {"load_parameters": [("filename", 0)], "load_params": [("filename", 0)],
              "load_states": [("fname", 0)]},
}
# file-system questions asked on rank 0 when they decide whether a rewritten read happens
QUERIES = ("os.path.exists", "os.path.isfile", "os.path.isdir", "os.path.lexists", "os.listdir", "glob.glob",
           "tensorflow.train.latest_checkpoint")
PATH_METHODS = ("exists", "is_file", "is_dir")  # pathlib.Path(...).exists()
DATASET_METHODS = ("__getitem__", "__iter__")


def rewrite_reads(ctx: Context, framework: str, rule: str, writes: bool) -> List[str]:
    """Rewrite the reads (see the module docstring) when ``writes``: the script writes files on rank 0 only.

    Returns the import statements the rewritten script needs (to add after the perseus import).
    """
    if not writes:
        return []
    rewriter = _ReadRewriter(ctx, rule)
    calls = find_all(ctx.module, cst.Call)
    rewriter.checkpoint_reads(calls, framework)
    rewriter.open_reads(calls)
    rewriter.deciding_queries()
    return rewriter.imports()


class _ReadRewriter:
    """One script's rewrite: the reads wrapped in ``root_file``, then the queries around them put on rank 0."""

    def __init__(self, ctx: Context, rule: str):
        self.ctx, self.rule = ctx, rule
        self.names = {"root_file": free_name(ctx.module, ["root_file", "perseus_root_file"]),
                      "root_call": free_name(ctx.module, ["root_call", "perseus_root_call"])}
        self.used: Set[str] = set()     # the helpers the rewritten script calls
        self.excluded = _excluded_scopes(ctx)
        self.wrapped: Set[int] = set()  # ids of the path expressions already wrapped
        self.reads: List[cst.Call] = []

    def skip(self, node: cst.CSTNode) -> bool:
        """Whether ``node`` lies where not every rank reaches it (see the module docstring)."""
        ctx = self.ctx
        return ctx.under_rank_guard(node) or any(
            a in ctx.edits.guard or isinstance(a, cst.Lambda) or a in self.excluded for a in ctx.ancestors(node))

    def wrap(self, value: cst.BaseExpression) -> None:
        self.wrapped.add(id(value))
        helper = self.names["root_file"]
        self.used.add("root_file")
        _replace(self.ctx, value, lambda upd: cst.Call(func=cst.Name(helper), args=[cst.Arg(upd)]))

    def checkpoint_reads(self, calls: List[cst.Call], framework: str) -> None:
        """The framework's checkpoint loads (``torch.load``, ``load_weights``...): every path they read."""
        ctx, rule, root_file = self.ctx, self.rule, self.names["root_file"]
        checkpoint_vars = _checkpoint_names(ctx, calls) if framework == "tensorflow" else set()
        for call in calls:
            spec = _read_spec(ctx, call, framework, checkpoint_vars)
            if spec is None or self.skip(call):
                continue
            label = code_of(call.func)
            found = [arg(call, kw, pos) for kw, pos in spec]
            found = [a for a in found if a is not None and not a.star]
            if not found:
                ctx.warn(call, rule, f"{label}(...) may read a file written on rank 0 only, and its path argument "
                         "cannot be found", f"pass the path as {root_file}(path) (from {HELPERS} import "
                         "root_file) so that every rank reads rank 0's file")
                continue
            for a in found:
                value = _opened_path(ctx, a.value) or a.value
                if id(value) not in self.wrapped:
                    self.wrap(value)
            self.reads.append(call)
            ctx.change(call, rule, f"{label}(...) reads its file through {root_file}(...): rank 0 reads it "
                       "and sends it to every rank, which loads its own copy (this script writes files on rank 0 "
                       "only; the other ranks may not see them yet, or at all)")

    def open_reads(self, calls: List[cst.Call]) -> None:
        """``open(path)`` reads whose path shares a name or a literal with a rank-0 write."""
        ctx, rule, root_file = self.ctx, self.rule, self.names["root_file"]
        write_tokens = set()
        for w in ctx.rank0_writes:
            write_tokens |= _tokens(ctx, _written_path(ctx, w))
        for call in calls:
            found = _open_read(ctx, call)
            if found is None or id(found[0]) in self.wrapped or self.skip(call):
                continue
            path, mode_known = found
            if not (_tokens(ctx, path) & write_tokens):
                continue  # not a file this script writes: leave it (it may be data, read per sample)
            if not mode_known:
                ctx.warn(call, rule, "open(...) of a file this script writes on rank 0 only, in a mode given by an "
                         "expression", f"if it reads, pass the path as {root_file}(path) (from {HELPERS} "
                         "import root_file) so that every rank reads rank 0's file")
                continue
            self.wrap(path)
            self.reads.append(call)
            ctx.change(call, rule, f"open(...) reads a file this script writes on rank 0 only: through "
                       f"{root_file}(...), rank 0 reads it and every rank gets its own copy")

    def deciding_queries(self) -> None:
        """The file-system queries that decide whether a rewritten read happens, asked on rank 0."""
        ctx, helper = self.ctx, self.names["root_call"]
        done: Set[int] = set()
        for call in self.reads:
            for q in _deciding_queries(ctx, call):
                if id(q) in done or self.skip(q):
                    continue
                done.add(id(q))
                self.used.add("root_call")
                _replace(ctx, q, _as_root_call(helper))
                ctx.change(q, self.rule, f"{code_of(q)} -> {helper}(...): asked on rank 0 only, so that every rank "
                           f"takes the same branch around the read of line {ctx.line(call)}")

    def imports(self) -> List[str]:
        """The import of the helpers the rewritten script calls (none: nothing to import)."""
        if not self.used:
            return []
        imported = []
        for helper in ("root_call", "root_file"):
            if helper in self.used:
                name = self.names[helper]
                imported.append(helper if name == helper else f"{helper} as {name}")
        return [f"from {HELPERS} import {', '.join(imported)}\n"]


# ------------------------------------------------------------------------------------------ reads

def _read_spec(ctx: Context, call: cst.Call, framework: str, checkpoint_vars: Set[str]):
    name = ctx.imports.resolve(call_name(call))
    if name in FUNCTIONS.get(framework, {}):
        return FUNCTIONS[framework][name]
    if isinstance(call.func, cst.Attribute):
        method = call.func.attr.value
        if method in METHODS.get(framework, {}) and name not in ("numpy.load", "pickle.load", "json.load"):
            return METHODS[framework][method]
        if method in ("restore", "read") and dotted(call.func.value) in checkpoint_vars:
            return [("save_path", 0)]
    return None


def _checkpoint_names(ctx: Context, calls) -> Set[str]:
    """Names assigned from ``tf.train.Checkpoint(...)`` (their ``restore``/``read`` read a checkpoint)."""
    found = set()
    for c in calls:
        if ctx.imports.resolve(call_name(c)) != "tensorflow.train.Checkpoint":
            continue
        parent = ctx.parents.get(c)
        if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
            target = dotted(parent.targets[0].target)
            if target:
                found.add(target)
    return found


def _open_read(ctx: Context, call: cst.Call) -> Optional[Tuple[cst.BaseExpression, bool]]:
    """(path, mode known) for a builtin ``open(...)`` that may read: its mode has none of w, a, x, +, or is
    an expression (mode not known); else None."""
    if call_name(call) != "open" or "open" in ctx.imports.from_names:
        return None
    path = arg(call, "file", 0)
    if path is None or path.star:
        return None
    mode = arg(call, "mode", 1)
    if mode is None:
        return path.value, True
    if not isinstance(mode.value, cst.SimpleString):
        return path.value, False
    if any(ch in mode.value.evaluated_value for ch in "wax+"):
        return None
    return path.value, True


def _opened_path(ctx: Context, value: cst.BaseExpression) -> Optional[cst.BaseExpression]:
    """For a loader given an open file (``torch.load(open(p, "rb"))``, or the ``f`` of an enclosing
    ``with open(p, "rb") as f:``): the path ``p``, to read through root_file instead of the file object."""
    opener = value if isinstance(value, cst.Call) else None
    if isinstance(value, cst.Name):
        for a in ctx.ancestors(value):
            if isinstance(a, cst.With):
                for item in a.items:
                    if item.asname is not None and isinstance(item.asname.name, cst.Name) \
                            and item.asname.name.value == value.value and isinstance(item.item, cst.Call):
                        opener = item.item
    found = _open_read(ctx, opener) if opener is not None else None
    return found[0] if found is not None and found[1] else None


# where each kind of write takes its path: (keyword, position); the default is the first argument
WRITE_PATHS = {"torch.save": ("f", 1), "logging.basicConfig": ("filename", None)}
PATH_KEYWORDS = ("filepath", "filename", "fname", "f", "file", "file_prefix", "prefix", "path", "save_directory",
                 "export_dir")


def _written_path(ctx: Context, call: cst.Call) -> cst.CSTNode:
    """The path argument of a rank-0 write (``torch.save(obj, PATH)``, ``model.save(PATH)``, ``open(PATH,
    "w")``, ``ModelCheckpoint(PATH)``), or the whole call when it cannot be told."""
    name = ctx.imports.resolve(call_name(call)) or ""
    if name in WRITE_PATHS:
        a = arg(call, *WRITE_PATHS[name])
        return a.value if a is not None else call
    for kw in PATH_KEYWORDS:
        a = arg(call, kw)
        if a is not None:
            return a.value
    a = arg(call, "", 0)
    return a.value if a is not None and not a.star else call


def _tokens(ctx: Context, node: cst.CSTNode) -> Set[str]:
    """The names (``ckpt_dir``, ``args.checkpoint``) and string literals an expression is made of, minus
    the functions it calls and the imported modules: two paths sharing one are taken for the same file (or
    folder). A function's parameter is that function's own name (``path`` in two functions is not shared)."""
    out: Set[str] = set()
    called: Set[int] = set()
    modules = set(ctx.imports.modules.values()) | set(ctx.imports.from_names)

    def name_token(n: cst.Name) -> Optional[str]:
        if n.value in modules or n.value in ("self", "cls", "True", "False", "None"):
            return None
        for a in ctx.ancestors(n):
            if isinstance(a, cst.FunctionDef):
                params = a.params
                every = [*params.posonly_params, *params.params, *params.kwonly_params]
                every += [p for p in (params.star_arg, params.star_kwarg) if isinstance(p, cst.Param)]
                if any(p.name.value == n.value for p in every):
                    return f"{id(a)}:{n.value}"
                break
        return n.value

    class V(cst.CSTVisitor):
        def visit_Call(self, n: cst.Call) -> None:
            called.add(id(n.func))

        def visit_Attribute(self, n: cst.Attribute) -> bool:
            name = dotted(n)
            if name is None or id(n) in called:
                return True
            if name.split(".")[0] not in modules:
                out.add(name)
            return False

        def visit_Name(self, n: cst.Name) -> None:
            if id(n) not in called:
                token = name_token(n)
                if token:
                    out.add(token)

        def visit_SimpleString(self, n: cst.SimpleString) -> None:
            value = n.evaluated_value
            if isinstance(value, str) and value.strip() and value not in ("r", "rb", "w", "wb", "a", "utf-8"):
                out.add(repr(value))
    node.visit(V())
    return out


# ------------------------------------------------------------------------------------------ branches

def _deciding_queries(ctx: Context, read: cst.Call) -> List[cst.Call]:
    """File-system questions that decide whether ``read`` runs: in the tests/iterables of the control flow
    around it (up to its function), and in the assignments, in the same function, of the names they use."""
    headers: List[cst.CSTNode] = []
    for a in ctx.ancestors(read):
        if isinstance(a, (cst.FunctionDef, cst.ClassDef, cst.Module, cst.Lambda)):
            break
        if isinstance(a, (cst.If, cst.IfExp, cst.While)):
            headers.append(a.test)
        elif isinstance(a, cst.For):
            headers.append(a.iter)
        elif isinstance(a, (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)):
            comp = a.for_in
            while comp is not None:
                headers.append(comp.iter)
                headers.extend(i.test for i in comp.ifs)
                comp = comp.inner_for_in
    found: List[cst.Call] = []
    for h in headers:
        found += _queries_in(ctx, h)
        names = {n.value for n in find_all(h, cst.Name)}
        scope = ctx.scope_of(read)
        for assign in find_all(scope, cst.Assign):
            if ctx.scope_of(assign) is not scope or len(assign.targets) != 1:
                continue
            target = assign.targets[0].target
            if isinstance(target, cst.Name) and target.value in names:
                found += _queries_in(ctx, assign.value)
    return found


def _queries_in(ctx: Context, node: cst.CSTNode) -> List[cst.Call]:
    out = []
    for c in find_all(node, cst.Call):
        if ctx.imports.resolve(call_name(c)) in QUERIES:
            out.append(c)
        elif isinstance(c.func, cst.Attribute) and c.func.attr.value in PATH_METHODS and not c.args \
                and ctx.imports.resolve(dotted(c.func)) not in QUERIES:
            out.append(c)
    return out


def _replace(ctx: Context, node: cst.CSTNode, fix) -> None:
    """Plan ``fix(updated node)`` for ``node``, after any rewrite already planned for it."""
    prev = ctx.edits.replace.get(node)
    if prev is None:
        ctx.edits.replace[node] = fix
    else:
        ctx.edits.replace[node] = lambda upd: fix(prev(upd) if callable(prev) else prev)


def _as_root_call(helper: str):
    """``os.path.exists(p)`` -> ``helper(os.path.exists, p)``; ``Path(p).exists()`` -> ``helper(Path(p).exists)``."""
    def fix(upd: cst.Call) -> cst.Call:
        fn = cst.Arg(upd.func, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")) if upd.args
                     else cst.MaybeSentinel.DEFAULT)
        return cst.Call(func=cst.Name(helper), args=[fn, *upd.args])
    return fix


# ------------------------------------------------------------------------------------------ exclusions

def _excluded_scopes(ctx: Context) -> Set[cst.CSTNode]:
    """Data-set classes and the module-level functions they call: reads there happen per sample, on some
    ranks only (each reads its own shard), so they must stay local."""
    out: Set[cst.CSTNode] = set()
    functions = {s.name.value: s for s in ctx.module.body if isinstance(s, cst.FunctionDef)}
    for cls in find_all(ctx.module, cst.ClassDef):
        methods = {s.name.value for s in cls.body.body if isinstance(s, cst.FunctionDef)}
        bases = " ".join(code_of(b.value) for b in cls.bases)
        if not (methods & set(DATASET_METHODS) or "Dataset" in bases or "Sequence" in bases):
            continue
        out.add(cls)
        for c in find_all(cls, cst.Call):
            if isinstance(c.func, cst.Name) and c.func.value in functions:
                out.add(functions[c.func.value])
    return out

