"""The Lightning strategy of the Lightning estimator's ranks: one process per rank, gradients averaged by
perseus.

Lightning 2 has no Horovod strategy (it was removed in 2.0), so the ranks train with :class:`PerseusStrategy`, a
``ParallelStrategy`` whose collectives are perseus's: every rank runs its own ``Trainer`` on one device and its
own share of the data; after :func:`perseus.torch.init` the strategy

- takes the rank, local rank, node and size from perseus (:class:`PerseusEnvironment`), so that Lightning's
  ``is_global_zero``, ``rank_zero_only`` (logging, progress bar) and ``world_size`` are the job's;
- broadcasts rank 0's parameters and buffers at setup, multiplies each optimizer's learning rate (and its
  schedulers' base rates) by the number of ranks, as Horovod's estimator did, and wraps each optimizer in a
  :func:`perseus.torch.DistributedOptimizer` (``compression``; ``backward_passes_per_step`` is the Trainer's
  ``accumulate_grad_batches``), whose hooks start the gradients' all-reduces during backward;
- waits for the averaged gradients right after each backward that ends an optimizer step (not while Lightning
  accumulates), so that gradient clipping, ``on_before_optimizer_step`` and the step itself see the averages;
  the optimizer's step then runs without communicating again;
- implements ``reduce`` (``self.log(..., sync_dist=True)``, EarlyStopping's and ModelCheckpoint's decisions),
  ``all_gather``, ``broadcast`` and ``barrier`` with perseus's collectives.

Every method documented as collective must be called by every rank (Lightning does so as long as every rank runs
the same number of steps, which the estimator's data modules ensure).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from lightning_fabric.plugins.environments import ClusterEnvironment
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_only

import perseus.torch as hvd

__all__ = ["PerseusStrategy", "PerseusEnvironment", "set_rank_zero"]

_OPS = {"mean": hvd.Average, "avg": hvd.Average, "average": hvd.Average, "sum": hvd.Sum, "max": hvd.Max,
        "min": hvd.Min, "product": hvd.Product}


def set_rank_zero(rank: int) -> None:
    """Make Lightning's ``rank_zero_only`` functions (logging, warnings, loggers) run on rank 0 only."""
    rank_zero_only.rank = utils_rank_zero_only.rank = rank


class PerseusEnvironment(ClusterEnvironment):
    """The job as perseus sees it (the processes exist already; nothing is started). Call after ``hvd.init()``."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"  # not used: perseus connects the ranks

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return hvd.is_initialized()

    def world_size(self) -> int:
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        """The size is perseus's; Lightning's value is ignored."""

    def global_rank(self) -> int:
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        """The rank is perseus's; Lightning's value is ignored."""

    def local_rank(self) -> int:
        return hvd.local_rank()

    def node_rank(self) -> int:
        return hvd.cross_rank()


def _op(reduce_op) -> Any:
    """perseus's reduction for Lightning's ``reduce_op`` (a string or a ``torch.distributed.ReduceOp``).

    Raises:
        ValueError: an operation perseus does not have.
    """
    name = "mean" if reduce_op is None else str(reduce_op).rsplit(".", 1)[-1].lower()
    if name not in _OPS:
        raise ValueError(f"PerseusStrategy.reduce: unsupported reduce_op {reduce_op!r} (one of {sorted(_OPS)})")
    return _OPS[name]


def _step_after_averaging(optimizer) -> None:
    """Give a DistributedOptimizer a ``step(closure)`` that evaluates the closure (forward, backward, which
    averages the gradients through the strategy, then Lightning's clipping) before stepping, and steps without
    communicating when the strategy already waited for the averages (else it waits for them first)."""
    base = type(optimizer)

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if not self._perseus_averaged:  # a backward the strategy did not see (or none): reduce now
            self.synchronize()
        self._perseus_averaged = False
        with self.skip_synchronize():
            base.step(self)
        return loss

    optimizer.__class__ = type(base.__name__, (base,), {"step": step, "__module__": base.__module__})
    optimizer._perseus_averaged = False


class PerseusStrategy(ParallelStrategy):
    """A Lightning strategy for a job of perseus ranks, one device each (see the module doc).

    Args:
        device: this rank's device (``torch.device("cpu")`` or its GPU).
        compression: the DistributedOptimizer's gradient compression (default: none).

    Collective: a Trainer with this strategy runs on every rank of the job, after ``hvd.init()``.
    """

    strategy_name = "perseus"

    def __init__(self, device: torch.device, compression=None, **kwargs):
        super().__init__(parallel_devices=[device], cluster_environment=PerseusEnvironment(), **kwargs)
        self._device = device
        self._compression = compression
        self._accumulating = False
        self._distributed: list = []

    @property
    def root_device(self) -> torch.device:
        return self._device

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Called by Lightning's Trainer: the ranks are perseus's; make rank 0 Lightning's rank zero."""
        set_rank_zero(self.global_rank)

    def setup_environment(self) -> None:
        set_rank_zero(self.global_rank)
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup(self, trainer) -> None:
        """Lightning's setup, then rank 0's parameters and buffers on every rank and, when fitting, the
        optimizers distributed. Collective."""
        super().setup(trainer)
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        if trainer.state.fn == TrainerFn.FITTING:
            self._distribute_optimizers(trainer)

    def _distribute_optimizers(self, trainer) -> None:
        module, size = self.lightning_module, self.world_size
        wrapped = []
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * size
            if optimizer.state:  # state made before training (an optimizer's own): rank 0's everywhere
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
            named = [(name, p) for name, p in module.named_parameters() if id(p) in mine]
            kwargs = {"compression": self._compression} if self._compression is not None else {}
            dist = hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                            backward_passes_per_step=max(1, int(trainer.accumulate_grad_batches)),
                                            **kwargs)
            _step_after_averaging(dist)
            for config in self.lr_scheduler_configs:
                scheduler = config.scheduler
                if getattr(scheduler, "optimizer", None) is optimizer:
                    scheduler.optimizer = dist
                    if hasattr(scheduler, "base_lrs"):
                        scheduler.base_lrs = [lr * size for lr in scheduler.base_lrs]
            wrapped.append(dist)
        self.optimizers = wrapped
        self._distributed = wrapped

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Lightning accumulates gradients inside this block: the backward passes there end no step, so the
        strategy does not wait for averages (the optimizer's hooks reduce after the last pass)."""
        self._accumulating = True
        try:
            yield None
        finally:
            self._accumulating = False

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        """Lightning's backward, then (unless accumulating) wait for the averaged gradients of ``optimizer``
        (of every optimizer for a manual ``manual_backward``). Collective."""
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        if not self._accumulating:
            inner = getattr(optimizer, "_optimizer", optimizer)
            targets = [o for o in self._distributed if o is inner] or self._distributed
            for opt in targets:
                opt.synchronize()
                opt._perseus_averaged = True
        return out

    def reduce(self, tensor, group: Optional[Any] = None, reduce_op="mean"):
        """``tensor`` reduced over the ranks (in place when the dtype allows; a value that is not a tensor is
        returned as it is). Collective."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        op = _op(reduce_op)
        value = tensor.detach()
        if op == hvd.Average and not value.is_floating_point():
            value = value.double()
        result = hvd.allreduce(value, op=op)
        if result.dtype == tensor.dtype and not tensor.requires_grad:
            tensor.copy_(result)
            return tensor
        return result

    def all_gather(self, tensor, group: Optional[Any] = None, sync_grads: bool = False):
        """Every rank's ``tensor`` stacked along a new first dimension (of the number of ranks). Collective."""
        return hvd.allgather(tensor.detach().unsqueeze(0))

    def broadcast(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank. Collective."""
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name: Optional[str] = None) -> None:
        """Wait for every rank. Collective."""
        hvd.barrier()
