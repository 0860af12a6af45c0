"""Batch normalization whose batch statistics cover the global batch of every rank of a process set."""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from perseus.runtime.state import runtime as _basics_state
from perseus.torch.mpi_ops import Sum, allreduce_async, global_process_set, synchronize

__all__ = ["SyncBatchNorm"]


# Collective names. Every module gets a key the first time it synchronizes on a process set, in the order of
# those first calls; ranks that make the same SyncBatchNorm calls in the same order (which they must do anyway)
# therefore give each module the same key. Each module reuses its names at every step, so after the first
# step the engine recognises them without a fresh negotiation. Keys live outside the module, so a deep copy or
# an unpickled module gets a key of its own at its own first call.
_keys_lock = threading.Lock()
_keys: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_key_counts: dict = {}


def _reset_keys() -> None:
    """At shutdown: forget every module's key, so that after an elastic reset all ranks number the modules
    afresh in the order of their first calls, whatever each rank did before the failure."""
    global _keys
    with _keys_lock:
        _keys = weakref.WeakKeyDictionary()
        _key_counts.clear()


_basics_state().register_job_state(_reset_keys)


def _collective_name(module: torch.nn.Module, process_set) -> str:
    ps_id = process_set.process_set_id
    with _keys_lock:
        per_module = _keys.setdefault(module, {})
        key = per_module.get(ps_id)
        if key is None:
            key = _key_counts.get(ps_id, 0)
            _key_counts[ps_id] = key + 1
            per_module[ps_id] = key
    return f"perseus.sync_batch_norm.{key}"


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are accumulated in float32 for 16-bit inputs (as torch's kernels do), else in the input's dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm with batch statistics (and their gradients) summed over the ranks of a process set.

    Forward: one Sum allreduce of ``[count, sum(x), sum(x**2)]`` per channel, in float64. Each rank forms its
    sums from its own mean and biased variance (torch's batch-norm kernel, so no cancellation locally), and
    float64 keeps the global ``sum(x**2) - count * mean**2`` accurate. Backward: one Sum allreduce of
    ``[sum(dy), sum(dy * x_hat)]``.

    Large tensors are read as few times as possible and each pass allocates one tensor of the input's size, its
    result: the forward rescales torch's locally normalized output in place, per channel; the backward builds
    the input gradient in the buffer that held ``dy * (x - mean)``.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, factor, name, process_set):
        channels = input.size(1)
        shape = [1, channels] + [1] * (input.dim() - 2)
        sdt = _stat_dtype(input.dtype)
        local_count = input.numel() // channels if channels else 0

        local_out = None
        packed = torch.zeros(1 + 2 * channels, dtype=torch.float64, device=input.device)
        if local_count > 0:
            if local_count > 1:
                # Local mean and unbiased variance land in these buffers (momentum 1 overwrites them); the
                # output, normalized with the local statistics, is rescaled below.
                local_mean = torch.zeros(channels, dtype=sdt, device=input.device)
                local_var = torch.zeros(channels, dtype=sdt, device=input.device)
                local_out = F.batch_norm(input, local_mean, local_var, None, None, True, 1.0, eps)
                local_mean = local_mean.double()
                local_var = local_var.double() * ((local_count - 1) / local_count)
            else:
                local_mean = input.reshape(channels).double()
                local_var = torch.zeros(channels, dtype=torch.float64, device=input.device)
            packed[0] = local_count
            packed[1:1 + channels] = local_mean * local_count
            packed[1 + channels:] = (local_var + local_mean * local_mean) * local_count
        total = synchronize(allreduce_async(packed, name=f"{name}.forward", op=Sum, process_set=process_set))

        count = int(round(total[0].item()))
        if count == 1:
            raise ValueError("Expected more than 1 value per channel when training, got 1 value per channel over "
                             f"the {process_set.size()} ranks of the process set (input size {tuple(input.shape)} "
                             "on this rank)")
        ctx.count, ctx.name, ctx.process_set = count, name, process_set
        if count == 0:
            # Every rank's batch is empty: like torch.nn.BatchNorm, return an empty result and leave the running
            # statistics alone. Every rank sees count == 0, so every rank skips the backward allreduce too.
            ctx.save_for_backward(None, weight, None, None)
            return input.new_empty(input.shape)

        mean = total[1:1 + channels] / count
        var = (total[1 + channels:] / count - mean * mean).clamp_min_(0.0)
        if running_mean is not None:
            running_mean.mul_(1.0 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
        if running_var is not None:
            unbiased = var * (count / (count - 1))
            running_var.mul_(1.0 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)

        invstd = torch.rsqrt(var + eps)
        scale = invstd if weight is None else invstd * weight.double()
        shift = -mean * scale if bias is None else bias.double() - mean * scale
        ctx.save_for_backward(input, weight, mean.to(sdt), invstd.to(sdt))
        if local_out is not None:
            # local_out = (x - local_mean) * local_invstd, so the global result is local_out * a + b per channel.
            a = scale * torch.sqrt(local_var + eps)
            b = shift + local_mean * scale
            return local_out.mul_(a.to(sdt).view(shape)).add_(b.to(sdt).view(shape))
        # At most one value per channel here.
        out = input.to(torch.float64) * scale.view(shape) + shift.view(shape)
        return out.to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        nones = (None,) * 6
        if ctx.count == 0:
            grad_input = torch.zeros_like(grad_output) if need_input else None
            grad_weight = torch.zeros_like(weight) if weight is not None and need_weight else None
            # bias has the weight's shape and dtype; it is not saved (not needed elsewhere).
            grad_bias = torch.zeros_like(weight) if weight is not None and need_bias else None
            return (grad_input, grad_weight, grad_bias) + nones

        channels = input.size(1)
        dims = [0] + list(range(2, input.dim()))
        shape = [1, channels] + [1] * (input.dim() - 2)
        sdt = mean.dtype
        dy = grad_output
        buf = torch.sub(input, mean.view(shape))           # statistics dtype, by type promotion
        sum_dy = dy.sum(dim=dims, dtype=sdt)               # zeros for an empty local batch
        sum_dy_xhat = buf.mul_(dy).sum(dim=dims) * invstd

        # weight and bias get this rank's own gradient (of its local loss), as for any other parameter; the
        # optimizer's gradient allreduce combines them across ranks.
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and need_weight else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None and need_bias else None

        # Always reduce, even when this rank needs no input gradient, so that every rank makes the same calls.
        total = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xhat]), name=f"{ctx.name}.backward",
                                            op=Sum, process_set=ctx.process_set))
        grad_input = None
        if need_input:
            # dx = scale * (dy - mean(dy) - x_hat * mean(dy * x_hat)) with scale = weight * invstd and both
            # means over the global batch, i.e. (x - mean) * k + dy * scale + c per channel.
            scale = invstd if weight is None else invstd * weight.to(sdt)
            k = -scale * invstd * (total[channels:] / ctx.count)
            c = -scale * (total[:channels] / ctx.count)
            torch.sub(input, mean.view(shape), out=buf)
            grad_input = buf.mul_(k.view(shape)).addcmul_(dy, scale.view(shape)).add_(c.view(shape))
            grad_input = grad_input.to(input.dtype)
        return (grad_input, grad_weight, grad_bias) + nones


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the global batch of every rank of a process set (Horovod's SyncBatchNorm).

    In training mode, and in eval mode when the module keeps no running statistics, the per-channel mean and
    variance are those of the concatenation of every rank's batch, combined exactly even when the ranks' batch
    sizes differ; ``running_mean``, ``running_var`` and ``num_batches_tracked`` are updated exactly as
    ``torch.nn.BatchNorm{1,2,3}d`` would update them on that concatenated batch (unbiased variance, ``momentum``,
    or the cumulative average when ``momentum`` is None). The backward pass is that of batch norm on the global
    batch, restricted to this rank's rows; ``weight.grad`` and ``bias.grad`` are the gradients of this rank's
    own loss, to be reduced like every other gradient (e.g. by ``DistributedOptimizer``).

    Each synchronized forward makes one allreduce and each backward one more, so **every rank of the process
    set must call forward, and later backward, on this module together and in the same order**, including a
    rank whose batch is empty (it contributes nothing to the statistics). In eval mode with running statistics,
    or when the process set has one rank, the module is exactly ``torch.nn.functional.batch_norm`` and makes no
    collective call. CUDA inputs are supported: the two all-reduces of the statistics take the GPU path
    (docs/gpu.md).

    Args:
        num_features: number of channels ``C`` of an input of shape ``(N, C)`` or ``(N, C, *)``.
        eps: added to the variance for numerical stability. Default: 1e-5.
        momentum: weight of the newest batch in the running statistics, or None for a cumulative average.
            Default: 0.1.
        affine: learn a per-channel ``weight`` and ``bias``. Default: True.
        track_running_stats: keep ``running_mean`` and ``running_var`` (used in eval mode). Default: True.
        process_set: (keyword only) the ranks whose batches are normalized together. Default: all ranks.

    Raises:
        ValueError: the input has fewer than 2 dimensions or not ``num_features`` channels; in training, the
            global batch holds a single value per channel; batch statistics are needed and this rank is not in
            ``process_set``, or the set is not registered.
        HorovodInternalError: the collective failed (e.g. a rank did not call, or called with another shape).
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, *,
                 process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        if input.size(1) != self.num_features:
            raise ValueError(f"expected {self.num_features} channels in dimension 1, got input of size "
                             f"{tuple(input.shape)}")

        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum

        # Batch statistics in training, and in eval when there are no running statistics to use.
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        # Running statistics are read in eval and updated in training only when tracked.
        use_running = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_running else None
        running_var = self.running_var if use_running else None

        process_set = self.process_set
        if batch_stats and process_set.included() is False:
            raise ValueError(f"perseus: this rank is not a member of {process_set}, the process set of this "
                             "SyncBatchNorm")
        if not batch_stats or process_set.size() == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, batch_stats, factor,
                                self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var, self.eps,
                                            factor, _collective_name(self, process_set), process_set)
