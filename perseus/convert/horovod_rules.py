"""Horovod -> perseus: rewrite every import of ``horovod`` and every use of the ``horovod`` name.

perseus has the same module layout for the training front ends (``torch``, ``tensorflow``,
``tensorflow.keras``, ``keras``, ``mxnet``); other Horovod modules (``spark``, ``ray``, ``runner``...) have no
perseus counterpart and are reported as warnings.
"""

from __future__ import annotations

import libcst as cst

from perseus.convert.context import Context
from perseus.convert.syntax import dotted

RULE = "horovod"
SUPPORTED = ("horovod", "horovod.torch", "horovod.tensorflow", "horovod.tensorflow.keras", "horovod.keras",
             "horovod.mxnet", "horovod.ray", "horovod.spark")


def _renamed(name: str) -> str:
    return "perseus" + name[len("horovod"):]


def _check_supported(ctx: Context, node, full: str) -> None:
    parts = full.split(".")
    mod = ".".join(parts[:3]) if parts[1:2] == ["tensorflow"] and parts[2:3] == ["keras"] else ".".join(parts[:2])
    if mod not in SUPPORTED and not (len(parts) > 2 and ".".join(parts[:2]) in SUPPORTED):
        ctx.warn(node, RULE, f"perseus has no counterpart of {mod}",
                 f"replace the use of {mod} by hand (perseus provides {', '.join(SUPPORTED[1:])})")


def _to_attr(name: str) -> cst.BaseExpression:
    return cst.parse_expression(name)


def apply(ctx: Context) -> None:
    edits = ctx.edits
    binds_horovod = False  # "import horovod..." without "as": the name horovod is bound

    for node in _collect(ctx.module):
        if isinstance(node, cst.Import):
            names = []
            touched = False
            for alias in node.names:
                full = dotted(alias.name)
                if full == "horovod" or full.startswith("horovod."):
                    touched = True
                    if full != "horovod":
                        _check_supported(ctx, node, full)
                    if alias.asname is None:
                        binds_horovod = True
                    alias = alias.with_changes(name=_to_attr(_renamed(full)))
                names.append(alias)
            if touched:
                edits.replace[node] = node.with_changes(names=names)
                ctx.change(node, RULE, "import from perseus instead of horovod")
        elif isinstance(node, cst.ImportFrom) and node.module is not None and not node.relative:
            full = dotted(node.module)
            if full == "horovod" or full.startswith("horovod."):
                if full != "horovod":
                    _check_supported(ctx, node, full)
                elif not isinstance(node.names, cst.ImportStar):
                    for alias in node.names:
                        _check_supported(ctx, node, f"horovod.{dotted(alias.name)}")
                edits.replace[node] = node.with_changes(module=_to_attr(_renamed(full)))
                ctx.change(node, RULE, "import from perseus instead of horovod")
    if binds_horovod:
        for name in _horovod_names(ctx.module):
            edits.replace[name] = cst.Name("perseus")
        for attr in _horovod_attrs(ctx.module):
            ctx.change(attr, RULE, f"{dotted(attr)} -> {_renamed(dotted(attr))}")
    ctx.apply()


def _collect(module: cst.Module):
    found = []

    class V(cst.CSTVisitor):
        def visit_Import(self, node):
            found.append(node)

        def visit_ImportFrom(self, node):
            found.append(node)
    module.visit(V())
    return found


def _horovod_names(module: cst.Module):
    """Every load of the name ``horovod`` outside import statements."""
    found = []

    class V(cst.CSTVisitor):
        def visit_Import(self, node):
            return False

        def visit_ImportFrom(self, node):
            return False

        def visit_Attribute(self, node):
            # only the head of a chain is the module; ``x.horovod`` is someone else's attribute
            self.visit_expr(node.value)
            return False

        def visit_expr(self, node):
            if isinstance(node, cst.Name):
                if node.value == "horovod":
                    found.append(node)
            else:
                node.visit(self)

        def visit_Name(self, node):
            if node.value == "horovod":
                found.append(node)
    module.visit(V())
    return found


def _horovod_attrs(module: cst.Module):
    """The outermost ``horovod.x.y`` chains (for the report)."""
    found = []

    class V(cst.CSTVisitor):
        def visit_Import(self, node):
            return False

        def visit_ImportFrom(self, node):
            return False

        def visit_Attribute(self, node):
            name = dotted(node)
            if name and name.startswith("horovod."):
                found.append(node)
                return False
            return True
    module.visit(V())
    return found
