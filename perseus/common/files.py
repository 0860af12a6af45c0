"""Files read back on every rank (the helpers that scripts written by ``perseus-convert`` import): the same module
as :mod:`perseus.runtime.files`, at the path ``perseus.common.files``."""

import sys

from perseus.runtime import files as _module

sys.modules[__name__] = _module
