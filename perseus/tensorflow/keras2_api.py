"""Keras 2 spellings that Horovod-era scripts use and Keras 3 dropped, where perseus can accept both.

Horovod's published TF2 examples broadcast ``opt.variables()``: a method in Keras 2, a property holding a
list in Keras 3, so the unchanged script dies with ``TypeError: 'list' object is not callable`` (under
Horovod too). :func:`allow_optimizer_variables_call` makes the Keras 3 property return a list that can also be
called, giving back the same variables; everything that treats it as a list is unaffected.

Its Keras examples call ``model.compile(..., experimental_run_tf_function=False)``, an argument Keras 2 had
already made a no-op and Keras 3 rejects; :func:`accept_compile_run_tf_function` lets Keras 3's ``compile``
accept and ignore it, as tf-keras 2 does.

Its elastic examples rescale the learning rate after a reset with ``opt.lr.assign(...)``; Keras 3 spells it
``learning_rate`` only. :func:`allow_optimizer_lr` adds ``lr`` to Keras 3 optimizers as another name for
``learning_rate`` (reading, assigning to the attribute, and ``.assign`` on the variable it returns).
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["CallableVariableList", "allow_optimizer_variables_call", "accept_compile_run_tf_function",
           "allow_optimizer_lr"]


class CallableVariableList(list):
    """A list of variables that, when called, returns a plain list of the same variables (Keras 2's
    ``optimizer.variables()``)."""

    __slots__ = ()

    def __call__(self) -> list:
        return list(self)


def allow_optimizer_variables_call(keras_module) -> bool:
    """Let ``optimizer.variables()`` work on Keras 3 optimizers of ``keras_module`` as it did in Keras 2.

    Idempotent; does nothing for Keras 2 (where ``variables`` is a method already). Returns True when the
    property was wrapped (now or before).
    """
    try:
        base = keras_module.optimizers.Optimizer.__mro__
    except AttributeError:
        return False
    for cls in base:
        prop = cls.__dict__.get("variables")
        if not isinstance(prop, property):
            continue
        if getattr(prop.fget, "_perseus_callable", False):
            return True
        getter = prop.fget

        def variables(self, _getter=getter):
            return CallableVariableList(_getter(self))

        variables._perseus_callable = True
        variables.__doc__ = getter.__doc__
        setattr(cls, "variables", property(variables, prop.fset, prop.fdel, prop.__doc__))
        return True
    return False


def accept_compile_run_tf_function(keras_module) -> bool:
    """Let ``Model.compile`` of ``keras_module`` accept Keras 2's ``experimental_run_tf_function`` argument and
    ignore it (tf-keras 2 ignores it too). Idempotent; does nothing where ``compile`` already takes it.
    Returns True when ``compile`` accepts the argument now."""
    try:
        mro = keras_module.Model.__mro__
    except AttributeError:
        return False
    owner = next((cls for cls in mro if "compile" in cls.__dict__), None)
    if owner is None:
        return False
    original = owner.__dict__["compile"]
    if getattr(original, "_perseus_keras2", False):
        return True
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError):
        return False
    if "experimental_run_tf_function" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return True

    @functools.wraps(original)
    def compile(self, *args, experimental_run_tf_function=None, **kwargs):
        return original(self, *args, **kwargs)

    compile._perseus_keras2 = True
    setattr(owner, "compile", compile)
    return True


def allow_optimizer_lr(keras_module) -> bool:
    """Give Keras 3 optimizers of ``keras_module`` Keras 2's ``lr``: the same as ``learning_rate``. Idempotent;
    does nothing where ``lr`` exists already (Keras 2). Returns True when optimizers have ``lr`` now."""
    try:
        base = keras_module.optimizers.Optimizer
    except AttributeError:
        return False
    if hasattr(base, "lr"):
        return True
    if not isinstance(getattr(base, "learning_rate", None), property):
        return False

    def get(self):
        return self.learning_rate

    def put(self, value):
        self.learning_rate = value

    base.lr = property(get, put, doc="Keras 2's name of ``learning_rate`` (added by perseus).")
    return True
