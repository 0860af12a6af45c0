"""The ``perseus-horovod`` distribution: Horovod's import names and ``horovodrun`` for perseus, with no edits.

Installed next to perseus, it makes ``import horovod.torch`` (and every ``horovod.*`` module perseus mirrors) give
the perseus module, in every Python process of the environment (a ``.pth`` file runs :func:`boot` at start-up),
so that scripts, notebooks and every rank of a job resolve Horovod's names without an alias flag. Its
``horovodrun`` command is ``perseusrun``.

Nothing is imported at start-up but this module: the first ``import horovod...`` loads perseus's alias
(:mod:`perseus.base.horovod_alias`). Where a real Horovod is installed in the same environment, this distribution
does nothing but say so once (``import horovod`` then gives Horovod): uninstall one of the two.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

__all__ = ["boot", "horovod_installed", "main"]

_WARNED = "PERSEUS_HOROVOD_CONFLICT_SAID"  # set once said, so that the job's other processes stay quiet


def horovod_installed() -> bool:
    """Whether a real ``horovod`` package is importable from ``sys.path`` (looked up without any alias)."""
    return importlib.machinery.PathFinder.find_spec("horovod") is not None


class _LazyAlias(importlib.abc.MetaPathFinder):
    """Stands in for perseus's alias until the first ``import horovod...``, then hands over to it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "horovod" and not fullname.startswith("horovod."):
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        from perseus.base.horovod_alias import HorovodAlias, install

        install()
        return HorovodAlias().find_spec(fullname, path, target)


def boot() -> None:
    """At interpreter start-up (the ``.pth`` file): put the alias in place, unless a real Horovod is installed
    (then say so on stderr, once per job, and leave ``import horovod`` to it)."""
    if horovod_installed():
        if not os.environ.get(_WARNED):
            os.environ[_WARNED] = "1"
            print("perseus-horovod: a real Horovod is installed in this environment, so `import horovod` gives "
                  "Horovod, not perseus; uninstall one of them (pip uninstall horovod, or pip uninstall "
                  "perseus-horovod)", file=sys.stderr)
        return
    if not any(type(f).__name__ in ("_LazyAlias", "HorovodAlias") for f in sys.meta_path):
        sys.meta_path.insert(0, _LazyAlias())


def main(argv=None) -> int:
    """``horovodrun``: ``perseusrun`` (refused, with the reason, where a real Horovod is installed)."""
    if horovod_installed():
        print("horovodrun (perseus-horovod): a real Horovod is installed in this environment; its own horovodrun "
              "would be shadowed. Uninstall one of them, or run perseusrun.", file=sys.stderr)
        return 2
    from perseus.runner.launch import main as perseusrun

    return perseusrun(argv)
