"""What a conversion rule works with: the options, the report (:class:`Result`), and the :class:`Context`
that holds the tree and the plan of edits.

Rules look at the original tree and record in an :class:`Edits` plan what to insert, replace or wrap;
:class:`Editor` applies the plan in one pass (:meth:`Context.apply`). Line numbers in the report are those of
the input file.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional

import libcst as cst
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

from perseus.convert.syntax import imports_of, rank0_test, wrap_if

__all__ = ["ConvertError", "Options", "Change", "Warning", "Result", "Edits", "Editor", "Context"]


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
