"""Make ``import horovod...`` load the matching ``perseus...`` module, each module loaded once.

Use it to run Horovod-targeted code unchanged:

    python -m perseus.compat.horovod_alias train.py --args      # run a script
    python -m pytest -p perseus.compat.horovod_alias test_torch.py   # as a pytest plugin
    import perseus.compat.horovod_alias                          # or install it in-process

``import horovod.torch`` then returns the very module object ``perseus.torch`` (so ``mock.patch`` on a
``horovod.*`` path patches perseus, and global state is never duplicated). A name with no perseus
counterpart raises the usual ``ModuleNotFoundError`` naming the perseus module. The alias travels with the job:
ranks started by ``perseus.run``, ``perseus.spark.run``, a ``RayExecutor`` or ``perseusrun`` from a process that
has it install it too (:mod:`perseus.base.horovod_alias`).
"""

from __future__ import annotations

import runpy
import sys

from perseus.base.horovod_alias import HorovodAlias, install, uninstall

__all__ = ["install", "uninstall", "HorovodAlias"]

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
