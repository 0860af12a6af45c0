"""The conversion engine: parse, detect the framework, apply the rules, check the result, report.

Every rule works on one libcst tree (comments and formatting are kept) through an :class:`Edits` plan:
rules look at the original tree and record what to insert, replace or wrap; :class:`Editor` applies the
plan in one pass. Line numbers in the report are those of the input file.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence

import libcst as cst
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

FRAMEWORKS = ("torch", "tensorflow", "mxnet")


class ConvertError(Exception):
    """The file cannot be converted (it does not parse, or the result would not)."""


@dataclasses.dataclass
class Options:
    framework: str = "auto"        # auto, torch, tensorflow, mxnet
    scale_lr: bool = False         # multiply learning rates by size()
    average_metrics: bool = False  # average printed metrics over ranks


@dataclasses.dataclass(frozen=True)
class Change:
    line: int
    rule: str
    message: str


@dataclasses.dataclass(frozen=True)
class Warning:  # noqa: A001 - the report's own notion of a warning
    line: int
    rule: str
    message: str
    manual_step: str


@dataclasses.dataclass
class Result:
    path: str
    source: str
    converted: str
    framework: Optional[str] = None
    changes: List[Change] = dataclasses.field(default_factory=list)
    warnings: List[Warning] = dataclasses.field(default_factory=list)
    error: Optional[str] = None

    @property
    def changed(self) -> bool:
        return self.converted != self.source

    def lines(self) -> List[str]:
        """The report, one entry a line: ``path:line: [rule] message``."""
        out = [f"{self.path}:{c.line}: [{c.rule}] {c.message}" for c in sorted(self.changes, key=lambda c: c.line)]
        out += [f"{self.path}:{w.line}: warning: [{w.rule}] {w.message} -- manual step: {w.manual_step}"
                for w in sorted(self.warnings, key=lambda w: w.line)]
        if self.error:
            out.append(f"{self.path}: error: {self.error}")
        return out


# ---------------------------------------------------------------------------------------------- helpers

def dotted(node: cst.BaseExpression) -> Optional[str]:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def call_name(node: cst.CSTNode) -> Optional[str]:
    return dotted(node.func) if isinstance(node, cst.Call) else None


def stmt(code: str) -> cst.BaseStatement:
    return cst.parse_statement(code)


def expr(code: str) -> cst.BaseExpression:
    return cst.parse_expression(code)


def code_of(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def arg(call: cst.Call, keyword: str, position: Optional[int] = None) -> Optional[cst.Arg]:
    """The argument passed as ``keyword=`` or at ``position``."""
    for a in call.args:
        if a.keyword is not None and a.keyword.value == keyword:
            return a
    if position is not None:
        positional = [a for a in call.args if a.keyword is None and not a.star]
        if len(positional) > position:
            return positional[position]
    return None


def with_kwarg(call: cst.Call, keyword: str, value: cst.BaseExpression) -> cst.Call:
    """``call`` with ``keyword=value`` set (replaced if present, else appended)."""
    args = list(call.args)
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value == keyword:
            args[i] = a.with_changes(value=value)
            return call.with_changes(args=args)
    new = cst.Arg(keyword=cst.Name(keyword), value=value,
                  equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                        whitespace_after=cst.SimpleWhitespace("")))
    if args:
        last = args[-1]
        if last.comma is cst.MaybeSentinel.DEFAULT:
            args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        elif isinstance(last.comma, cst.Comma):  # trailing comma: keep the author's layout after ours
            new = new.with_changes(comma=last.comma)
            args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    args.append(new)
    return call.with_changes(args=args)


def without_kwarg(call: cst.Call, keyword: str) -> cst.Call:
    args = [a for a in call.args if not (a.keyword is not None and a.keyword.value == keyword)]
    if args and len(args) < len(call.args) and call.args[-1].comma is cst.MaybeSentinel.DEFAULT:
        args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return call.with_changes(args=args)


def names_in(node: cst.CSTNode) -> set:
    found = set()

    class V(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            found.add(n.value)
    node.visit(V())
    return found


def contains_call(node: cst.CSTNode, suffix: str) -> bool:
    """True when ``node`` contains a call whose dotted name ends with ``suffix``."""
    hit = []

    class V(cst.CSTVisitor):
        def visit_Call(self, n: cst.Call) -> None:
            name = call_name(n)
            if name and (name == suffix or name.endswith("." + suffix)):
                hit.append(n)
    node.visit(V())
    return bool(hit)


def rank0_test(node: cst.BaseExpression) -> bool:
    """True for a test that mentions a rank (``hvd.rank() == 0``, ``is_main``...)."""
    text = code_of(node)
    return "rank" in text or "is_main" in text or "is_master" in text


class Imports(cst.CSTVisitor):
    """Top-level and nested imports: module -> bound name, and names imported from modules."""

    def __init__(self) -> None:
        self.modules: Dict[str, str] = {}      # "torch" -> "torch", "perseus.torch" -> "hvd"
        self.from_names: Dict[str, str] = {}   # local name -> "torch.optim.SGD"

    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            full = dotted(alias.name)
            if alias.asname is not None:
                self.modules.setdefault(full, dotted(alias.asname.name))
            else:
                self.modules.setdefault(full, full)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.module is None or node.relative or isinstance(node.names, cst.ImportStar):
            return
        mod = dotted(node.module)
        for alias in node.names:
            name = dotted(alias.name)
            local = dotted(alias.asname.name) if alias.asname is not None else name
            self.from_names[local] = f"{mod}.{name}"
            self.modules.setdefault(f"{mod}.{name}", local)

    def resolve(self, name: Optional[str]) -> Optional[str]:
        """The full dotted name behind a local dotted name (``optim.SGD`` -> ``torch.optim.SGD``)."""
        if name is None:
            return None
        head, _, rest = name.partition(".")
        full = self.from_names.get(head)
        if full is None:
            for mod, local in self.modules.items():
                if local == head:
                    full = mod
                    break
        if full is None:
            return name
        return f"{full}.{rest}" if rest else full

    def alias_of(self, module: str) -> Optional[str]:
        """The local name bound to ``module``, also through a parent (``import perseus`` for perseus.torch)."""
        if module in self.modules:
            return self.modules[module]
        return None


def imports_of(module: cst.Module) -> Imports:
    v = Imports()
    module.visit(v)
    return v


def detect_frameworks(module: cst.Module) -> List[str]:
    roots = {m.split(".")[0] for m in imports_of(module).modules}
    found = []
    if "torch" in roots:
        found.append("torch")
    if "tensorflow" in roots or "keras" in roots:
        found.append("tensorflow")
    if "mxnet" in roots:
        found.append("mxnet")
    return found


def free_name(module: cst.Module, preferred: Sequence[str]) -> str:
    used = names_in(module)
    for name in preferred:
        if name not in used:
            return name
    i = 2
    while f"{preferred[0]}{i}" in used:
        i += 1
    return f"{preferred[0]}{i}"


def last_top_import(module: cst.Module) -> Optional[cst.SimpleStatementLine]:
    """The last top-level import statement before the first function, class or loop."""
    last = None
    for s in module.body:
        if isinstance(s, cst.SimpleStatementLine) and any(isinstance(x, (cst.Import, cst.ImportFrom))
                                                         for x in s.body):
            last = s
        elif isinstance(s, (cst.FunctionDef, cst.ClassDef, cst.For, cst.While, cst.With)):
            if last is not None:
                break
    return last


def wrap_if(node: cst.BaseStatement, test: str) -> cst.If:
    """``if <test>:`` around ``node``; the comments above ``node`` move above the ``if``."""
    template = stmt(f"if {test}:\n    pass\n")
    inner = node.with_changes(leading_lines=())
    return template.with_changes(leading_lines=node.leading_lines,
                                 body=template.body.with_changes(body=[inner]))


# ------------------------------------------------------------------------------------------ edit plan

class Edits:
    """What to do to which node of the original tree; applied by :class:`Editor`."""

    def __init__(self) -> None:
        self.before: Dict[cst.CSTNode, List[cst.BaseStatement]] = {}
        self.after: Dict[cst.CSTNode, List[cst.BaseStatement]] = {}
        self.replace: Dict[cst.CSTNode, object] = {}   # node -> new node, or callable(updated) -> new node
        self.guard: Dict[cst.CSTNode, str] = {}        # statement -> if-test to wrap it in

    def insert_before(self, node, *stmts) -> None:
        self.before.setdefault(node, []).extend(stmts)

    def insert_after(self, node, *stmts) -> None:
        self.after.setdefault(node, []).extend(stmts)

    def empty(self) -> bool:
        return not (self.before or self.after or self.replace or self.guard)


class Editor(cst.CSTTransformer):
    def __init__(self, edits: Edits) -> None:
        super().__init__()
        self.e = edits

    def on_leave(self, original_node, updated_node):
        new = updated_node
        fn = self.e.replace.get(original_node)
        if fn is not None:
            new = fn(updated_node) if callable(fn) else fn
        if original_node in self.e.guard:
            new = wrap_if(new, self.e.guard[original_node])
        before = self.e.before.get(original_node, [])
        after = self.e.after.get(original_node, [])
        if before or after:
            if before and new.leading_lines:  # comments above the statement stay above what we insert
                before = [before[0].with_changes(leading_lines=new.leading_lines)] + before[1:]
                new = new.with_changes(leading_lines=())
            return cst.FlattenSentinel([*before, new, *after])
        return new


class Context:
    """What a rule sees: the tree with metadata, the imports, the plan and the report."""

    def __init__(self, wrapper: MetadataWrapper, options: Options, result: Result) -> None:
        self.wrapper = wrapper
        self.module = wrapper.module
        self.positions = wrapper.resolve(PositionProvider)
        self.parents = wrapper.resolve(ParentNodeProvider)
        self.options = options
        self.result = result
        self.imports = imports_of(self.module)
        self.edits = Edits()
        self.rank0_writes: List[cst.Call] = []  # the writes (calls) this conversion makes on rank 0 only

    def line(self, node: cst.CSTNode) -> int:
        pos = self.positions.get(node)
        return pos.start.line if pos is not None else 0

    def change(self, node, rule: str, message: str) -> None:
        self.result.changes.append(Change(self.line(node) if node is not None else 1, rule, message))

    def warn(self, node, rule: str, message: str, manual_step: str) -> None:
        self.result.warnings.append(Warning(self.line(node) if node is not None else 1, rule, message,
                                            manual_step))

    def statement_of(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        """The statement (simple line or compound) that contains ``node``."""
        cur = node
        while cur is not None and not isinstance(cur, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            cur = self.parents.get(cur)
        return cur

    def ancestors(self, node: cst.CSTNode) -> Iterable[cst.CSTNode]:
        cur = self.parents.get(node)
        while cur is not None:
            yield cur
            cur = self.parents.get(cur)

    def under_rank_guard(self, node: cst.CSTNode) -> bool:
        return any(isinstance(a, cst.If) and rank0_test(a.test) for a in self.ancestors(node))

    def scope_of(self, node: cst.CSTNode) -> cst.CSTNode:
        for a in self.ancestors(node):
            if isinstance(a, (cst.FunctionDef, cst.Module)):
                return a
        return self.module

    def apply(self) -> None:
        """Apply the plan to the tree and start a fresh one (metadata recomputed) for the next rule."""
        if self.edits.empty():
            return
        module = self.module.visit(Editor(self.edits))
        self.__init__(MetadataWrapper(module), self.options, self.result)


def find_all(node: cst.CSTNode, kind) -> List[cst.CSTNode]:
    found = []

    class V(cst.CSTVisitor):
        def on_visit(self, n):
            if isinstance(n, kind):
                found.append(n)
            return True
    node.visit(V())
    return found


# ------------------------------------------------------------------------------------------ the driver

def convert_source(source: str, path: str = "<string>", options: Optional[Options] = None) -> Result:
    """Convert one file's text. Never raises for bad input: errors are in ``Result.error``."""
    from perseus.convert import horovod_rules, mxnet_rules, tf_rules, torch_rules

    options = options or Options()
    result = Result(path=path, source=source, converted=source)
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as e:
        result.error = f"cannot parse: {str(e).strip()} (line {e.raw_line}, column {e.raw_column}); left untouched"
        return result
    ctx = Context(MetadataWrapper(module), options, result)
    horovod_rules.apply(ctx)
    frameworks = detect_frameworks(ctx.module)
    if options.framework != "auto":
        frameworks = [options.framework]
    if len(frameworks) > 1:
        ctx.warn(None, "framework", f"the script imports several frameworks ({', '.join(frameworks)}); only "
                 f"{frameworks[0]} was converted", "rerun with --framework to choose, and convert the rest by hand")
    result.framework = frameworks[0] if frameworks else None
    rules = {"torch": torch_rules, "tensorflow": tf_rules, "mxnet": mxnet_rules}
    if result.framework in rules:
        rules[result.framework].apply(ctx)
    new = ctx.module.code
    try:  # never hand back a file that does not parse
        cst.parse_module(new)
        compile(new, path, "exec")
    except (cst.ParserSyntaxError, SyntaxError) as e:
        result.changes.clear()
        result.error = f"internal error: the converted text would not parse ({e}); left untouched"
        return result
    result.converted = new
    return result
