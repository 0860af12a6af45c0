"""Horovod's ``horovod.common.elastic`` path (``State``, ``ObjectState``, ``run_fn``, ...), for code that imports
it there through the import alias. The implementation is :mod:`perseus.elastic.state`; this module only names
it again, and nothing inside perseus imports it.
"""

from perseus.elastic.state import *  # noqa: F401,F403 - the same names, at Horovod's path
from perseus.elastic.state import __all__  # noqa: F401
