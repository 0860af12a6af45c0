"""Process sets (``horovod.common.process_sets``): the same module as :mod:`perseus.runtime.process_sets`, at the
path ``perseus.common.process_sets``."""

import sys

from perseus.runtime import process_sets as _module

sys.modules[__name__] = _module
