"""Small TensorFlow helpers shared by the perseus.tensorflow modules (Horovod's horovod.tensorflow.util names)."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["_executing_eagerly", "_make_subgraph", "_cache", "vars_to_refs", "refs_to_vars", "var_key"]


def keep_autograph_out_of_perseus() -> None:
    """Tell AutoGraph not to rewrite perseus's own Python when a ``tf.function`` calls into it.

    perseus builds its graph ops with explicit ``tf.cond``/``tf.py_function`` and needs no conversion; left to
    itself, AutoGraph re-parses perseus's source at every trace (slow, and wrong when the installed source
    changes while a job runs), as it skips TensorFlow, NumPy and Keras. Uses AutoGraph's module rules, an
    internal table; if that moves in a future TensorFlow, conversion simply stays on. Idempotent.
    """
    try:
        from tensorflow.python.autograph.core import config as autograph_config
    except ImportError:  # pragma: no cover - a TensorFlow without the table
        return
    rules = tuple(getattr(autograph_config, "CONVERSION_RULES", ()))
    if any(getattr(rule, "_prefix", None) == "perseus" for rule in rules):
        return
    autograph_config.CONVERSION_RULES = (autograph_config.DoNotConvert("perseus"),) + rules


def _executing_eagerly():
    """True when TensorFlow runs eagerly here (False while a tf.function or a graph is being built)."""
    return tf.executing_eagerly()


def _make_subgraph(f):
    """Wrap ``f`` in a tf.function."""
    return tf.function(f)


def _cache(f):
    """Memoise ``f`` on its (hashable) positional arguments and on whether execution is eager."""
    memo = {}

    def wrapper(*args):
        key = (args, _executing_eagerly())
        if key not in memo:
            memo[key] = f(*args)
        return memo[key]

    wrapper.__wrapped__ = f
    return wrapper


def vars_to_refs(variables):
    """Nested lists of variables -> nested tuples of hashable references."""
    if isinstance(variables, (list, tuple)):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs):
    """Inverse of :func:`vars_to_refs` (tuples come back as lists)."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()


def var_key(var):
    """A hashable key for a tf.Variable, tensor or Keras 3 variable (``ref()`` where it exists, else the
    object's identity: Keras 3 variables have no ``ref``)."""
    ref = getattr(var, "ref", None)
    return ref() if callable(ref) else id(var)
