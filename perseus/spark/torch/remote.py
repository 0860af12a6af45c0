"""The training function a :class:`~perseus.spark.torch.TorchEstimator` runs on every rank.

Each rank: ``hvd.init()``; the model and optimizer from the driver (or the run's last checkpoint), the learning
rate multiplied by the number of ranks (Horovod's estimator convention; checkpoints keep the unscaled rate);
rank 0's parameters and optimizer state broadcast; a ``DistributedOptimizer``; then, for each epoch, the
same number of training batches on every rank (its share of the prepared data), the loss and metrics averaged
over the ranks, a validation pass when the estimator has validation data, and on rank 0 a checkpoint
(``{"model", "optimizer", "epoch", "history"}``) copied to the run's directory in the store. Rank 0 returns
``(history, checkpoint bytes)``; the other ranks return None.

A run started again with the same ``run_id`` resumes after the last epoch its checkpoint holds.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any, Callable, Optional

import numpy as np
import torch

import perseus.torch as hvd
from perseus.spark.common.datamodule import ParquetDataModule

__all__ = ["TrainSpec", "RemoteTrainer", "calculate_loss", "to_tensors"]


@dataclasses.dataclass
class TrainSpec:
    """Everything a rank needs, picklable (made by the estimator on the driver)."""

    model: Any                       # the torch.nn.Module (pickled whole, with its class)
    optimizer_cls: type
    optimizer_state: dict            # the optimizer's state_dict (unscaled learning rate)
    model_state: Optional[dict]      # the model's state_dict to start from (a checkpoint's), or None
    start_epoch: int
    history: list
    loss_fns: list
    loss_weights: list
    metric_groups: list              # [[fn, ...], ...]: one fn for every label, or one per label
    feature_cols: list
    label_cols: list
    input_shapes: Optional[list]
    label_shapes: Optional[list]
    sample_weight_col: Optional[str]
    batch_size: int
    val_batch_size: int
    epochs: int
    train_steps_per_epoch: Optional[int]
    validation_steps_per_epoch: Optional[int]
    train_rows: int
    val_rows: int
    shuffle: bool
    random_seed: Optional[int]
    verbose: int
    backward_passes_per_step: int
    compression: Any
    transformation_fn: Optional[Callable]
    train_minibatch_fn: Optional[Callable]
    data_module: Optional[type]
    inmemory_cache_all: bool
    use_gpu: bool
    store: Any                       # the store's remote view (paths, sync, file system)


def to_tensors(batch: dict, columns: list, shapes: Optional[list], device) -> list:
    """The ``columns`` of a batch as float tensors on ``device``, each reshaped to its shape in ``shapes``
    (``-1`` for the batch dimension) when given."""
    out = []
    for i, col in enumerate(columns):
        t = torch.as_tensor(np.asarray(batch[col])).float()
        if shapes and i < len(shapes) and shapes[i] is not None:
            t = t.reshape(list(shapes[i]))
        out.append(t.to(device))
    return out


def calculate_loss(outputs: list, labels: list, loss_weights: list, loss_fns: list, sample_weights=None):
    """The weighted sum of each output's loss; with ``sample_weights``, each loss is taken per row
    (``reduction="none"``), weighted and averaged."""
    total = 0.0
    for output, label, loss_fn, weight in zip(outputs, labels, loss_fns, loss_weights):
        if sample_weights is not None:
            loss = (loss_fn(output, label, reduction="none").flatten() * sample_weights).mean()
        else:
            loss = loss_fn(output, label)
        total = total + loss * weight
    return total


def _match_labels(outputs, labels, label_shapes):
    """Outputs as a list; labels reshaped to ``label_shapes`` or, where the sizes agree, to the outputs'."""
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    outputs = list(outputs)
    if label_shapes:
        labels = [label.reshape(list(shape)) for label, shape in zip(labels, label_shapes)]
    else:
        labels = [label.reshape(output.shape) if hasattr(output, "shape") and output.numel() == label.numel()
                  else label for label, output in zip(labels, outputs)]
    return outputs, labels


def _default_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights,
                       backward_passes_per_step, batch_idx):
    """One training pass, Horovod's protocol for ``train_minibatch_fn``: at the start of every group of
    ``backward_passes_per_step`` passes, step (but before the first) and zero the gradients; then forward and
    backward with the loss divided by the passes per step. The loop steps once more at the epoch's end."""
    if batch_idx % backward_passes_per_step == 0:
        if batch_idx != 0:
            optimizer.step()
        optimizer.zero_grad()
    outputs = model(*inputs)
    outputs, labels = transform_outputs(outputs, labels)
    loss = loss_fn(outputs, labels, sample_weights)
    (loss / backward_passes_per_step if backward_passes_per_step > 1 else loss).backward()
    return outputs, loss


class _Averages:
    """Sums of the loss and the metrics over an epoch's steps on this rank, averaged over steps and ranks at
    the end with one all-reduce (every rank makes the same calls)."""

    def __init__(self, label_cols: list, metric_groups: list):
        self.label_cols, self.metric_groups = label_cols, metric_groups
        self.loss = 0.0
        self.metrics = [[0.0] * len(label_cols) for _ in metric_groups]
        self.steps = 0

    def add(self, loss, outputs, labels) -> None:
        self.loss += float(loss.detach())
        for g, group in enumerate(self.metric_groups):
            fns = group if len(group) > 1 else list(group) * len(outputs)
            for i, (fn, out, lab) in enumerate(zip(fns, outputs, labels)):
                self.metrics[g][i] += float(torch.as_tensor(fn(out, lab)).detach().float().mean())
        self.steps += 1

    def result(self, stage: str) -> dict:
        flat = torch.tensor([self.loss] + [v for group in self.metrics for v in group], dtype=torch.float64)
        mean = hvd.allreduce(flat, op=hvd.Average, name=f"spark.torch.{stage}.metrics") / max(self.steps, 1)
        values = mean.tolist()
        groups, at = [], 1
        for g in range(len(self.metric_groups)):
            groups.append({f"group_{g}_{col}": values[at + i] for i, col in enumerate(self.label_cols)})
            at += len(self.label_cols)
        return {"loss": values[0], "all_metrics": groups}


class RemoteTrainer:
    """``trainer(spec)`` trains on this rank (see the module doc). Collective: every rank of the job calls it.

    Raises: what the model, the loss or the data raise (the job then fails naming the rank); RuntimeError when
    the ranks disagree on whether they train on a GPU.
    """

    def __call__(self, spec: TrainSpec):
        if spec.random_seed is not None:
            torch.manual_seed(spec.random_seed)
        hvd.init()
        cuda = bool(spec.use_gpu and torch.cuda.is_available())
        if len(set(hvd.allgather_object(cuda, name="spark.torch.device"))) != 1:
            raise RuntimeError("the ranks disagree on whether they have a GPU; give every executor one, or pass "
                               "use_gpu=False")
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
        model = spec.model.to(device)
        if spec.model_state is not None:
            model.load_state_dict(spec.model_state)
        optimizer = spec.optimizer_cls(model.parameters(), lr=1.0)
        state = _scaled_lr(spec.optimizer_state, hvd.size())
        optimizer.load_state_dict(state)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        kwargs = {"compression": spec.compression} if spec.compression is not None else {}
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             backward_passes_per_step=spec.backward_passes_per_step, **kwargs)
        return _Loop(spec, model, optimizer, device).run()


def _scaled_lr(optimizer_state: dict, factor: float) -> dict:
    state = {**optimizer_state, "param_groups": [dict(g) for g in optimizer_state["param_groups"]]}
    for group in state["param_groups"]:
        group["lr"] = group["lr"] * factor
    return state


class _Loop:
    def __init__(self, spec: TrainSpec, model, optimizer, device):
        self.spec, self.model, self.optimizer, self.device = spec, model, optimizer, device
        size = hvd.size()
        self.steps = spec.train_steps_per_epoch or max(1, spec.train_rows // spec.batch_size // size)
        has_val = spec.val_rows > 0
        self.val_steps = (spec.validation_steps_per_epoch or max(1, -(-spec.val_rows // spec.val_batch_size // size))) \
            if has_val else 0
        self.minibatch = spec.train_minibatch_fn or _default_minibatch

    def _batch(self, batch):
        s = self.spec
        inputs = to_tensors(batch, s.feature_cols, s.input_shapes, self.device)
        labels = to_tensors(batch, s.label_cols, None, self.device)
        weights = None
        if s.sample_weight_col:
            weights = torch.as_tensor(np.asarray(batch[s.sample_weight_col])).float().to(self.device)
        return inputs, labels, weights

    def _loss(self, outputs, labels, weights):
        return calculate_loss(outputs, labels, self.spec.loss_weights, self.spec.loss_fns, weights)

    def _transform(self, outputs, labels):
        return _match_labels(outputs, labels, self.spec.label_shapes)

    def _train_epoch(self, batches) -> dict:
        s, opt = self.spec, self.optimizer
        self.model.train()
        avg = _Averages(s.label_cols, s.metric_groups)
        for step in range(self.steps):
            inputs, labels, weights = self._batch(next(batches))
            outputs, loss = self.minibatch(self.model, opt, self._transform, self._loss, inputs, labels, weights,
                                           s.backward_passes_per_step, step)
            outputs, labels = self._transform(outputs, labels)
            avg.add(loss, outputs, labels)
        opt.step()
        return avg.result("train")

    def _validate(self, batches) -> dict:
        s = self.spec
        self.model.eval()
        avg = _Averages(s.label_cols, s.metric_groups)
        with torch.no_grad():
            for _ in range(self.val_steps):
                inputs, labels, weights = self._batch(next(batches))
                outputs, labels = self._transform(self.model(*inputs), labels)
                avg.add(self._loss(outputs, labels, weights), outputs, labels)
        return avg.result("val")

    def _checkpoint(self, epoch: int, history: list) -> bytes:
        """The state after ``epoch``, with the learning rate unscaled (as the user gave it)."""
        state = self.optimizer.state_dict()
        state = _scaled_lr(state, 1.0 / hvd.size())
        buf = io.BytesIO()
        torch.save({"model": {k: v.cpu() for k, v in self.model.state_dict().items()}, "optimizer": state,
                    "epoch": epoch, "history": list(history)}, buf)
        return buf.getvalue()

    def run(self):
        s = self.spec
        history = list(s.history)
        module = s.data_module or ParquetDataModule
        fields = s.feature_cols + s.label_cols + ([s.sample_weight_col] if s.sample_weight_col else [])
        if hvd.rank() == 0 and s.verbose:
            print(f"perseus.spark.torch: epochs {s.start_epoch}..{s.epochs - 1}, {s.train_rows} training rows, "
                  f"{self.steps} steps per epoch of {s.batch_size} rows on each of {hvd.size()} ranks"
                  + (f", {self.val_steps} validation steps" if self.val_steps else ""), flush=True)
        checkpoint = None
        with s.store.get_local_output_dir() as out_dir, \
                module(train_dir=s.store.train_data_path, val_dir=s.store.val_data_path,
                       num_train_epochs=s.epochs, has_val=self.val_steps > 0, train_batch_size=s.batch_size,
                       val_batch_size=s.val_batch_size, shuffle=s.shuffle, transform_fn=s.transformation_fn,
                       inmemory_cache_all=s.inmemory_cache_all, cur_shard=hvd.rank(), shard_count=hvd.size(),
                       schema_fields=fields, steps_per_epoch_train=self.steps, steps_per_epoch_val=self.val_steps,
                       verbose=s.verbose, random_seed=s.random_seed,
                       filesystem=s.store.filesystem(), label_cols=s.label_cols) as dm:
            train_batches = iter(dm.train_data())
            val_batches = iter(dm.val_data()) if self.val_steps else None
            for epoch in range(s.start_epoch, s.epochs):
                metrics = {"epoch": epoch, "train": self._train_epoch(train_batches)}
                if val_batches is not None:
                    metrics["validation"] = self._validate(val_batches)
                history.append(metrics)
                if hvd.rank() == 0:
                    if s.verbose:
                        print(f"perseus.spark.torch: {metrics}", flush=True)
                    checkpoint = self._checkpoint(epoch, history)
                    if s.store.saving_runs:
                        with open(os.path.join(out_dir, s.store.checkpoint_filename), "wb") as f:
                            f.write(checkpoint)
                        s.store.sync(out_dir)
        if hvd.rank() != 0:
            return None
        if checkpoint is None:  # nothing left to train: the checkpoint it resumed from is the result
            checkpoint = self._checkpoint(s.start_epoch - 1, history)
        return history, checkpoint
