"""The training function a Lightning :class:`~perseus.spark.lightning.TorchEstimator` runs on every rank.

Each rank: the multiprocessing start method (``mp_start_method``) and Lightning's seed (``random_seed``) set,
``hvd.init()``, a device (its GPU when every rank has one and ``use_gpu``, else the CPU), then a Lightning
``Trainer`` with :class:`~perseus.spark.lightning.strategy.PerseusStrategy` over this rank's share of the data
(the data module, default :class:`~perseus.spark.lightning.datamodule.ParquetDataModule`, made with Horovod's
keyword arguments; every rank runs the same number of batches per epoch). The Trainer gets Horovod's settings:
``max_epochs=epochs``, the callbacks, the logger (default: Lightning's ``CSVLogger`` in the run's ``logs/``),
``log_every_n_steps``, ``profiler``, no sanity validation steps, no validation without validation data, and
``trainer_args`` on top.

After every training epoch (validation included) the Trainer saves a Lightning checkpoint (rank 0 writes it)
as ``<checkpoint_filename>.ckpt`` in the run's local directory, which rank 0 copies into the store's run
directory; a ``ModelCheckpoint`` among the callbacks writes there too. A run given a checkpoint resumes from it
(``Trainer.fit(ckpt_path=...)``: weights, optimizer and scheduler state, epoch and callbacks' state). Rank 0
returns the bytes of ``torch.save({"model": state_dict, "history": {metric: float}})``: the weights of the best
``ModelCheckpoint`` checkpoint when a ModelCheckpoint callback has one, else the final weights (a plain module's
own, for a model made by :func:`~perseus.spark.lightning.legacy.to_lightning_module`); the history is the
Trainer's ``logged_metrics`` at the end (its ``callback_metrics`` without a logger; the checkpoint's when nothing
was left to train). The other ranks return None.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import multiprocessing
import os
import tempfile
import warnings
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Checkpoint, ModelCheckpoint, ProgressBar, TQDMProgressBar
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.profilers import PassThroughProfiler
from pytorch_lightning.utilities.warnings import PossibleUserWarning

import perseus.torch as hvd
from perseus.spark.lightning.datamodule import ParquetDataModule
from perseus.spark.lightning.hooks import RemovedCallbackHooks, adapt_module
from perseus.spark.lightning.legacy import unwrap
from perseus.spark.lightning.strategy import PerseusStrategy, set_rank_zero

__all__ = ["TrainSpec", "RemoteTrainer", "EpochCheckpoint", "steps_per_epoch", "OWNED_TRAINER_ARGS"]

#: Trainer arguments the estimator sets and ``trainer_args`` may not (one process and device per rank)
OWNED_TRAINER_ARGS = ("strategy", "accelerator", "devices", "num_nodes")


@dataclasses.dataclass
class TrainSpec:
    """Everything a rank needs, picklable (made by the estimator on the driver)."""

    model: Any                          # the LightningModule (pickled whole, with its class)
    feature_cols: list
    label_cols: list
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
    callbacks: list
    logger: Any
    log_every_n_steps: int
    profiler: Any
    trainer_args: dict
    terminate_on_nan: bool
    data_module: Optional[type]
    data_module_args: dict              # Horovod's reader settings, passed on to the data module
    compression: Any
    use_gpu: bool
    num_gpus: Optional[int]
    mp_start_method: Optional[str]
    resume_from: Optional[str]          # the store path of the checkpoint to resume from
    store: Any = None                   # the store's remote view (paths, sync, file system)


def steps_per_epoch(rows: int, batch_size: int, size: int, ceil: bool = False) -> int:
    """Batches per epoch and rank: the rows over the batch size and the ranks, at least 1 (rounded down for
    training, up for validation, as the PyTorch estimator does)."""
    if ceil:
        batches = -(-rows // batch_size)
        return max(1, -(-batches // size))
    return max(1, rows // batch_size // size)


def _floats(metrics: dict) -> dict:
    out = {}
    for name, value in metrics.items():
        try:
            out[name] = float(value)
        except (TypeError, ValueError):  # a metric that is not one number (a vector): kept as a list
            out[name] = torch.as_tensor(value).detach().cpu().tolist()
    return out


class EpochCheckpoint(Checkpoint):
    """After every training epoch: the Trainer's checkpoint at ``path`` (every rank calls ``save_checkpoint``;
    rank 0 writes), then on rank 0 ``sync(directory)``. Its state (saved in the checkpoint) is the history so
    far, so that a run resumed after its last epoch still has one."""

    def __init__(self, path: str, sync=None):
        self.path, self.sync = path, sync
        self.history: dict = {}

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.history = _floats(trainer.logged_metrics)
        trainer.save_checkpoint(self.path, weights_only=False)
        if self.sync is not None and trainer.is_global_zero:
            self.sync(os.path.dirname(self.path))

    def state_dict(self) -> dict:
        return {"history": dict(self.history)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = dict(state_dict.get("history", {}))


class _TerminateOnNan(pl.Callback):
    """Lightning 1.x's ``terminate_on_nan``: a ValueError when a training step's loss or a parameter is NaN or
    infinite."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all():
            raise ValueError(f"terminate_on_nan: the loss of batch {batch_idx} (epoch {trainer.current_epoch}) on "
                             f"rank {trainer.global_rank} is {loss.item()}")
        for name, p in pl_module.named_parameters():
            if not torch.isfinite(p).all():
                raise ValueError(f"terminate_on_nan: parameter {name!r} holds NaN or infinite values after batch "
                                 f"{batch_idx} (epoch {trainer.current_epoch})")


def _device(spec: TrainSpec) -> torch.device:
    """This rank's device; the same kind on every rank. Collective.

    Raises:
        RuntimeError: some ranks have a GPU and others not.
    """
    cuda = bool(spec.use_gpu and spec.num_gpus != 0 and torch.cuda.is_available())
    if len(set(hvd.allgather_object(cuda, name="spark.lightning.device"))) != 1:
        raise RuntimeError("the ranks disagree on whether they have a GPU; give every executor one, or pass "
                           "use_gpu=False")
    if not cuda:
        return torch.device("cpu")
    index = hvd.local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _quiet() -> None:
    """verbose=0: Lightning's information messages and possible-mistake warnings off on this rank."""
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=PossibleUserWarning)


class RemoteTrainer:
    """``trainer(spec)`` trains on this rank (see the module doc). Collective: every rank of the job calls it.

    Raises: what the model, its hooks, the callbacks or the data raise (the job then fails naming the rank);
    RuntimeError when the ranks disagree on whether they train on a GPU; ValueError from ``terminate_on_nan``.
    """

    def __call__(self, spec: TrainSpec):
        if spec.mp_start_method:
            multiprocessing.set_start_method(spec.mp_start_method, force=True)
        if spec.random_seed is not None:
            pl.seed_everything(spec.random_seed, verbose=False)
        hvd.init()
        set_rank_zero(hvd.rank())
        if not spec.verbose:
            _quiet()
        device = _device(spec)
        size = hvd.size()
        steps = spec.train_steps_per_epoch or steps_per_epoch(spec.train_rows, spec.batch_size, size)
        val_steps = (spec.validation_steps_per_epoch
                     or steps_per_epoch(spec.val_rows, spec.val_batch_size, size, ceil=True)) if spec.val_rows else 0
        if hvd.rank() == 0 and spec.verbose:
            print(f"perseus.spark.lightning: pytorch_lightning {pl.__version__}, {spec.epochs} epochs, "
                  f"{spec.train_rows} training rows, {steps} steps per epoch of {spec.batch_size} rows on each of "
                  f"{size} ranks" + (f", {val_steps} validation steps" if val_steps else "")
                  + (f"; resuming from {spec.resume_from}" if spec.resume_from else ""), flush=True)
        store = spec.store
        with store.get_local_output_dir() as out_dir, tempfile.TemporaryDirectory(prefix="perseus-ckpt-") as tmp:
            resume = self._fetch(spec, tmp)
            return _Run(spec, device, steps, val_steps, out_dir).fit(resume)

    @staticmethod
    def _fetch(spec: TrainSpec, tmp: str) -> Optional[str]:
        """The checkpoint to resume from, copied from the store into ``tmp`` (every rank reads it)."""
        if not spec.resume_from:
            return None
        local = os.path.join(tmp, "resume.ckpt")
        spec.store.filesystem().get_file(spec.store.get_localized_path(spec.resume_from), local)
        return local


class _Run:
    """One rank's Trainer, callbacks and data module."""

    def __init__(self, spec: TrainSpec, device, steps: int, val_steps: int, out_dir: str):
        self.spec, self.device, self.steps, self.val_steps, self.out_dir = spec, device, steps, val_steps, out_dir
        self.logs_path = os.path.join(out_dir, spec.store.logs_subdir)
        os.makedirs(self.logs_path, exist_ok=True)
        sync = spec.store.sync if spec.store.saving_runs else None
        self.sync = sync if hvd.rank() == 0 else None
        self.epoch_checkpoint = EpochCheckpoint(os.path.join(out_dir, f"{spec.store.checkpoint_filename}.ckpt"),
                                                sync=self.sync)

    def _callbacks(self, model) -> tuple:
        spec = self.spec
        user = list(spec.callbacks or [])
        for cb in user:
            if isinstance(cb, ModelCheckpoint):  # its checkpoints go to the run's directory (and the store)
                cb.dirpath = self.out_dir
        first = [c for c in [adapt_module(model)] if c is not None]
        removed = RemovedCallbackHooks(user) if RemovedCallbackHooks.needed(user) else None
        extra = [removed] if removed is not None else []
        if spec.terminate_on_nan:
            extra.append(_TerminateOnNan())
        return first + user + extra + [self.epoch_checkpoint], removed

    def _trainer_args(self, callbacks: list) -> dict:
        spec, cuda = self.spec, self.device.type == "cuda"
        logger = spec.logger if spec.logger is not None else CSVLogger(self.logs_path, name="lightning_logs")
        args = dict(strategy=PerseusStrategy(self.device, compression=spec.compression),
                    accelerator="gpu" if cuda else "cpu", devices=[self.device.index] if cuda else 1, num_nodes=1,
                    max_epochs=spec.epochs, callbacks=callbacks, logger=logger,
                    log_every_n_steps=spec.log_every_n_steps, num_sanity_val_steps=0, profiler=spec.profiler,
                    default_root_dir=self.out_dir, enable_checkpointing=True,
                    enable_model_summary=bool(spec.verbose))
        if not self.val_steps:
            args["limit_val_batches"] = 0
        extra = dict(spec.trainer_args or {})
        if "callbacks" in extra:  # added to the run's own (whose checkpoint a resumed run needs)
            args["callbacks"] = callbacks + list(extra.pop("callbacks") or [])
        if extra.get("enable_checkpointing") is False:  # no checkpoint: the run cannot be resumed
            args["callbacks"] = [cb for cb in args["callbacks"] if cb is not self.epoch_checkpoint]
        args.update(extra)
        has_bar = any(isinstance(cb, ProgressBar) for cb in args["callbacks"])
        if not spec.verbose and not has_bar:
            args.setdefault("enable_progress_bar", False)
        elif args.get("enable_progress_bar", True) and not has_bar:  # once per epoch, as Horovod's
            args["callbacks"] = list(args["callbacks"]) + [TQDMProgressBar(refresh_rate=max(1, self.steps))]
        return args

    def _data_module(self):
        spec, store = self.spec, self.spec.store
        fields = spec.feature_cols + spec.label_cols + ([spec.sample_weight_col] if spec.sample_weight_col else [])
        kwargs = dict(train_dir=store.train_data_path, val_dir=store.val_data_path, num_train_epochs=spec.epochs,
                      has_val=self.val_steps > 0, train_batch_size=spec.batch_size,
                      val_batch_size=spec.val_batch_size, shuffle=spec.shuffle, cur_shard=hvd.rank(),
                      shard_count=hvd.size(), schema_fields=fields, storage_options=store.storage_options,
                      steps_per_epoch_train=self.steps, steps_per_epoch_val=self.val_steps,
                      verbose=bool(spec.verbose), seed=spec.random_seed, **spec.data_module_args)
        module = spec.data_module or ParquetDataModule
        if issubclass(module, ParquetDataModule):
            kwargs["filesystem"] = store.filesystem()
        return module(**kwargs)

    def fit(self, resume: Optional[str]):
        spec = self.spec
        model = spec.model
        callbacks, removed = self._callbacks(model)
        trainer = pl.Trainer(**self._trainer_args(callbacks))
        if removed is not None:
            removed.trainer_made(trainer)
        if trainer.profiler is not None and not isinstance(trainer.profiler, PassThroughProfiler) \
                and spec.profiler != "simple":
            trainer.profiler.dirpath, trainer.profiler.filename = self.logs_path, "profile"
        trainer.fit(model, datamodule=self._data_module(), ckpt_path=resume)
        if self.sync is not None:
            self.sync(self.out_dir)  # the logs, the profile and the last checkpoints
        if hvd.rank() != 0:
            return None
        return self._result(trainer, model)

    def _result(self, trainer, model) -> bytes:
        best = [cb.best_model_path for cb in trainer.callbacks
                if isinstance(cb, ModelCheckpoint) and getattr(cb, "best_model_path", "")]
        if best and os.path.isfile(best[0]):
            if self.spec.verbose:
                print(f"perseus.spark.lightning: returning the best checkpoint {best[0]}", flush=True)
            state = torch.load(best[0], map_location="cpu", weights_only=False)["state_dict"]
            model.load_state_dict(state)
        module = unwrap(model) or model
        history = (_floats(trainer.logged_metrics) or _floats(trainer.callback_metrics)  # (no logger: none logged)
                   or dict(self.epoch_checkpoint.history))
        buf = io.BytesIO()
        torch.save({"model": {k: v.detach().cpu() for k, v in module.state_dict().items()}, "history": history}, buf)
        return buf.getvalue()

