"""Broadcast model and optimizer state, and move arbitrary Python objects between ranks."""

from __future__ import annotations


import torch

from perseus.runtime import objects as _objects

from perseus.runtime.process_sets import global_process_set
from perseus.torch.mpi_ops import broadcast_, broadcast_async_, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def _named_tensors(params):
    if isinstance(params, dict):
        return sorted(params.items())
    items = list(params)
    if items and isinstance(items[0], tuple):
        return items
    return [(f"param.{i}", p) for i, p in enumerate(items)]


def broadcast_parameters(params, root_rank):
    """Overwrite ``params`` on every rank with the root's values, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()``, or a list of tensors.
        root_rank: the rank whose values everyone gets.

    Tensors marked ``perseus_model_parallel`` (a DistributedEmbedding's shard, in ``named_parameters()`` and in
    ``state_dict()``) differ on every rank by design and are left alone.

    Collective: every rank calls it with the same parameter names and shapes.
    """
    handles = []
    for name, p in _named_tensors(params):
        if p is None or getattr(p, "perseus_model_parallel", False):  # a per-rank shard stays as it is
            continue
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(p).__name__}, not a tensor; use "
                             "broadcast_object for other values")
        handles.append(broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank,
                                        name=f"bcast_param.{name}"))
    for h in handles:
        synchronize(h)


def _initialize_state(optimizer, model) -> None:
    """Create lazily-built optimizer state everywhere with one zero-gradient step.

    Parameters are restored afterwards; the zero gradients stay (as Horovod leaves them).
    """
    sparse = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse or getattr(m, "perseus_sparse_shard", False):
                sparse.update(id(p) for p in m.parameters())
    saved = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            saved.append((p, p.detach().clone(), p.grad))
            grad = torch.zeros_like(p)
            if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                grad = grad.to_sparse()
            p.grad = grad
    step = getattr(optimizer, "_perseus_local_step", None)  # a DistributedOptimizer: skip the allreduce
    (step or optimizer.step)()
    with torch.no_grad():
        for p, value, _ in saved:  # a zero-gradient step may still move parameters (weight decay)
            p.copy_(value)


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Overwrite the optimizer's state and hyper-parameters on every rank with the root's, in place.

    State that optimizers create lazily (momentum, Adam moments) is created first with a zero-gradient step
    whose parameter changes are undone. ``model`` identifies sparse embeddings. The state of parameters
    marked ``perseus_model_parallel`` (per-rank shards) is left alone.

    Collective: every rank calls it with an optimizer of the same structure.

    Raises:
        TypeError: ``optimizer`` is not an optimizer. ValueError: the optimizer is L-BFGS (its state cannot be
            broadcast this way), or ``root_rank`` is not a rank of the job.
    """
    if not (hasattr(optimizer, "state_dict") and hasattr(optimizer, "param_groups")):
        raise TypeError(f"broadcast_optimizer_state: expected a torch.optim optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"]:
        _initialize_state(optimizer, model)
    state = optimizer.state_dict()
    scalars, tensors = {}, []
    for gi, group in enumerate(state["param_groups"]):
        for key, value in group.items():
            if key != "params":
                scalars[("group", gi, key)] = value
        for pid, param in zip(group["params"], optimizer.param_groups[gi]["params"]):
            if getattr(param, "perseus_model_parallel", False):  # a per-rank shard's state stays as it is
                continue
            for key, value in state["state"].get(pid, {}).items():
                if torch.is_tensor(value):
                    tensors.append((f"opt_state.{pid}.{key}", value))
                else:
                    scalars[("state", pid, key)] = value
    scalars = broadcast_object(scalars, root_rank, name="opt_scalars")
    params_by_id = {}
    for gi, group in enumerate(state["param_groups"]):
        for pid, p in zip(group["params"], optimizer.param_groups[gi]["params"]):
            params_by_id[pid] = p
    for (kind, a, key), value in scalars.items():
        if kind == "group":
            optimizer.param_groups[a][key] = value
        elif params_by_id.get(a) in optimizer.state:
            optimizer.state[params_by_id[a]][key] = value
    handles = [broadcast_async_(t, root_rank, name=name) for name, t in tensors if t.is_contiguous()]
    for name, t in tensors:
        if not t.is_contiguous():
            t.copy_(broadcast_(t.contiguous(), root_rank, name=name))
    for h in handles:
        synchronize(h)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Return the root's ``obj`` on every rank (serialised with cloudpickle). ``root_rank`` is a job rank.

    Collective: every rank of ``process_set`` calls it; only the root's ``obj`` matters.
    """
    return _objects.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, name=None):
    """Return the list of every rank's ``obj``, in rank order (serialised with cloudpickle).

    Collective: every rank calls it.
    """
    return _objects.allgather_object(obj, name)

