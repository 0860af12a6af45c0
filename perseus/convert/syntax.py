"""libcst helpers the conversion rules share: dotted names, calls and their arguments, the imports of a
script, new statements and names, and the ``if`` that guards a statement."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import libcst as cst

__all__ = ["dotted", "call_name", "stmt", "expr", "code_of", "arg", "with_kwarg", "without_kwarg", "names_in",
           "contains_call", "rank0_test", "Imports", "imports_of", "free_name", "last_top_import", "wrap_if",
           "find_all"]


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


def find_all(node: cst.CSTNode, kind) -> List[cst.CSTNode]:
    found = []

    class V(cst.CSTVisitor):
        def on_visit(self, n):
            if isinstance(n, kind):
                found.append(n)
            return True
    node.visit(V())
    return found
