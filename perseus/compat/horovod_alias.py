"""Make ``import horovod...`` load the matching ``perseus...`` module, each module loaded once.

Use it to run Horovod-targeted code unchanged:

    python -m perseus.compat.horovod_alias train.py --args      # run a script
    python -m pytest -p perseus.compat.horovod_alias test_torch.py   # as a pytest plugin
    import perseus.compat.horovod_alias                          # or install it in-process

``import horovod.torch`` then returns the very module object ``perseus.torch`` (so ``mock.patch`` on a
``horovod.*`` path patches perseus, and global state is never duplicated). A name with no perseus
counterpart raises the usual ``ModuleNotFoundError`` naming the perseus module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import runpy
import sys

__all__ = ["install", "uninstall", "HorovodAlias"]

SOURCE, TARGET = "horovod", "perseus"


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


def install() -> None:
    """Put the alias first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, HorovodAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, HorovodAlias())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, HorovodAlias)]


install()


def _main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m perseus.compat.horovod_alias SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    _main(sys.argv[1:])
