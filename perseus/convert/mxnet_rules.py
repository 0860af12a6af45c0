"""MXNet Gluon: init, GPU pinning, DistributedTrainer, parameter broadcast after initialisation, DataLoader
sharding, rank-0 guards."""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

import libcst as cst

from perseus.convert import common_rules, file_rules
from perseus.convert.context import Context
from perseus.convert.syntax import arg, call_name, code_of, dotted, expr, find_all, free_name, stmt, with_kwarg

RULE = "mxnet"
TRAINERS = ("mxnet.gluon.Trainer", "mxnet.gluon.trainer.Trainer")
LOADERS = ("mxnet.gluon.data.DataLoader", "mxnet.gluon.data.dataloader.DataLoader")
GPUS = ("mxnet.gpu", "mxnet.context.gpu")
IO_ITER = re.compile(r"^mxnet\.io\.\w*Iter$")
EVAL_WORDS = re.compile(r"test|val|eval|dev", re.IGNORECASE)
# gluon.Trainer(params, optimizer, optimizer_params, kvstore, compression_params, update_on_kvstore):
# DistributedTrainer has no kvstore (it always averages over the ranks), so these have no meaning there.
KVSTORE_ARGS = (("kvstore", 3), ("compression_params", 4), ("update_on_kvstore", 5))
SAVE_METHODS = ("save_parameters", "save_params", "export", "save_states")
SAVE_FUNCTIONS = ("mxnet.nd.save", "mxnet.ndarray.save", "mxnet.model.save_checkpoint")
INIT_METHODS = ("initialize", "load_parameters", "load_params")


def apply(ctx: Context) -> None:
    imports = ctx.imports
    if imports.alias_of("perseus.mxnet"):  # already a perseus (or converted Horovod) script
        return
    hvd = free_name(ctx.module, ["hvd", "phvd", "perseus_hvd"])
    calls = find_all(ctx.module, cst.Call)
    extra_imports: List[str] = []
    _pin_gpus(ctx, calls, hvd)
    if _shard_loaders(ctx, calls, hvd) and "SimpleDataset" not in imports.from_names:
        extra_imports.append("from mxnet.gluon.data import SimpleDataset\n")
    _warn_io_iterators(ctx, calls, hvd)
    _trainers(ctx, calls, hvd)
    average = ctx.options.average_metrics
    ctx.options.average_metrics = False  # the shared averager allreduces Python floats; MXNet needs NDArrays
    try:
        common_rules.guard_statements(ctx, hvd, RULE, _is_save)
    finally:
        ctx.options.average_metrics = average
    if average:
        _average_metrics(ctx, hvd)
    extra_imports += file_rules.rewrite_reads(ctx, "mxnet", RULE, bool(ctx.rank0_writes))
    common_rules.disable_progress_bars(ctx, hvd, RULE)
    common_rules.add_import_and_init(ctx, "perseus.mxnet", hvd, [], RULE, extra_imports)
    ctx.apply()


def _is_save(ctx: Context, call: cst.Call) -> bool:
    name = ctx.imports.resolve(call_name(call)) or ""
    if name in SAVE_FUNCTIONS:
        return True
    if name.startswith(("numpy.", "np.", "pickle.", "json.")):
        return False
    return "." in name and name.split(".")[-1] in SAVE_METHODS


def _target_name(ctx: Context, call: cst.Call) -> Optional[str]:
    """``x`` (or ``self.x``) for ``x = call``."""
    parent = ctx.parents.get(call)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
        return dotted(parent.targets[0].target)
    return None


# ------------------------------------------------------------------------------------------ devices

def _pin_gpus(ctx: Context, calls, hvd: str) -> None:
    gpus = [c for c in calls if ctx.imports.resolve(call_name(c)) in GPUS]
    for call in gpus:
        short = call_name(call)
        args = [a for a in call.args if a.keyword is None or a.keyword.value == "device_id"]
        if len(args) == len(call.args) <= 1 and (not args or isinstance(args[0].value, cst.Integer)):
            ctx.edits.replace[call] = lambda upd: upd.with_changes(args=[cst.Arg(expr(f"{hvd}.local_rank()"))])
            ctx.change(call, RULE, f"{code_of(call)} -> {short}({hvd}.local_rank()): each process uses the GPU "
                       "of its local rank")
        else:
            ctx.warn(call, RULE, f"device chosen by an expression: {code_of(call)}",
                     f"use one GPU per process: {short}({hvd}.local_rank())")
    if gpus:
        ctx.warn(gpus[0], RULE, "perseus.mxnet moves CPU NDArrays only (a GPU NDArray raises NotImplementedError)",
                 "train on mx.cpu() contexts")


# ------------------------------------------------------------------------------------------ data

def _simple_dataset(ctx: Context, call: cst.Call) -> Tuple[str, bool]:
    """How to name gluon.data.SimpleDataset next to this DataLoader, and whether it must be imported."""
    local = call_name(call)
    if "." in local and (ctx.imports.resolve(local) or "").endswith("gluon.data.DataLoader"):
        return local.rsplit(".", 1)[0] + ".SimpleDataset", False
    return "SimpleDataset", ctx.imports.resolve("SimpleDataset") != "mxnet.gluon.data.SimpleDataset"


def _shard_loaders(ctx: Context, calls, hvd: str) -> bool:
    """Training DataLoaders read rank r's share of their dataset. True when ``SimpleDataset`` must be imported."""
    need_import = False
    for call in calls:
        if ctx.imports.resolve(call_name(call)) not in LOADERS:
            continue
        target = _target_name(ctx, call)
        dataset = arg(call, "dataset", 0)
        shuffle = arg(call, "shuffle", 2)
        words = " ".join(x for x in (target, code_of(dataset.value) if dataset else None) if x)
        explicit_shuffle = shuffle is not None and code_of(shuffle.value) not in ("False", "None")
        if EVAL_WORDS.search(words) and not explicit_shuffle:
            continue  # evaluation loader: every rank evaluates on all of it
        if arg(call, "sampler", 3) is not None or arg(call, "batch_sampler", 5) is not None:
            ctx.warn(call, RULE, "this DataLoader has its own sampler",
                     f"make the sampler give each rank its share (rank {hvd}.rank() of {hvd}.size())")
            continue
        if dataset is None or any(a.star for a in call.args):
            ctx.warn(call, RULE, "cannot find the dataset of this DataLoader call",
                     f"pass dataset.shard({hvd}.size(), {hvd}.rank()) (the same length on every rank)")
            continue
        line = ctx.statement_of(call)
        ds_code = code_of(dataset.value)
        if dotted(dataset.value) is None:  # used three times below: evaluate it once, before the statement
            if not isinstance(line, cst.SimpleStatementLine):
                ctx.warn(call, RULE, "the dataset expression cannot be named", "shard the dataset by hand")
                continue
            ds_code = free_name(ctx.module, [f"{target.split('.')[-1]}_dataset" if target else "train_dataset"])
            ctx.edits.insert_before(line, stmt(f"{ds_code} = {code_of(dataset.value)}\n"))
        simple, imported = _simple_dataset(ctx, call)
        need_import = need_import or imported
        view = expr(f"{simple}(range({hvd}.rank(), len({ds_code}) - len({ds_code}) % {hvd}.size(), {hvd}.size()))"
                    f".transform({ds_code}.__getitem__)")
        index = next(i for i, a in enumerate(call.args) if a is dataset)

        def fix(upd, index=index, view=view):
            args = list(upd.args)
            args[index] = args[index].with_changes(value=view)
            return upd.with_changes(args=args)
        ctx.edits.replace[call] = fix
        ctx.change(call, RULE, f"DataLoader reads rank r's share of {ds_code}: samples r, r+size(), ... (the same "
                   "count on every rank; shuffle and last_batch apply within the share)")
    return need_import


def _warn_io_iterators(ctx: Context, calls, hvd: str) -> None:
    for call in calls:
        name = ctx.imports.resolve(call_name(call)) or ""
        if not IO_ITER.match(name):
            continue
        target = _target_name(ctx, call) or ""
        if EVAL_WORDS.search(target):
            continue
        ctx.warn(call, RULE, f"{call_name(call)} gives every rank all of the data",
                 f"shard it: num_parts={hvd}.size(), part_index={hvd}.rank() for record iterators, or "
                 f"arrays[{hvd}.rank()::{hvd}.size()] for NDArrayIter (the same number of batches on every rank)")


# ------------------------------------------------------------------------------------------ trainers

def _trainers(ctx: Context, calls, hvd: str) -> None:
    trainers = [c for c in calls if ctx.imports.resolve(call_name(c)) in TRAINERS]
    broadcast_done = set()
    for n, call in enumerate(trainers):
        short = call_name(call)
        params = arg(call, "params", 0)
        if params is None or arg(call, "optimizer", 1) is None or any(a.star for a in call.args):
            ctx.warn(call, RULE, f"cannot read the arguments of this {short}(...) call",
                     f"replace it by {hvd}.DistributedTrainer(params, optimizer, optimizer_params) and call "
                     f"{hvd}.broadcast_parameters(net.collect_params(), root_rank=0) after net.initialize()")
            continue
        dropped = [(kw, a) for kw, pos in KVSTORE_ARGS for a in [arg(call, kw, pos)] if a is not None]
        drop_index = {i for i, a in enumerate(call.args) if any(a is d for _, d in dropped)}
        target = _target_name(ctx, call)
        prefix = None
        if len(trainers) > 1:  # gradients are named prefix + index: two trainers must not share names
            prefix = f"{target or f'trainer{n}'}."
        if ctx.options.scale_lr:
            _scale_lr(ctx, call, hvd)

        def fix(upd, drop_index=drop_index, prefix=prefix):
            args = [a for i, a in enumerate(upd.args) if i not in drop_index]
            if drop_index and args:
                args[-1] = args[-1].with_changes(comma=upd.args[-1].comma)
            new = upd.with_changes(func=expr(f"{hvd}.DistributedTrainer"), args=args)
            if prefix is not None:
                new = with_kwarg(new, "prefix", cst.SimpleString(f'"{prefix}"'))
            return new
        prev = ctx.edits.replace.get(call)
        ctx.edits.replace[call] = (lambda u, fix=fix, prev=prev: fix(prev(u))) if callable(prev) else fix
        ctx.change(call, RULE, f"{short} -> {hvd}.DistributedTrainer: gradients are averaged over all ranks at "
                   "every step()" + (f" (gradient names prefixed {prefix!r})" if prefix else ""))
        for kw, a in dropped:
            if kw == "compression_params" and code_of(a.value) != "None":
                ctx.warn(call, RULE, "compression_params dropped: DistributedTrainer has no kvstore compression",
                         f"pass compression={hvd}.Compression.fp16 to send float16 gradients, if wanted")
            else:
                ctx.change(call, RULE, f"{kw}={code_of(a.value)} dropped: DistributedTrainer has no kvstore, "
                           "the ranks average the gradients themselves")
        _broadcast(ctx, call, params.value, hvd, broadcast_done)


def _scale_lr(ctx: Context, call: cst.Call, hvd: str) -> None:
    opt = arg(call, "optimizer", 1)
    if isinstance(opt.value, cst.Call):
        common_rules.scale_lr(ctx, opt.value, "learning_rate", None, hvd, RULE)
        return
    opt_params = arg(call, "optimizer_params", 2)
    if opt_params is not None and isinstance(opt_params.value, cst.Dict):
        for e in opt_params.value.elements:
            if isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString) \
                    and e.key.evaluated_value == "learning_rate":
                value = e.value
                simple = isinstance(value, (cst.Name, cst.Attribute, cst.Call, cst.Integer, cst.Float,
                                            cst.Subscript))
                text = code_of(value) if simple else f"({code_of(value)})"
                ctx.edits.replace[value] = expr(f"{text} * {hvd}.size()")
                ctx.change(call, RULE, f"learning rate scaled by {hvd}.size() (--scale-lr): the global batch is "
                           "size() times larger")
                return
    ctx.warn(call, RULE, "--scale-lr: cannot find the learning rate of this trainer",
             f"multiply its learning_rate by {hvd}.size() by hand")


def _assigned_from(ctx: Context, name: str, near: cst.CSTNode) -> Optional[cst.BaseExpression]:
    """The value last assigned to ``name`` in the innermost scope around ``near`` that assigns it."""
    scopes = [a for a in ctx.ancestors(near) if isinstance(a, (cst.FunctionDef, cst.Module))]
    found = [a for a in find_all(ctx.module, cst.Assign)
             if len(a.targets) == 1 and dotted(a.targets[0].target) == name]
    for scope in scopes:
        here = [a for a in found if ctx.scope_of(a) is scope]
        if here:
            return here[-1].value
    return None


def _collect_params_owner(node: cst.BaseExpression) -> Optional[str]:
    """``net`` for ``net.collect_params(...)``."""
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) \
            and node.func.attr.value == "collect_params":
        return dotted(node.func.value)
    return None


def _broadcast(ctx: Context, trainer: cst.Call, params: cst.BaseExpression, hvd: str, done: set) -> None:
    """After the statement that initialises (or loads) the trained parameters: broadcast them from rank 0."""
    owner = _collect_params_owner(params)
    params_name = dotted(params) if owner is None else None
    if params_name is not None:
        value = _assigned_from(ctx, params_name, trainer)
        owner = _collect_params_owner(value) if value is not None else None
    if owner is None and params_name is None:
        ctx.warn(trainer, RULE, "cannot tell which block's parameters this trainer trains",
                 f"after initialising them: {hvd}.broadcast_parameters(net.collect_params(), root_rank=0)")
        return
    sites = []
    for c in find_all(ctx.module, cst.Call):
        if not (isinstance(c.func, cst.Attribute) and c.func.attr.value in INIT_METHODS):
            continue
        receiver = c.func.value
        if owner is not None and dotted(receiver) == owner:
            what = f"{owner}.collect_params()"
        elif owner is not None and _collect_params_owner(receiver) == owner:
            what = code_of(receiver)
        elif params_name is not None and dotted(receiver) == params_name:
            what = params_name
        else:
            continue
        line = ctx.statement_of(c)
        if isinstance(line, cst.SimpleStatementLine):
            sites.append((c, line, what))
    if not sites:
        who = owner or params_name
        init = f"{owner}.initialize(...)" if owner else f"{params_name}.initialize(...)"
        ctx.warn(trainer, RULE, f"cannot find where the parameters of {who} are initialised",
                 f"after {init}: {hvd}.broadcast_parameters("
                 f"{f'{owner}.collect_params()' if owner else params_name}, root_rank=0)")
        return
    for c, line, what in sites:
        if line in done:
            continue
        done.add(line)
        ctx.edits.insert_after(line, stmt(f"{hvd}.broadcast_parameters({what}, root_rank=0)\n"))
        ctx.change(c, RULE, f"rank 0's parameters ({what}) broadcast to every rank once initialised (a parameter "
                   "with deferred shape is broadcast when the first forward pass creates it)")


# ------------------------------------------------------------------------------------------ metrics

def _average_metrics(ctx: Context, hvd: str) -> None:
    """``--average-metrics``: the printed losses/accuracies of the guarded prints, averaged over the ranks."""
    mx = ctx.imports.alias_of("mxnet")
    for line in list(ctx.edits.guard):
        if not isinstance(line, cst.SimpleStatementLine) or not isinstance(line.body[0], cst.Expr):
            continue
        call = line.body[0].value
        if not (isinstance(call, cst.Call) and call_name(call) == "print"):
            continue
        targets: List[cst.BaseExpression] = []
        for a in call.args:
            if a.keyword is not None:
                continue
            if isinstance(a.value, cst.FormattedString):
                targets += [p.expression for p in a.value.parts if isinstance(p, cst.FormattedStringExpression)]
            elif not isinstance(a.value, (cst.SimpleString, cst.ConcatenatedString)):
                targets.append(a.value)
        targets = [t for t in targets if common_rules.METRIC_WORDS.search(code_of(t))]
        if targets and mx is None:
            ctx.warn(line, RULE, "--average-metrics: the script does not `import mxnet`",
                     f"average the printed values with {hvd}.allreduce(mx.nd.array([value])) by hand")
            continue
        for n, t in enumerate(targets):
            name = common_rules._metric_name(code_of(t), ctx.line(line), n)
            ctx.edits.insert_before(line, stmt(
                f'{name} = {hvd}.allreduce({mx}.nd.array([float({code_of(t)})], dtype="float64"), '
                f'name="metric.{ctx.line(line)}.{n}").asscalar()\n'))
            ctx.edits.replace[t] = cst.Name(name)
        if targets:
            ctx.change(line, RULE, f"{len(targets)} printed metric(s) averaged over all ranks before printing")
