"""perseus-convert: rewrite single-process (or Horovod) training scripts into distributed perseus scripts.

    perseus-convert train.py            # writes train_perseus.py and prints what changed

See docs/convert.md. The library entry point is :func:`convert_source`.
"""

from perseus.convert.context import Change, ConvertError, Options, Result, Warning
from perseus.convert.core import convert_source

__all__ = ["convert_source", "Options", "Result", "Change", "Warning", "ConvertError"]
