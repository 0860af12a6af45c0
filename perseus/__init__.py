"""perseus: a drop-in, faster replacement for Horovod.

Importing ``perseus`` starts nothing and imports no framework. Use a framework module
(``perseus.torch``) or the framework-neutral engine API in :mod:`perseus.common.api`.
"""

__version__ = "0.1.0"


def run(*args, **kwargs):
    """Launch ``func`` on several processes (Horovod's ``horovod.run``); see :func:`perseus.runner.run`."""
    from perseus.runner import run as _run

    return _run(*args, **kwargs)
