"""perseus: a drop-in, faster replacement for Horovod.

Importing ``perseus`` starts nothing and imports no framework. Use a framework module
(``perseus.torch``) or the framework-neutral engine API in :mod:`perseus.lifecycle.api`.
:func:`run` (Horovod's ``horovod.run``) launches a function on several processes; it is
:func:`perseus.runner.run`.
"""

from perseus._version import __version__  # noqa: F401 - the package's version attribute
from perseus.runner import run  # noqa: F401 - perseus.run, as horovod.run
