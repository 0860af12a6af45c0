"""Rules shared by the front ends: the perseus import and ``init()``, rank-0 guards, metric averaging."""

from __future__ import annotations

import re
from typing import List, Optional

import libcst as cst

from perseus.convert.context import Context
from perseus.convert.syntax import arg, call_name, code_of, expr, last_top_import, stmt, with_kwarg

METRIC_WORDS = re.compile(r"loss|acc", re.IGNORECASE)


def add_import_and_init(ctx: Context, module_name: str, alias: str, extra: List[str], rule: str,
                        extra_imports: List[str] = ()) -> None:
    """``import <module_name> as <alias>`` (and ``extra_imports``) after the last top-level import, then
    ``<alias>.init()`` and the ``extra`` statements (device pinning)."""
    anchor = last_top_import(ctx.module)
    new = [stmt(f"import {module_name} as {alias}\n")] + [stmt(code) for code in extra_imports]
    init = stmt(f"{alias}.init()\n").with_changes(leading_lines=[cst.EmptyLine()])
    new.append(init)
    new += [stmt(code) for code in extra]
    if anchor is None:
        ctx.edits.insert_before(ctx.module.body[0], *new)
    else:
        ctx.edits.insert_after(anchor, *new)
    ctx.change(anchor, rule, f"import {module_name} as {alias} and call {alias}.init() once, at start-up")


def _is_print(ctx: Context, call: cst.Call) -> bool:
    if call_name(call) != "print":
        return False
    for a in call.args:
        if a.keyword is not None and a.keyword.value == "file" and "stderr" in code_of(a.value):
            return False
    return True


def guard_statements(ctx: Context, alias: str, rule: str, is_save) -> None:
    """Wrap prints, checkpoint saves (``is_save(ctx, call)``) and file writes in ``if <alias>.rank() == 0:``.

    A statement already under a test of the rank is left alone; a print that shares its line with other
    statements is reported.
    """
    test = f"{alias}.rank() == 0"
    for line in _simple_lines(ctx.module):
        calls = [s.value for s in line.body if isinstance(s, cst.Expr) and isinstance(s.value, cst.Call)]
        hits = [c for c in calls if _is_print(ctx, c) or is_save(ctx, c) or _is_file_logging(ctx, c)]
        if not hits or ctx.under_rank_guard(line):
            continue
        if len(line.body) != 1:
            ctx.warn(line, rule, "a print or save shares its line with other statements",
                     f"put it under `if {test}:` by hand")
            continue
        call = hits[0]
        what = "progress print" if _is_print(ctx, call) else "checkpoint/log write"
        if not _is_print(ctx, call):
            ctx.rank0_writes.append(call)
        if ctx.options.average_metrics and _is_print(ctx, call):
            average_metrics(ctx, line, call, alias, rule)
        ctx.edits.guard[line] = test
        ctx.change(line, rule, f"{what} only on rank 0 (`if {test}:`): every rank runs the same code")
    for w in _withs(ctx.module):
        if ctx.under_rank_guard(w):
            continue
        for item in w.items:
            c = item.item
            if isinstance(c, cst.Call) and call_name(c) == "open" and _write_mode(c):
                ctx.rank0_writes.append(c)
                ctx.edits.guard[w] = test
                ctx.change(w, rule, f"file written only on rank 0 (`if {test}:`)")
                break


def _write_mode(call: cst.Call) -> bool:
    mode = None
    for i, a in enumerate(call.args):
        if (a.keyword is not None and a.keyword.value == "mode") or (a.keyword is None and i == 1):
            mode = a.value
    return isinstance(mode, cst.SimpleString) and any(ch in mode.evaluated_value for ch in "wax")


def _is_file_logging(ctx: Context, call: cst.Call) -> bool:
    name = ctx.imports.resolve(call_name(call)) or ""
    if name == "logging.basicConfig":
        return any(a.keyword is not None and a.keyword.value == "filename" for a in call.args)
    return False


def _simple_lines(module):
    found = []

    class V(cst.CSTVisitor):
        def visit_SimpleStatementLine(self, node):
            found.append(node)
    module.visit(V())
    return found


def _withs(module):
    found = []

    class V(cst.CSTVisitor):
        def visit_With(self, node):
            found.append(node)
    module.visit(V())
    return found


def disable_progress_bars(ctx: Context, alias: str, rule: str) -> None:
    """``tqdm(...)``/``trange(...)`` get ``disable=<alias>.rank() != 0``."""
    class V(cst.CSTVisitor):
        def visit_Call(self, node):
            name = ctx.imports.resolve(call_name(node)) or ""
            if name in ("tqdm.tqdm", "tqdm.trange", "tqdm.auto.tqdm", "tqdm.auto.trange", "tqdm.notebook.tqdm"):
                if not any(a.keyword is not None and a.keyword.value == "disable" for a in node.args):
                    ctx.edits.replace[node] = lambda upd: with_kwarg(upd, "disable", expr(f"{alias}.rank() != 0"))
                    ctx.change(node, rule, "progress bar shown on rank 0 only")
    ctx.module.visit(V())


def average_metrics(ctx: Context, line, call: cst.Call, alias: str, rule: str) -> None:
    """Before a rank-0 print, average over ranks every printed value named like a loss or an accuracy."""
    targets: List[cst.BaseExpression] = []
    for a in call.args:
        if a.keyword is not None:
            continue
        if isinstance(a.value, cst.FormattedString):
            targets += [p.expression for p in a.value.parts if isinstance(p, cst.FormattedStringExpression)]
        elif not isinstance(a.value, (cst.SimpleString, cst.ConcatenatedString)):
            targets.append(a.value)
    n = 0
    for t in targets:
        if not METRIC_WORDS.search(code_of(t)) or isinstance(t, (cst.SimpleString, cst.FormattedString)):
            continue
        name = _metric_name(code_of(t), ctx.line(line), n)
        ctx.edits.insert_before(line, stmt(averager_code(ctx, alias, name, code_of(t), ctx.line(line), n)))
        ctx.edits.replace[t] = cst.Name(name)
        n += 1
    if n:
        ctx.change(line, rule, f"{n} printed metric(s) averaged over all ranks before printing")


def averager_code(ctx: Context, alias: str, name: str, value: str, line: int, n: int) -> str:
    torch = ctx.imports.alias_of("torch")
    if ctx.result.framework == "torch" and torch:
        return f'{name} = {alias}.allreduce({torch}.tensor(float({value})), name="metric.{line}.{n}").item()\n'
    return f'{name} = float({alias}.allreduce(float({value}), name="metric.{line}.{n}"))\n'


def _metric_name(code: str, line: int, n: int) -> str:
    base = re.sub(r"\W+", "_", code).strip("_")[:30] or "metric"
    return f"{base}_avg{'' if n == 0 else n}"


def scale_lr(ctx: Context, call: cst.Call, keyword: str, position: Optional[int], alias: str, rule: str) -> None:
    """Multiply the learning-rate argument of ``call`` by ``<alias>.size()``."""
    a = arg(call, keyword, position)
    if a is None:
        ctx.warn(call, rule, "--scale-lr: the learning rate is the optimizer's default",
                 f"pass {keyword}=<default> * {alias}.size() by hand")
        return
    value = a.value
    simple = isinstance(value, (cst.Name, cst.Attribute, cst.Call, cst.Integer, cst.Float, cst.Subscript))
    text = code_of(value) if simple else f"({code_of(value)})"
    new_value = expr(f"{text} * {alias}.size()")

    index = next(i for i, x in enumerate(call.args) if x is a)

    def fix(upd: cst.Call, index=index, new=new_value) -> cst.Call:
        args = list(upd.args)
        args[index] = args[index].with_changes(value=new)
        return upd.with_changes(args=args)
    prev = ctx.edits.replace.get(call)
    ctx.edits.replace[call] = (lambda upd: fix(prev(upd))) if callable(prev) else fix
    ctx.change(call, rule, f"learning rate scaled by {alias}.size() (--scale-lr): the global batch is size() times larger")
