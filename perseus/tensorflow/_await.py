"""The PerseusAwait op: waits for a graph-mode collective without holding a TensorFlow thread.

``native/perseus_await.cc`` is compiled once per TensorFlow version with the system C++ compiler and the flags
TensorFlow reports (``tf.sysconfig``), into the perseus cache directory (``PERSEUS_CACHE_DIR``). Ranks on one
host build it once between them (a file lock). When it cannot be built (no compiler, no headers) perseus logs
why once and falls back to a blocking wait.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import threading

import tensorflow as tf

from perseus.base.knobs import external, load_settings

__all__ = ["load", "cache_dir"]

_log = logging.getLogger("perseus")
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "perseus_await.cc")
_lock = threading.Lock()
_loaded = None  # (op module, complete function) or False when unavailable


def cache_dir() -> str:
    """The directory perseus builds into (PERSEUS_CACHE_DIR, else the XDG cache, else ~/.cache)."""
    configured = load_settings().cache_dir
    if configured:
        return configured
    base = external("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "perseus")


def _command(output: str) -> list:
    cxx = external("CXX") or "g++"
    return [cxx, "-O2", "-w", "-shared", "-fPIC", _SOURCE, "-o", output, *tf.sysconfig.get_compile_flags(),
            *tf.sysconfig.get_link_flags()]


def _library_path() -> str:
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join(_command("x")).encode()).hexdigest()[:12]
    return os.path.join(cache_dir(), f"perseus_await-tf{tf.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
                                     f"-{digest}.so")


def _build(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        proc = subprocess.run(_command(tmp), capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, path)


@tf.autograph.experimental.do_not_convert
def load():
    """``(op module, complete(key))`` for the await op, building it on first use; None if unavailable.

    Called while a graph is traced; AutoGraph is told to leave it (and what it calls) alone."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _try_load()
        return _loaded or None


@tf.autograph.experimental.do_not_convert
def _try_load():
    if not load_settings().tf_async_op:
        return False
    try:
        path = _library_path()
        if not os.path.exists(path):
            _build(path)
        module = tf.load_op_library(path)
        complete = ctypes.CDLL(path).perseus_tf_complete
        complete.argtypes = [ctypes.c_int64]
        complete.restype = None
        return module, complete
    except Exception as exc:  # noqa: BLE001 - any failure means: fall back, and say why
        _log.warning("perseus: the TensorFlow await op is unavailable (%s); graph-mode collectives will block a "
                     "TensorFlow thread while they wait. Set PERSEUS_TF_ASYNC_OP=0 to silence this.", exc)
        return False
