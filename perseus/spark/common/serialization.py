"""Spark ML persistence of the estimators and their models: ``write().save(path)`` and ``Class.load(path)``.

The metadata is Spark ML's own (``DefaultParamsWriter``'s layout: ``<path>/metadata``, one JSON line), so Spark's
``Pipeline`` and ``PipelineModel`` save and load them like any stage. Values JSON cannot hold (the model, the
optimizer, loss functions, callbacks, the metadata's types) are stored as base64 of their cloudpickle, tagged so
the reader knows them; ``store`` and ``backend`` are not saved (they name a place and a cluster of this run; set
them again after loading), as in Horovod.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from pyspark.ml.util import DefaultParamsReader, MLReadable, MLReader, MLWritable, MLWriter

__all__ = ["PerseusParamsWritable", "PerseusParamsReadable", "encode_value", "decode_value", "encode_param"]

_TAG = "__perseus_cloudpickle_base64__"
_NOT_SAVED = ("store", "backend")


def encode_value(value: Any) -> Any:
    """``value`` as JSON can hold it: itself when it is plain JSON, else its cloudpickle in base64 (tagged)."""
    import cloudpickle

    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return {_TAG: base64.b64encode(cloudpickle.dumps(value)).decode("ascii")}


def encode_param(name: str, value: Any) -> Any:
    """A parameter's value as the saved metadata holds it: None for None and for ``store`` and ``backend`` (not
    saved), else :func:`encode_value`."""
    if value is None or name in _NOT_SAVED:
        return None
    return encode_value(value)


def decode_value(value: Any) -> Any:
    """The inverse of :func:`encode_value`."""
    if isinstance(value, dict) and set(value) == {_TAG}:
        import cloudpickle

        return cloudpickle.loads(base64.b64decode(value[_TAG]))
    return value


class _Writer(MLWriter):
    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        """Write the metadata line to ``<path>/metadata`` with Spark (any file system Spark writes to)."""
        inst = self.instance

        def values(param_map):
            return {p.name: inst._encode_param(p.name, v) for p, v in param_map.items()}

        metadata = {"class": f"{type(inst).__module__}.{type(inst).__name__}",
                    "timestamp": int(round(time.time() * 1000)), "sparkVersion": self.sc.version, "uid": inst.uid,
                    "paramMap": values(inst._paramMap), "defaultParamMap": values(inst._defaultParamMap)}
        self.sc.parallelize([json.dumps(metadata, separators=(",", ":"))], 1).saveAsTextFile(f"{path}/metadata")


class _Reader(MLReader):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        """The instance saved at ``path``, of the class it was saved as (which must be importable here)."""
        metadata = DefaultParamsReader.loadMetadata(path, self.sc)
        instance = self.cls()
        instance._resetUid(metadata["uid"])
        for key in ("paramMap", "defaultParamMap"):
            decoded = self.cls._decode_params(metadata[key])
            for name, value in decoded.items():
                if instance.hasParam(name):
                    param = instance.getParam(name)
                    if key == "paramMap":
                        instance._set(**{name: value})
                    else:
                        instance._setDefault(**{param.name: value})
        return instance


class PerseusParamsWritable(MLWritable):
    """``write()`` gives the writer of this estimator or model."""

    def write(self) -> MLWriter:
        return _Writer(self)

    def _encode_param(self, name: str, value: Any) -> Any:
        """How the value of parameter ``name`` is written (:func:`encode_param`); a class whose values need
        another format (a framework's own saving format) overrides it."""
        return encode_param(name, value)


class PerseusParamsReadable(MLReadable):
    """``Class.read().load(path)`` and ``Class.load(path)``."""

    @classmethod
    def read(cls) -> MLReader:
        return _Reader(cls)

    @classmethod
    def _decode_params(cls, values: dict) -> dict:
        """The parameter values of one saved map (``{name: written value}``), decoded; the inverse of
        ``_encode_param``, given the whole map so that one value may depend on another."""
        return {name: decode_value(v) for name, v in values.items()}
