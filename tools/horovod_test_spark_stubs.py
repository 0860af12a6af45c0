"""A pytest plugin for running Horovod's Spark estimator test files (``test/integration/test_spark_torch.py``,
``test_spark_keras.py``, ``test_spark_lightning.py``) on perseus (never commit Horovod's tests).

It installs the horovod alias and stands in for the Horovod internals their shared helper module
(``test/utils/spark_common.py``) imports at module level and perseus does not have: Horovod's secret-key helper,
its Spark driver and task services, two of its DBFS file helpers, and the private helpers of its Keras
estimator that ``test_spark_keras.py`` imports. The stand-ins raise NotImplementedError when used (only the
tests of Horovod's own internals use them); the secret key is a random one.

    PYTHONPATH=tools:HOROVOD/test/utils python -m pytest -p horovod_test_spark_stubs HOROVOD/test/integration/...
"""

import secrets
import sys
import types

import perseus.compat.horovod_alias  # noqa: F401 - horovod.* is perseus.*
from perseus.runner.common import util as _runner_util
from perseus.spark.common import util as _util
from perseus.spark.keras import util as _keras_util


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


class _Internal:
    """One of Horovod's internal Spark services: not in perseus."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is Horovod's internal Spark service; perseus has none")


def _internal_function(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"{name} is Horovod's internal helper; perseus has none")
    return refuse


# `from horovod.runner.common.util import secret` reads the attribute of the (perseus) package
_runner_util.secret = _module("horovod.runner.common.util.secret", make_secret_key=lambda: secrets.token_bytes(32))
_module("horovod.spark.driver.driver_service",
        SparkDriverService=type("SparkDriverService", (_Internal,), {}),
        SparkDriverClient=type("SparkDriverClient", (_Internal,), {}))
_module("horovod.spark.task.task_service",
        SparkTaskService=type("SparkTaskService", (_Internal,), {}),
        SparkTaskClient=type("SparkTaskClient", (_Internal,), {}))
for _module_, _names in ((_util, ("_wait_file_available_on_dbfs", "_get_spark_df_saved_file_list")),
                         # test_spark_keras.py imports these helpers of Horovod's Keras estimator at module level
                         (_keras_util, ("_custom_sparse_to_dense_fn", "_serialize_param_value"))):
    for _name in _names:
        if not hasattr(_module_, _name):
            setattr(_module_, _name, _internal_function(_name))  # (in this process only)
if not hasattr(_keras_util, "TFKerasUtil"):
    _keras_util.TFKerasUtil = type("TFKerasUtil", (_Internal,), {})
