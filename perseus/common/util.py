"""Horovod's helpers (``horovod.common.util``): the same module as :mod:`perseus.base.util`, at the path
``perseus.common.util``."""

import sys

from perseus.base import util as _module

sys.modules[__name__] = _module
