"""A pytest plugin for running Horovod's ``test/single/test_ray.py`` on perseus (never commit Horovod's tests):
it installs the horovod alias and gives the two internal classes that file imports and perseus does not have
(``horovod.ray.runner.Coordinator`` and ``MiniSettings``, used only by its two Coordinator tests, which then
fail with NotImplementedError). Its tests are gated on ``gloo_built()`` because Horovod's Ray integration needs
Gloo; perseus's runs over MPI and has no Gloo, so the gate is lifted here (``gloo_built()`` stays False in
perseus).

    PYTHONPATH=tools python -m pytest -p horovod_test_ray_stubs /path/to/horovod/test/single/test_ray.py
"""

import perseus.compat.horovod_alias  # noqa: F401 - horovod.* is perseus.*
from perseus.base import util as _util
from perseus.ray import runner as _runner


class _Internal:
    """Horovod's internal Ray class: not in perseus."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is Horovod's internal Ray class; perseus has none")


class Coordinator(_Internal):
    pass


class MiniSettings(_Internal):
    pass


_runner.Coordinator = Coordinator
_runner.MiniSettings = MiniSettings

_util.gloo_built = lambda: True  # (in this test process only: the gate, not a claim)

# Horovod's fixtures call ray.init(..., _redis_max_memory=...), an argument current Ray no longer takes.
try:
    import ray as _ray

    _ray_init = _ray.init

    def _init(*args, **kwargs):
        kwargs.pop("_redis_max_memory", None)
        return _ray_init(*args, **kwargs)

    _ray.init = _init
except ImportError:  # (the test file needs Ray anyway)
    pass
