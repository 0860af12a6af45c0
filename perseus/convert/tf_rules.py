"""TensorFlow 2 / Keras: init, GPU pinning, DistributedOptimizer in compile, fit callbacks and sharding,
DistributedGradientTape in custom loops, variable broadcast, tf.data sharding, rank-0 guards."""

from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from perseus.convert import common_rules, file_rules
from perseus.convert.context import Context
from perseus.convert.syntax import arg, call_name, code_of, dotted, expr, find_all, free_name, stmt, with_kwarg

RULE = "tensorflow"
EVAL_WORDS = re.compile(r"test|val|eval|dev", re.IGNORECASE)
RANK0_CALLBACKS = ("ModelCheckpoint", "TensorBoard", "CSVLogger", "BackupAndRestore")


def apply(ctx: Context) -> None:
    imp = ctx.imports
    if any(imp.alias_of(m) for m in ("perseus.tensorflow", "perseus.tensorflow.keras", "perseus.keras")):
        return  # already a perseus (or converted Horovod) script
    tf = imp.alias_of("tensorflow")
    keras = imp.alias_of("keras") or (f"{tf}.keras" if tf else None)
    calls = find_all(ctx.module, cst.Call)
    compiles = [c for c in calls if isinstance(c.func, cst.Attribute) and c.func.attr.value == "compile"
                and dotted(c.func.value) and arg(c, "optimizer", 0) is not None]
    tapes = [c for c in calls if imp.resolve(call_name(c)) == "tensorflow.GradientTape"]
    hvd = free_name(ctx.module, ["hvd", "phvd"])
    imports = []
    if tapes or not compiles:
        main_module = "perseus.tensorflow"
        if compiles:
            hvdk = free_name(ctx.module, ["hvd_keras"])
            imports.append(f"import perseus.tensorflow.keras as {hvdk}\n")
        else:
            hvdk = hvd
    else:
        main_module = "perseus.tensorflow.keras" if tf else "perseus.keras"
        hvdk = hvd
    extra = []
    if tf:
        gpus = free_name(ctx.module, ["gpus"])
        extra.append(f'{gpus} = {tf}.config.list_physical_devices("GPU")\n')
        extra.append(f'if {gpus}:\n    {tf}.config.set_visible_devices({gpus}[{hvd}.local_rank()], "GPU")\n')
        ctx.change(None, RULE, "pin each process to the GPU of its local rank (if any)")
    models = [dotted(c.func.value) for c in compiles]
    for c in compiles:
        _compile(ctx, c, hvdk, keras)
    for c in calls:
        if isinstance(c.func, cst.Attribute) and c.func.attr.value == "fit" and dotted(c.func.value) in models:
            _fit(ctx, c, hvdk)
    for c in calls:
        name = call_name(c) or ""
        if name.split(".")[-1] in RANK0_CALLBACKS and not ctx.under_rank_guard(c) and not _in_fit_list(ctx, c):
            ctx.warn(c, RULE, f"{name.split('.')[-1]} writes files from every rank",
                     f"create it only when {hvdk}.rank() == 0")
    _shard_datasets(ctx, calls, hvd)
    if tf:
        _tapes(ctx, tapes, hvd, tf)
    elif tapes:
        ctx.warn(tapes[0], RULE, "GradientTape without `import tensorflow as ...`", "wrap the tape by hand")
    common_rules.guard_statements(ctx, hvd, RULE, _is_save)
    ctx.rank0_writes += [c for c in calls if (call_name(c) or "").split(".")[-1] in RANK0_CALLBACKS]
    imports += file_rules.rewrite_reads(ctx, "tensorflow", RULE, bool(ctx.rank0_writes))
    common_rules.add_import_and_init(ctx, main_module, hvd, extra, RULE, imports)
    ctx.apply()


def _is_save(ctx: Context, call: cst.Call) -> bool:
    name = ctx.imports.resolve(call_name(call)) or ""
    if name.startswith(("numpy.", "np.", "pickle.", "json.")):
        return False
    return name.split(".")[-1] in ("save", "save_weights") and "." in name


def _compile(ctx: Context, call: cst.Call, hvdk: str, keras: Optional[str]) -> None:
    opt = arg(call, "optimizer", 0)
    value = opt.value
    if "DistributedOptimizer" in code_of(value):
        return
    index = next(i for i, a in enumerate(call.args) if a is opt)
    if isinstance(value, cst.Name):
        assign = _assignment(ctx, value.value, call)
        if assign is not None and isinstance(assign.value, cst.Call):
            if ctx.options.scale_lr:
                common_rules.scale_lr(ctx, assign.value, "learning_rate", 0, hvdk, RULE)
            ctx.edits.insert_after(ctx.parents.get(assign),
                                   stmt(f"{value.value} = {hvdk}.DistributedOptimizer({value.value})\n"))
            ctx.change(assign, RULE, f"optimizer wrapped in {hvdk}.DistributedOptimizer: gradients are averaged "
                       "over all ranks")
            return
    elif isinstance(value, cst.Call) and ctx.options.scale_lr:
        common_rules.scale_lr(ctx, value, "learning_rate", 0, hvdk, RULE)
    elif isinstance(value, cst.SimpleString):
        if keras is None:
            ctx.warn(call, RULE, "optimizer given by name and keras is not imported",
                     f"pass {hvdk}.DistributedOptimizer(<optimizer>)")
            return
        if ctx.options.scale_lr:
            ctx.warn(call, RULE, "--scale-lr: optimizer given by name", "scale its learning rate by hand")
        value = expr(f"{keras}.optimizers.get({value.value})")

    def fix(upd, index=index, value=value):
        args = list(upd.args)
        inner = value if isinstance(value, cst.Call) and isinstance(opt.value, cst.SimpleString) else args[index].value
        args[index] = args[index].with_changes(value=expr(f"{hvdk}.DistributedOptimizer(x)").with_changes(
            args=[cst.Arg(inner)]))
        return upd.with_changes(args=args)
    prev = ctx.edits.replace.get(call)
    ctx.edits.replace[call] = (lambda u: fix(prev(u))) if callable(prev) else fix
    ctx.change(call, RULE, f"optimizer wrapped in {hvdk}.DistributedOptimizer: gradients are averaged over all ranks")


def _assignment(ctx: Context, name: str, near: cst.CSTNode) -> Optional[cst.Assign]:
    """The assignment to ``name`` in the innermost scope around ``near`` that has one."""
    scopes = [a for a in ctx.ancestors(near) if isinstance(a, (cst.FunctionDef, cst.Module))]
    found = [a for a in find_all(ctx.module, cst.Assign)
             if len(a.targets) == 1 and dotted(a.targets[0].target) == name]
    for scope in scopes:
        for a in found:
            if ctx.scope_of(a) is scope:
                return a
    return None


def _in_fit_list(ctx: Context, call: cst.Call) -> bool:
    for a in ctx.ancestors(call):
        if isinstance(a, cst.Arg) and a.keyword is not None and a.keyword.value == "callbacks":
            return True
    return False


def _fit(ctx: Context, call: cst.Call, hvd: str) -> None:
    bcast = f"{hvd}.callbacks.BroadcastGlobalVariablesCallback(0)"
    avg = f"{hvd}.callbacks.MetricAverageCallback()"
    cbs = arg(call, "callbacks")
    if cbs is not None and "BroadcastGlobalVariablesCallback" in code_of(cbs.value):
        return
    rank0 = f"{hvd}.rank() == 0"
    x, y = arg(call, "x", 0), arg(call, "y", 1)
    shard = {}
    if y is not None:
        for a in (x, y):
            name = dotted(a.value)
            if name is None:
                ctx.warn(call, RULE, "fit's x/y are expressions", f"pass x[{hvd}.rank()::{hvd}.size()] (and y) by hand")
                shard = {}
                break
            shard[next(i for i, b in enumerate(call.args) if b is a)] = expr(
                f"{name}[{hvd}.rank():len({name}) - len({name}) % {hvd}.size():{hvd}.size()]")
        if shard:
            ctx.change(call, RULE, "fit's arrays sharded: rank r trains on samples r, r+size(), ... (the same "
                       "count on every rank)")

    def fix(upd):
        args = list(upd.args)
        for i, v in shard.items():
            args[i] = args[i].with_changes(value=v)
        upd = upd.with_changes(args=args)
        cb = arg(upd, "callbacks")
        if cb is None:
            upd = with_kwarg(upd, "callbacks", expr(f"[{bcast}, {avg}]"))
        elif isinstance(cb.value, cst.List):
            elements = [cst.Element(expr(bcast), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                        cst.Element(expr(avg), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))]
            for e in cb.value.elements:
                name = call_name(e.value) or ""
                if name.split(".")[-1] in RANK0_CALLBACKS:
                    e = cst.StarredElement(expr(f"([{code_of(e.value)}] if {rank0} else [])"), comma=e.comma)
                elements.append(e)
            upd = with_kwarg(upd, "callbacks", cb.value.with_changes(elements=elements))
        else:
            upd = with_kwarg(upd, "callbacks", expr(f"[{bcast}, {avg}, *{code_of(cb.value)}]"))
        verbose = arg(upd, "verbose")
        if verbose is None:
            upd = with_kwarg(upd, "verbose", expr(f'"auto" if {rank0} else 0'))
        elif code_of(verbose.value) not in ("0", "False"):
            upd = with_kwarg(upd, "verbose", expr(f"{code_of(verbose.value)} if {rank0} else 0"))
        spe = arg(upd, "steps_per_epoch")
        if spe is not None:
            upd = with_kwarg(upd, "steps_per_epoch", expr(f"max(1, ({code_of(spe.value)}) // {hvd}.size())"))
        return upd
    ctx.edits.replace[call] = fix
    ctx.change(call, RULE, "fit: broadcast rank 0's initial variables and average the epoch metrics over ranks "
               "(callbacks); progress output on rank 0 only")
    if arg(call, "steps_per_epoch") is not None:
        ctx.change(call, RULE, "steps_per_epoch divided by size(): each rank sees 1/size() of the data")


def _shard_datasets(ctx: Context, calls, hvd: str) -> None:
    for c in calls:
        name = ctx.imports.resolve(call_name(c)) or ""
        if not re.match(r"tensorflow\.data\.Dataset\.(from_tensor_slices|from_tensors|from_generator|range|"
                        r"list_files|zip)$", name):
            continue
        if any(isinstance(a, cst.Call) and isinstance(a.func, cst.Attribute) and a.func.attr.value == "shard"
               for a in ctx.ancestors(c)):
            continue
        line = ctx.statement_of(c)
        target = ""
        if isinstance(line, cst.SimpleStatementLine) and isinstance(line.body[0], cst.Assign):
            target = code_of(line.body[0].targets[0].target)
        if EVAL_WORDS.search(target) or EVAL_WORDS.search(code_of(c)):
            continue
        ctx.edits.replace[c] = lambda upd: expr(f"x.shard({hvd}.size(), {hvd}.rank())").with_changes(
            func=cst.Attribute(value=upd, attr=cst.Name("shard")))
        ctx.change(c, RULE, "dataset sharded: rank r reads elements r, r+size(), ... (ranks must see the "
                   "same number of batches)")


def _tapes(ctx: Context, tapes, hvd: str, tf: str) -> None:
    done_models = set()
    for t in tapes:
        item = ctx.parents.get(t)
        w = ctx.parents.get(item)
        if not isinstance(item, cst.WithItem) or not isinstance(w, cst.With) or item.asname is None \
                or not isinstance(item.asname.name, cst.Name):
            ctx.warn(t, RULE, "GradientTape not used as `with tf.GradientTape() as tape:`",
                     f"wrap the tape: tape = {hvd}.DistributedGradientTape(tape)")
            continue
        name = item.asname.name.value
        ctx.edits.insert_after(w, stmt(f"{name} = {hvd}.DistributedGradientTape({name})\n"))
        ctx.change(w, RULE, f"{name} wrapped in {hvd}.DistributedGradientTape: gradients are averaged over ranks")
    for c in find_all(ctx.module, cst.Call):
        if not (isinstance(c.func, cst.Attribute) and c.func.attr.value == "apply_gradients"):
            continue
        m = re.search(r"([\w.]+)\.trainable_(variables|weights)", code_of(c))
        if not m or m.group(1) in done_models:
            continue
        model = m.group(1)
        done_models.add(model)
        assign = _assignment(ctx, model, c)
        if assign is None:
            ctx.warn(c, RULE, f"cannot find where {model} is created",
                     f"after creating it: {hvd}.broadcast_variables({model}.variables, root_rank=0)")
            continue
        ctx.edits.insert_after(ctx.parents.get(assign), stmt(
            f"{hvd}.broadcast_variables([v if isinstance(v, {tf}.Variable) else v.value for v in {model}.variables], "
            f"root_rank=0)\n"))
        ctx.change(assign, RULE, f"rank 0's variables of {model} broadcast to every rank once it is created")
        ctor = call_name(assign.value) or ""
        last = ctor.split(".")[-1]
        if isinstance(assign.value, cst.Call) and last[:1].isupper() and last not in ("Sequential", "Model"):
            ctx.warn(assign, RULE, f"{model} may be a subclassed model with no variables until first called",
                     f"build it before the broadcast ({model}.build(input_shape)) or broadcast after the first step")
