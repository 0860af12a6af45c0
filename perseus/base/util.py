"""Horovod-compat path: keep names and signatures identical to horovod.common.util."""

from __future__ import annotations

import importlib
import multiprocessing
import warnings
from contextlib import contextmanager

from perseus.base.knobs import external, set_external
from perseus.base.partition import split_list

__all__ = [
    "extension_available", "gpu_available", "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "env", "get_average_backwards_compatibility_fun", "num_rank_is_power_2", "split_list",
    "is_version_greater_equal_than", "is_iterable", "check_installed_version",
]

EXTENSIONS = ["tensorflow", "torch", "mxnet"]


def _probe(ext_base_name: str, attribute: str, queue) -> None:
    try:
        module = importlib.import_module("." + ext_base_name, "perseus")
        queue.put(getattr(module, attribute)() if attribute else True)
    except Exception:  # noqa: BLE001 - "not available" is the answer
        queue.put(None)


def _ask_child(ext_base_name: str, attribute: str, verbose: bool):
    """Import ``perseus.<ext_base_name>`` in a forked child (so the parent imports no framework) and
    return ``module.<attribute>()`` there, or None when the module cannot be imported."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_probe, args=(ext_base_name, attribute, queue), daemon=True)
    child.start()
    child.join()
    try:
        result = queue.get(timeout=5)
    except Exception:  # noqa: BLE001 - the child died before answering: the extension is not available
        result = None
    if verbose:
        print(f"Extension {ext_base_name} {'was' if result else 'was NOT'} {attribute or 'built'}.")
    return result


def _cache(f):
    """Memoise ``f`` on its arguments (Horovod's helper, used by its tests)."""
    memo = {}

    def wrapper(*args, **kwargs):
        key = (args, frozenset(kwargs.items()))
        if key not in memo:
            memo[key] = f(*args, **kwargs)
        return memo[key]
    return wrapper


def extension_available(ext_base_name, verbose=False):
    """True when ``perseus.<ext_base_name>`` imports (checked in a forked child)."""
    return _ask_child(ext_base_name, "", verbose) or False


@_cache
def gpu_available(ext_base_name, verbose=False):
    """True when ``perseus.<ext_base_name>`` runs with a GPU (always False today)."""
    return _ask_child(ext_base_name, "_check_has_gpu", verbose) or False


def _built(attribute):
    def fn(verbose=False):
        for ext in EXTENSIONS:
            result = _ask_child(ext, attribute, verbose)
            if result is not None:
                return result
        return None
    fn.__name__ = attribute
    fn.__doc__ = f"Ask the first importable framework module for ``{attribute}()``."
    return _cache(fn)


mpi_built = _built("mpi_built")
gloo_built = _built("gloo_built")
nccl_built = _built("nccl_built")
ddl_built = _built("ddl_built")
ccl_built = _built("ccl_built")


@contextmanager
def env(**kwargs):
    """Set environment variables for the duration of the block (None values are ignored)."""
    kwargs = {k: str(v) for k, v in kwargs.items() if v is not None}
    saved = {k: external(k) for k in kwargs}
    for k, v in kwargs.items():
        set_external(k, v)
    try:
        yield
    finally:
        for k, old in saved.items():
            set_external(k, old)


def get_average_backwards_compatibility_fun(reduce_ops):
    """Return ``impl(op, average)`` resolving Horovod's deprecated ``average`` argument against ``op``."""
    def impl(op, average):
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average. Please provide only one of them.")
            return op
        if average is not None:
            warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                          DeprecationWarning)
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average
    return impl


def num_rank_is_power_2(num_rank):
    """True when ``num_rank`` is a power of two."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def is_iterable(x):
    try:
        iter(x)
    except TypeError:
        return False
    return True


@_cache
def is_version_greater_equal_than(ver, target):
    """``ver >= target`` for version strings; ``target`` must be ``major.minor.patch``."""
    from packaging import version

    if not (isinstance(ver, str) and isinstance(target, str)):
        raise ValueError(f"This function only accepts string arguments. Received: ver={ver!r}, "
                         f"target={target!r}")
    if len(target.split(".")) != 3:
        raise ValueError(f"We only accepts target version values in the form of: major.minor.patch. "
                         f"Received: {target}")
    return version.parse(ver) >= version.parse(target)


def check_installed_version(name, version, exception=None):
    """No-op: perseus has no compiled per-framework extension whose version could mismatch."""
    return None
