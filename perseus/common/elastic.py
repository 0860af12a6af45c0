"""Horovod's ``horovod.common.elastic`` path (``State``, ``ObjectState``, ``run_fn``, ...): the same module as
:mod:`perseus.elastic.state`, at the path ``perseus.common.elastic``."""

import sys

from perseus.elastic import state as _module

sys.modules[__name__] = _module
