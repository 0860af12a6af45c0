"""A plain ``torch.nn.Module`` with an optimizer and a loss, trained by the Lightning estimator (Horovod's
``horovod.spark.lightning.legacy``).

Horovod's Lightning estimator also takes a model that is not a LightningModule, with ``optimizer``, ``loss``
(or ``loss_constructors``), ``loss_weights`` and ``sample_weight_col``, as the PyTorch estimator does;
:func:`to_lightning_module` wraps it in a LightningModule that the ranks train like any other. Its training and
validation steps call the model with the feature columns in order (each a float tensor reshaped to its
``input_shapes`` entry when given), reshape each label to its output's shape when their sizes agree (or to
``label_shapes``), and take the weighted sum of the losses (with ``sample_weight_col``: each loss taken per row
with ``reduction="none"``, weighted and averaged). They log ``train_loss`` and ``val_loss``, averaged over the
epoch and the ranks. The optimizer is made again on each rank over the model's parameters, with the
optimizer's parameter groups and state.
"""

from __future__ import annotations

from typing import Optional

import pytorch_lightning as pl
import torch

from perseus.spark.common.util import to_list
from perseus.spark.torch.remote import calculate_loss

__all__ = ["to_lightning_module", "TorchModuleAdapter", "unwrap"]


class TorchModuleAdapter(pl.LightningModule):
    """The LightningModule :func:`to_lightning_module` makes; ``module`` is the model it trains (its
    ``state_dict`` keys have the prefix ``_model.``)."""

    def __init__(self, model, optimizer_cls, optimizer_groups, optimizer_state, loss_fns, loss_weights,
                 feature_cols, label_cols, sample_weight_col=None, input_shapes=None, label_shapes=None):
        super().__init__()
        self._model = model
        self._optimizer_cls, self._optimizer_groups = optimizer_cls, optimizer_groups
        self._optimizer_state = optimizer_state
        self._loss_fns, self._loss_weights = loss_fns, loss_weights
        self._feature_cols, self._label_cols = list(feature_cols), list(label_cols)
        self._sample_weight_col = sample_weight_col
        self._input_shapes, self._label_shapes = input_shapes, label_shapes

    @property
    def module(self) -> torch.nn.Module:
        return self._model

    def forward(self, *args, **kwargs):
        return self._model(*args, **kwargs)

    def configure_optimizers(self):
        params = list(self._model.parameters())
        groups = [{"params": [params[i] for i in indices]} for indices in self._optimizer_groups]
        optimizer = self._optimizer_cls(groups, lr=1.0)
        optimizer.load_state_dict(self._optimizer_state)
        return optimizer

    def _inputs(self, batch) -> list:
        out = []
        for i, col in enumerate(self._feature_cols):
            t = batch[col].float()
            if self._input_shapes and i < len(self._input_shapes) and self._input_shapes[i] is not None:
                t = t.reshape(list(self._input_shapes[i]))
            out.append(t)
        return out

    def _loss(self, batch):
        outputs = self(*self._inputs(batch))
        outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        labels = [batch[col].float() for col in self._label_cols]
        if self._label_shapes:
            labels = [label.reshape(list(shape)) for label, shape in zip(labels, self._label_shapes)]
        else:
            labels = [label.reshape(out.shape) if hasattr(out, "shape") and out.numel() == label.numel() else label
                      for label, out in zip(labels, outputs)]
        weights = batch[self._sample_weight_col].float() if self._sample_weight_col else None
        return calculate_loss(outputs, labels, self._loss_weights, self._loss_fns, weights)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss


def to_lightning_module(model, optimizer, loss_fns, loss_weights, feature_cols, label_cols, sample_weights_col=None,
                        validation=None, input_shapes=None, label_shapes=None) -> TorchModuleAdapter:
    """``model`` (a ``torch.nn.Module``) with ``optimizer`` (over its parameters) and ``loss_fns`` (one loss, or
    one per label column) as a LightningModule (see the module doc). ``loss_weights`` default to equal weights
    summing to 1. ``validation`` is Horovod's argument, accepted: the validation step always exists.

    Raises:
        ValueError: the optimizer holds a parameter that is not the model's, or ``loss_fns``/``loss_weights`` do
            not match the label columns.
    """
    labels = list(label_cols)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in index]
        if missing:
            raise ValueError("the optimizer holds parameters that are not the model's: make it with "
                             "optimizer_class(model.parameters(), ...)")
        groups.append([index[id(p)] for p in group["params"]])
    loss_fns = to_list(loss_fns, len(labels))
    weights = list(loss_weights) if loss_weights else [1.0 / len(labels)] * len(labels)
    if len(weights) != len(labels):
        raise ValueError(f"loss_weights has {len(weights)} values for {len(labels)} label columns")
    return TorchModuleAdapter(model, type(optimizer), groups, optimizer.state_dict(), loss_fns, weights,
                              feature_cols, labels, sample_weight_col=sample_weights_col,
                              input_shapes=input_shapes, label_shapes=label_shapes)


def unwrap(model) -> Optional[torch.nn.Module]:
    """The plain module inside a :class:`TorchModuleAdapter`, else None."""
    return model.module if isinstance(model, TorchModuleAdapter) else None
