"""Horovod's ``horovod.common`` paths, for code that imports them through the import alias, and paths that
scripts written by ``perseus-convert`` import.

Each module here is the module it names, not a copy: importing ``perseus.common.util`` gives
:mod:`perseus.base.util` itself (so a test that patches a name at Horovod's path patches the real one).
Nothing inside perseus imports this package. The implementations live by layer: :mod:`perseus.base` (no
engine), :mod:`perseus.runtime` (the process's runtime) and :mod:`perseus.elastic`.
"""
