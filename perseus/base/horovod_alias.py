"""``import horovod...`` as ``perseus...``: the import hook behind perseus.compat.horovod_alias and the rank side.

:class:`HorovodAlias` is a meta-path finder that maps ``horovod[.x]`` onto ``perseus[.x]``: ``import
horovod.torch`` returns the very module object ``perseus.torch``, each module loaded once. :func:`install` puts it
first on ``sys.meta_path`` and sets ``PERSEUS_HOROVOD_ALIAS=1`` in this process's environment, so that the
processes it starts inherit the wish: every rank started by ``perseus.run``, ``perseus.spark.run``, a
``RayExecutor`` or ``perseusrun`` calls :func:`install_if_asked` before it unpickles a function (which may
refer to ``horovod`` modules by name). It imports no other perseus module but the environment's gate,
:mod:`perseus.base.knobs`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

from perseus.base.knobs import external, set_external

__all__ = ["HorovodAlias", "install", "uninstall", "active", "install_if_asked", "env", "ENV"]

SOURCE, TARGET = "horovod", "perseus"
#: set (to 1) in the environment of a process that has the alias; its ranks install it too
ENV = "PERSEUS_HOROVOD_ALIAS"


class HorovodAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Meta-path finder and loader mapping ``horovod[.x]`` onto ``perseus[.x]``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != SOURCE and not fullname.startswith(SOURCE + "."):
            return None
        real_name = TARGET + fullname[len(SOURCE):]
        real_spec = importlib.util.find_spec(real_name)
        if real_spec is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self,
                                              is_package=real_spec.submodule_search_locations is not None)

    def create_module(self, spec):
        return None  # a throw-away module; exec_module swaps in the real one

    def exec_module(self, module):
        # The import system reads sys.modules[name] again after exec_module, so the caller gets the perseus
        # module itself, whose own __spec__ and __name__ are left untouched.
        real = importlib.import_module(TARGET + module.__name__[len(SOURCE):])
        sys.modules[module.__name__] = real


def active() -> bool:
    """Whether the alias is on this process's ``sys.meta_path``."""
    return any(isinstance(f, HorovodAlias) for f in sys.meta_path)


def install() -> None:
    """Put the alias first on ``sys.meta_path`` and ask the processes this one starts for it too
    (``PERSEUS_HOROVOD_ALIAS=1``). Idempotent."""
    if not active():
        sys.meta_path.insert(0, HorovodAlias())
    set_external(ENV, "1")


def uninstall() -> None:
    """Take the alias off ``sys.meta_path`` (modules already imported as ``horovod.*`` stay) and stop asking the
    processes this one starts for it."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, HorovodAlias)]
    set_external(ENV, None)


def install_if_asked() -> None:
    """A rank: install the alias when the process that started the job had it (``PERSEUS_HOROVOD_ALIAS=1``)."""
    if external(ENV) == "1":
        install()


def env() -> dict:
    """What a launcher adds to its ranks' environment so that they have the alias when this process has it."""
    return {ENV: "1"} if active() else {}
