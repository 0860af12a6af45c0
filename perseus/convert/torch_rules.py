"""PyTorch: init, device pinning, DistributedOptimizer, broadcasts, DistributedSampler, rank-0 guards."""

from __future__ import annotations

import re
from typing import List, Optional

import libcst as cst

from perseus.convert import common_rules, file_rules
from perseus.convert.context import Context
from perseus.convert.syntax import (arg, call_name, code_of, dotted, expr, find_all, free_name, stmt, with_kwarg,
                                    without_kwarg)

RULE = "torch"
OPTIMIZER = re.compile(r"^torch\.optim\.[A-Z]\w*$")
LOADERS = ("torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader")
EVAL_WORDS = re.compile(r"test|val|eval|dev", re.IGNORECASE)


def apply(ctx: Context) -> None:
    imports = ctx.imports
    existing = imports.alias_of("perseus.torch")
    if existing:  # already a perseus (or converted Horovod) script: nothing more to do
        return
    hvd = free_name(ctx.module, ["hvd", "phvd", "perseus_hvd"])
    torch = imports.alias_of("torch")
    extra: List[str] = []
    text = ctx.module.code
    if re.search(r"\.cuda\(|[\"']cuda|torch\.cuda", text):
        if torch:
            extra.append(f"if {torch}.cuda.is_available():\n    {torch}.cuda.set_device({hvd}.local_rank())\n")
            ctx.change(None, RULE, "pin each process to the GPU of its local rank")
        else:
            ctx.warn(None, RULE, "the script uses CUDA but does not `import torch`",
                     f"call torch.cuda.set_device({hvd}.local_rank()) after {hvd}.init()")
        for s in find_all(ctx.module, cst.SimpleString):
            if re.fullmatch(r"[\"']cuda:\d+[\"']", s.value):
                ctx.warn(s, RULE, f"hard-coded device {s.value}",
                         f"use \"cuda\" (the pinned device) or f\"cuda:{{{hvd}.local_rank()}}\"")
    sampler = _wrap_loaders(ctx, hvd)
    extra_imports = []
    if sampler and "DistributedSampler" not in imports.from_names:
        extra_imports.append("from torch.utils.data.distributed import DistributedSampler\n")
    _wrap_optimizers(ctx, hvd)
    common_rules.guard_statements(ctx, hvd, RULE, _is_save)
    extra_imports += file_rules.rewrite_reads(ctx, "torch", RULE, bool(ctx.rank0_writes))
    common_rules.disable_progress_bars(ctx, hvd, RULE)
    common_rules.add_import_and_init(ctx, "perseus.torch", hvd, extra, RULE, extra_imports)
    ctx.apply()


def _is_save(ctx: Context, call: cst.Call) -> bool:
    name = ctx.imports.resolve(call_name(call)) or ""
    return name == "torch.save" or name.endswith(".save_pretrained")


# ------------------------------------------------------------------------------------------ optimizers

def _target_of(ctx: Context, call: cst.Call):
    """(statement, kind, target code) for ``x = call``, ``self.x = call``, ``return call``; else None."""
    parent = ctx.parents.get(call)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
        target = parent.targets[0].target
        code = dotted(target)
        if code is not None:
            return ctx.parents.get(parent), "assign", code
    if isinstance(parent, cst.Return):
        return ctx.parents.get(parent), "return", None
    return None


def _param_owners(params: cst.BaseExpression) -> List[str]:
    """Who the optimizer's parameters come from: ``m`` for every ``m.parameters()`` inside ``params``."""
    owners = []
    for c in find_all(params, cst.Call):
        if isinstance(c.func, cst.Attribute) and c.func.attr.value == "parameters":
            owner = dotted(c.func.value)
            if owner and owner not in owners:
                owners.append(owner)
    return owners


def _common_owner(owners: List[str]) -> Optional[str]:
    if not owners:
        return None
    parts = [o.split(".") for o in owners]
    common = []
    for group in zip(*parts):
        if len(set(group)) != 1:
            break
        common.append(group[0])
    if not common or common == ["self"]:
        return None
    return ".".join(common)


def _wrap_optimizers(ctx: Context, hvd: str) -> None:
    calls = [c for c in find_all(ctx.module, cst.Call) if OPTIMIZER.match(ctx.imports.resolve(call_name(c)) or "")]
    broadcast_done = set()
    for call in calls:
        where = _target_of(ctx, call)
        short = call_name(call)
        if where is None or not isinstance(where[0], cst.SimpleStatementLine) or len(where[0].body) != 1:
            ctx.warn(call, RULE, f"{short}(...) is not assigned to a name or returned, so it cannot be wrapped",
                     f"wrap it: opt = {hvd}.DistributedOptimizer(opt, named_parameters=model.named_parameters()) "
                     f"and call {hvd}.broadcast_parameters(model.state_dict(), root_rank=0)")
            continue
        line, kind, target = where
        params = arg(call, "params", 0)
        owners = _param_owners(params.value) if params is not None else []
        owner = owners[0] if len(owners) == 1 else _common_owner(owners)
        if kind == "return":
            target = free_name(ctx.scope_of(call), ["optimizer", "opt", "distributed_optimizer"])
        if ctx.options.scale_lr:
            common_rules.scale_lr(ctx, call, "lr", 1, hvd, RULE)
        if owner and len(calls) > 1:  # several optimizers: names must not collide between them
            named = f", named_parameters=[(\"{owner}.\" + n, p) for n, p in {owner}.named_parameters()]"
        else:
            named = f", named_parameters={owner}.named_parameters()" if owner else ""
        new = [stmt(f"{target} = {hvd}.DistributedOptimizer({target}{named})\n")]
        scope = ctx.scope_of(call)
        bcast = [owner] if owner else [o for o in owners]
        for model in bcast:
            if (scope, model) in broadcast_done:
                continue
            broadcast_done.add((scope, model))
            new.append(stmt(f"{hvd}.broadcast_parameters({model}.state_dict(), root_rank=0)\n"))
        if kind == "return":
            assign = stmt(f"{target} = None\n")

            def to_assign(upd, assign=assign, line=line):
                value = upd.body[0].value
                return assign.with_changes(body=[assign.body[0].with_changes(value=value)],
                                           leading_lines=upd.leading_lines)
            ctx.edits.replace[line] = to_assign
            new.append(stmt(f"return {target}\n"))
        ctx.edits.insert_after(line, *new)
        how = f"named_parameters={owner}.named_parameters()" if owner else "without named_parameters"
        ctx.change(call, RULE, f"{short} wrapped in {hvd}.DistributedOptimizer ({how}): gradients are averaged "
                   f"over all ranks")
        if bcast:
            ctx.change(call, RULE, f"rank 0's parameters of {', '.join(bcast)} broadcast to every rank after "
                       "the optimizer is created")
        else:
            ctx.warn(call, RULE, f"cannot tell which model {short}(...) trains",
                     f"add {hvd}.broadcast_parameters(model.state_dict(), root_rank=0) after it")
        if not owner and len(calls) > 1:
            ctx.warn(call, RULE, "several optimizers and no named_parameters: gradient names may collide",
                     "pass named_parameters= with unique names to DistributedOptimizer")
        _broadcast_after_load(ctx, target, hvd, ctx.imports.resolve(short) == "torch.optim.LBFGS")


def _broadcast_after_load(ctx: Context, target: str, hvd: str, lbfgs: bool = False) -> None:
    """After ``opt.load_state_dict(...)``, rank 0's optimizer state goes to every rank (L-BFGS state cannot be
    broadcast: every rank must load the same state, which ``torch.load`` through root_file gives)."""
    for c in find_all(ctx.module, cst.Call):
        if call_name(c) == f"{target}.load_state_dict":
            line = ctx.statement_of(c)
            if lbfgs:
                loads = [x for x in find_all(ctx.scope_of(c), cst.Call)
                         if ctx.imports.resolve(call_name(x)) == "torch.load"]
                if loads:
                    ctx.change(c, RULE, "L-BFGS state is not broadcast (broadcast_optimizer_state cannot carry it): "
                               "every rank loads the same state, read with torch.load")
                else:
                    ctx.warn(c, RULE, "L-BFGS state loaded here cannot be broadcast from rank 0",
                             "give every rank the same state (e.g. torch.load(root_file(path)), "
                             "from perseus.common.files import root_file)")
                continue
            if isinstance(line, cst.SimpleStatementLine):
                ctx.edits.insert_after(line, stmt(f"{hvd}.broadcast_optimizer_state({target}, root_rank=0)\n"))
                ctx.change(c, RULE, "optimizer state loaded here is broadcast from rank 0")


# ------------------------------------------------------------------------------------------ data loaders

def _wrap_loaders(ctx: Context, hvd: str) -> bool:
    used = False
    for call in find_all(ctx.module, cst.Call):
        if ctx.imports.resolve(call_name(call)) not in LOADERS:
            continue
        where = _target_of(ctx, call)
        target = where[2] if where else None
        dataset = arg(call, "dataset", 0)
        shuffle = arg(call, "shuffle", 2)
        words = " ".join(x for x in (target, code_of(dataset.value) if dataset else None) if x)
        explicit_shuffle = shuffle is not None and code_of(shuffle.value) != "False"
        if EVAL_WORDS.search(words) and not explicit_shuffle:
            continue  # evaluation loader: every rank evaluates on all of it
        sampler = arg(call, "sampler") or arg(call, "batch_sampler")
        if sampler is not None:
            if "DistributedSampler" not in code_of(sampler.value):
                ctx.warn(call, RULE, "this DataLoader has its own sampler",
                         f"make the sampler give each rank its share (rank {hvd}.rank() of {hvd}.size())")
            continue
        positional = [a for a in call.args if a.keyword is None]
        if dataset is None or len(positional) > 2 or any(a.star for a in call.args):
            ctx.warn(call, RULE, "cannot add a DistributedSampler to this DataLoader call",
                     f"pass sampler=DistributedSampler(dataset, num_replicas={hvd}.size(), rank={hvd}.rank())")
            continue
        ds_code = code_of(dataset.value)
        line = ctx.statement_of(call)
        if dotted(dataset.value) is None:
            if not isinstance(line, cst.SimpleStatementLine):
                ctx.warn(call, RULE, "the dataset expression cannot be named", "add a DistributedSampler by hand")
                continue
            name = free_name(ctx.module, [f"{target.split('.')[-1]}_dataset" if target else "train_dataset"])
            ctx.edits.insert_before(line, stmt(f"{name} = {ds_code}\n"))
            ds_code, new_ds = name, cst.Name(name)
        else:
            new_ds = None
        shuffle_code = code_of(shuffle.value) if shuffle is not None else "False"
        sampler_expr = expr(f"DistributedSampler({ds_code}, num_replicas={hvd}.size(), rank={hvd}.rank(), "
                            f"shuffle={shuffle_code})")

        def fix(upd, new_ds=new_ds, sampler_expr=sampler_expr, ds_index=next(i for i, x in enumerate(call.args) if x is dataset)):
            if new_ds is not None:
                args = list(upd.args)
                args[ds_index] = args[ds_index].with_changes(value=new_ds)
                upd = upd.with_changes(args=args)
            return with_kwarg(without_kwarg(upd, "shuffle"), "sampler", sampler_expr)
        ctx.edits.replace[call] = fix
        used = True
        ctx.change(call, RULE, f"DataLoader gets a DistributedSampler (shuffle={shuffle_code}): each rank "
                   "reads its own 1/size() of the data")
        _set_epoch(ctx, call, target, hvd, shuffle_code != "False")
    return used


def _set_epoch(ctx: Context, call, target: Optional[str], hvd: str, shuffled: bool) -> None:
    loops = []
    if target is not None:
        for loop in find_all(ctx.module, cst.For):
            if target in code_of(loop.iter) or not isinstance(loop.target, cst.Name):
                continue
            if re.search(rf"(?<![\w.]){re.escape(target)}(?!\w)", code_of(loop.body)):
                loops.append(loop)
    # the innermost candidate loop (one that contains no other candidate)
    inner = [lp for lp in loops if not any(o is not lp and o in find_all(lp.body, cst.For) for o in loops)]
    if not inner:
        if shuffled:
            ctx.warn(call, RULE, "no epoch loop found for this DataLoader",
                     "call <loader>.sampler.set_epoch(epoch) at the start of every epoch (else every epoch "
                     "reuses the same order)")
        return
    for loop in inner:
        if "set_epoch" in code_of(loop.body):
            continue
        first = loop.body.body[0]
        epoch = loop.target.value
        ctx.edits.insert_before(first, stmt(f"{target}.sampler.set_epoch({epoch})\n"))
        ctx.change(loop, RULE, f"{target}.sampler.set_epoch({epoch}) at the start of each epoch: a new "
                   "shuffle per epoch, the same on every rank")
