"""Lightning 1.x hooks that Lightning 2 removed, kept working on the Lightning estimator's ranks.

Horovod's Lightning estimator ran on Lightning 1.x, and models and callbacks written for it use hooks Lightning
2.0 removed: a LightningModule's ``training_epoch_end(outputs)`` and ``validation_epoch_end(outputs)`` (Lightning
2 refuses such a model), and a Callback's ``on_init_start``, ``on_init_end``, ``on_epoch_start``,
``on_epoch_end``, ``on_batch_start`` and ``on_batch_end`` (Lightning 2 never calls them). On a rank,
:func:`adapt_module` and :class:`RemovedCallbackHooks` call them where Lightning 1.x did:

- ``training_epoch_end(outputs)`` after the training epoch, with the list of ``training_step`` results
  (``{"loss": tensor, ...}`` each, detached); ``validation_epoch_end(outputs)`` after each validation epoch, with
  the ``validation_step`` results that were not None. Both run before the callbacks' ``on_*_epoch_end``.
- ``on_epoch_start``/``on_epoch_end`` at the start and end of every training and validation epoch (after the
  callbacks' own ``on_train_epoch_end``/``on_validation_epoch_end``), ``on_batch_start``/``on_batch_end``
  around every training batch, ``on_init_start`` and ``on_init_end`` once the Trainer is made.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from pytorch_lightning import Callback

__all__ = ["adapt_module", "RemovedCallbackHooks", "REMOVED_MODULE_HOOKS", "REMOVED_CALLBACK_HOOKS"]

REMOVED_MODULE_HOOKS = ("training_epoch_end", "validation_epoch_end")
REMOVED_CALLBACK_HOOKS = ("on_init_start", "on_init_end", "on_epoch_start", "on_epoch_end", "on_batch_start",
                          "on_batch_end")


def _detached(outputs):
    return apply_to_collection(outputs, torch.Tensor, lambda t: t.detach())


class _EpochEndOutputs(Callback):
    """Collects the step results of an epoch and hands them to the model's removed ``*_epoch_end`` hook."""

    def __init__(self, hooks: dict):
        self.hooks = hooks
        self.train: list = []
        self.val: list = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.train = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if "training_epoch_end" in self.hooks and outputs is not None:
            self.train.append(_detached(outputs))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if "training_epoch_end" in self.hooks:
            outputs, self.train = self.train, []
            self.hooks["training_epoch_end"](outputs)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self.val = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if "validation_epoch_end" in self.hooks and outputs is not None:
            self.val.append(_detached(outputs))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if "validation_epoch_end" in self.hooks:
            outputs, self.val = self.val, []
            self.hooks["validation_epoch_end"](outputs)


def adapt_module(model) -> Optional[Callback]:
    """Make ``model`` acceptable to Lightning 2 when it defines ``training_epoch_end`` or
    ``validation_epoch_end``: the hooks are hidden from Lightning (the model's class becomes a subclass of the
    same name where they are None; the model's weights and methods are untouched) and a callback is returned that
    calls them (see the module doc). Returns None, and changes nothing, when the model defines neither.

    Call it on the rank's own copy of the model, before the Trainer sees it; put the callback first in the
    Trainer's callbacks.
    """
    hooks: dict[str, Callable] = {}
    for name in REMOVED_MODULE_HOOKS:
        fn = getattr(model, name, None)
        if callable(fn):
            hooks[name] = fn
            model.__dict__.pop(name, None)
    if not hooks:
        return None
    cls = type(model)
    hidden = {name: None for name in hooks}
    model.__class__ = type(cls.__name__, (cls,), {**hidden, "__module__": cls.__module__})
    return _EpochEndOutputs(hooks)


class RemovedCallbackHooks(Callback):
    """Calls the removed Lightning 1.x hooks of ``callbacks`` (see the module doc). Put it after them in the
    Trainer's callbacks; call :meth:`trainer_made` once the Trainer exists."""

    def __init__(self, callbacks: list):
        self.targets = {hook: [cb for cb in callbacks if callable(getattr(cb, hook, None))]
                        for hook in REMOVED_CALLBACK_HOOKS}

    @staticmethod
    def needed(callbacks: list) -> bool:
        """Whether any of ``callbacks`` defines a removed hook."""
        return any(callable(getattr(cb, hook, None)) for cb in callbacks for hook in REMOVED_CALLBACK_HOOKS)

    def _call(self, hook: str, *args) -> None:
        for cb in self.targets[hook]:
            getattr(cb, hook)(*args)

    def trainer_made(self, trainer) -> None:
        """``on_init_start(trainer)`` and ``on_init_end(trainer)`` of the callbacks that define them."""
        self._call("on_init_start", trainer)
        self._call("on_init_end", trainer)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._call("on_epoch_start", trainer, pl_module)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._call("on_epoch_start", trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._call("on_epoch_end", trainer, pl_module)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self._call("on_epoch_end", trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._call("on_batch_start", trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._call("on_batch_end", trainer, pl_module)
