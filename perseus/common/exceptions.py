"""Exceptions raised by perseus, with Horovod's names: the same module as :mod:`perseus.base.exceptions`, at the
path ``perseus.common.exceptions``."""

import sys

from perseus.base import exceptions as _module

sys.modules[__name__] = _module
