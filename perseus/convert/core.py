"""The conversion engine: parse, detect the framework, apply the rules, check the result, report.

Every rule works on one libcst tree (comments and formatting are kept) through the edit plan of a
:class:`~perseus.convert.context.Context`. The Horovod rules run first, then those of the script's framework.
"""

from __future__ import annotations

from typing import List, Optional

import libcst as cst
from libcst.metadata import MetadataWrapper

from perseus.convert import horovod_rules, mxnet_rules, tf_rules, torch_rules
from perseus.convert.context import Context, Options, Result
from perseus.convert.syntax import imports_of

__all__ = ["FRAMEWORKS", "detect_frameworks", "convert_source"]

FRAMEWORKS = ("torch", "tensorflow", "mxnet")


def detect_frameworks(module: cst.Module) -> List[str]:
    """The frameworks ``module`` imports, of torch, tensorflow (also for ``keras``) and mxnet, in that order."""
    roots = {m.split(".")[0] for m in imports_of(module).modules}
    found = []
    if "torch" in roots:
        found.append("torch")
    if "tensorflow" in roots or "keras" in roots:
        found.append("tensorflow")
    if "mxnet" in roots:
        found.append("mxnet")
    return found


def convert_source(source: str, path: str = "<string>", options: Optional[Options] = None) -> Result:
    """Convert one file's text. Never raises for bad input: errors are in ``Result.error``."""
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
