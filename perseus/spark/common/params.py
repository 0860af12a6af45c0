"""The Spark ML parameters of the estimators and their models, with Horovod's names, defaults and accessors.

Every parameter is a ``pyspark.ml.param.Param`` on the class; its ``getX``/``setX`` methods are made from one
table (:data:`ESTIMATOR_PARAMS`), so a name, its default and its accessors cannot drift apart. The accessor
names are Horovod's, including its irregular ones (``getShufflingBufferSize``, ``getTrainReaderNumWorker``,
``setLabelColoumns``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pyspark import keyword_only
from pyspark.ml.param import Param, Params, TypeConverters

__all__ = ["EstimatorParams", "ModelParams", "ESTIMATOR_PARAMS", "declare"]


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def declare(cls, table) -> None:
    """Give ``cls`` a Param and ``getX``/``setX`` for each ``(name, doc, default, converter, accessor)`` row of
    ``table`` (``accessor``: the name after get/set when it is not the camel-cased name; the default goes to
    ``cls._declared_defaults``, which ``__init__`` sets)."""
    defaults = dict(getattr(cls, "_declared_defaults", {}))
    for name, doc, default, converter, accessor in table:
        param = Param(Params._dummy(), name, doc, **({"typeConverter": converter} if converter else {}))
        setattr(cls, name, param)
        suffix = accessor or _camel(name)
        setattr(cls, f"get{suffix}", _getter(name))
        setattr(cls, f"set{suffix}", _setter(name))
        defaults[name] = default
    cls._declared_defaults = defaults


def _getter(name: str) -> Callable[[Any], Any]:
    def get(self):
        return self.getOrDefault(getattr(self, name))
    get.__doc__ = f"The value of ``{name}``."
    return get


def _setter(name: str) -> Callable[[Any, Any], Any]:
    def set_(self, value):
        return self._set(**{name: value})
    set_.__doc__ = f"Set ``{name}``; returns this object."
    return set_


_int = TypeConverters.toInt
_bool = TypeConverters.toBoolean
_str = TypeConverters.toString
_strs = TypeConverters.toListString

#: ``(name, doc, default, converter, accessor)`` of every parameter the estimators share (Horovod's).
ESTIMATOR_PARAMS = [
    ("num_proc", "number of processes (default: a SparkBackend with spark.default.parallelism)", None, None, None),
    ("model", "the model to train", None, None, None),
    ("backend", "the Backend that runs the training function (default: SparkBackend(num_proc))", None, None, None),
    ("store", "the Store holding the prepared data, checkpoints and logs", None, None, None),
    ("optimizer", "the optimizer (wrapped in a DistributedOptimizer on every rank)", None, None, None),
    ("loss", "the loss, or one per label column", None, None, None),
    ("loss_weights", "weights of the labels' losses (default: equal)", None, None, None),
    ("sample_weight_col", "the column holding each row's weight", None, None, None),
    ("metrics", "metric functions: one list for every label, or one per label", [], None, None),
    ("feature_cols", "the feature columns, in the order the model takes them", None, _strs, None),
    ("label_cols", "the label columns, one per model output", None, _strs, None),
    ("continuous_cols", "continuous feature columns (NVTabular data modules)", None, _strs, None),
    ("categorical_cols", "categorical feature columns (NVTabular data modules)", None, _strs, None),
    ("validation", "a fraction of the rows drawn for validation, or a column marking them", None, None, None),
    ("callbacks", "framework callbacks", [], None, None),
    ("batch_size", "rows per training batch and rank", 32, _int, None),
    ("val_batch_size", "rows per validation batch and rank (default: batch_size)", None, None, None),
    ("epochs", "training epochs", 1, _int, None),
    ("train_steps_per_epoch", "training batches per epoch and rank (default: the rows divided by the batch size "
     "and the ranks)", None, None, None),
    ("validation_steps_per_epoch", "validation batches per epoch and rank (default: all the rows)", None, None,
     None),
    ("random_seed", "the seed of the model's initialisation and of shuffling", None, None, None),
    ("shuffle_buffer_size", "rows held to shuffle (deprecated in Horovod: use shuffle)", None, None,
     "ShufflingBufferSize"),
    ("shuffle", "whether to shuffle the training rows each epoch", True, _bool, None),
    ("verbose", "0: silent; 1: progress; 2: more", 1, _int, None),
    ("partitions_per_process", "Parquet partitions written per rank", 10, _int, None),
    ("run_id", "the run's name in the store (default: the framework and the time)", None, None, None),
    ("gradient_compression", "the compression of the DistributedOptimizer", None, None, None),
    ("compress_sparse_cols", "keep sparse vector columns compressed in the prepared data", False, _bool, None),
    ("transformation_fn", "a function applied to every batch before the step", None, None, None),
    ("transformation_edit_fields", "fields the transformation adds or changes", None, None, None),
    ("transformation_removed_fields", "fields the transformation removes", None, None, None),
    ("train_reader_num_workers", "reader threads for the training data", 2, _int, "TrainReaderNumWorker"),
    ("val_reader_num_workers", "reader threads for the validation data", 2, _int, "ValReaderNumWorker"),
    ("reader_pool_type", "the reader's pool: thread, process or dummy", "thread", _str, None),
    ("label_shapes", "the shape of each label column", None, None, None),
    ("inmemory_cache_all", "keep every rank's share of the data in memory after the first epoch", False, _bool,
     "InMemoryCacheAll"),
    ("use_gpu", "train on the GPU when one is visible", True, _bool, None),
    ("mp_start_method", "the multiprocessing start method of the ranks", None, None, None),
    ("backward_passes_per_step", "backward passes summed locally before each reduction", 1, _int, None),
    ("tensorflow_dataset_prefetch_buffer_size", "batches tf.data prefetches (Keras)", 0, _int, None),
]


class _Declared(Params):
    """Params whose defaults come from the class's declared table (:func:`declare`)."""

    _declared_defaults: dict = {}

    def __init__(self):
        super().__init__()
        self._setDefault(**type(self)._declared_defaults)

    @keyword_only
    def setParams(self, **kwargs):
        """Set several parameters by name; returns this object."""
        return self._set(**kwargs)


class EstimatorParams(_Declared):
    """The parameters every estimator has (Horovod's ``EstimatorParams``)."""

    def _check_params(self, metadata: dict) -> None:
        """The checks made before training: a model, and every feature and label column in the prepared data.

        Raises:
            ValueError: no model, or columns missing from ``metadata`` (named).
        """
        if not self.getModel():
            raise ValueError("the model parameter is required: pass model= to the estimator")
        for what, columns in (("feature", self.getFeatureCols()), ("label", self.getLabelCols())):
            missing = [c for c in columns or [] if c not in metadata]
            if missing:
                raise ValueError(f"{what} columns {missing} are not in the prepared data (its columns: "
                                 f"{sorted(metadata)})")


declare(EstimatorParams, ESTIMATOR_PARAMS)


class ModelParams(_Declared):
    """The parameters every trained model has (Horovod's ``ModelParams``): its history, model, columns, run and
    the prepared data's metadata; ``outputCols`` names the prediction columns."""

    outputCols = Param(Params._dummy(), "outputCols", "output column names", typeConverter=_strs)

    def setOutputCols(self, value):
        """The prediction columns (default ``<label>__output``); returns this object."""
        return self._set(outputCols=value)

    def getOutputCols(self):
        return self.getOrDefault(self.outputCols)

    def setLabelColoumns(self, value):
        """Horovod's spelling of :meth:`setLabelColumns`."""
        return self.setLabelColumns(value)

    def _get_metadata(self) -> Optional[dict]:
        return self.getOrDefault(self._metadata)


declare(ModelParams, [
    ("history", "the metrics of every epoch", None, None, None),
    ("model", "the trained model", None, None, None),
    ("feature_columns", "the feature columns", None, None, None),
    ("label_columns", "the label columns", None, None, None),
    ("run_id", "the run that trained the model", None, None, None),
    ("_metadata", "the prepared data's column metadata", None, None, "Metadata"),
])
