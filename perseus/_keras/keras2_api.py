"""Keras 2 spellings that Horovod-era scripts use and Keras 3 dropped, where perseus can accept both.

Horovod's published TF2 examples broadcast ``opt.variables()``: a method in Keras 2, a property holding a
list in Keras 3, so the unchanged script dies with ``TypeError: 'list' object is not callable`` (under
Horovod too). :func:`allow_optimizer_variables_call` makes the Keras 3 property return a list that can also be
called, giving back the same variables; everything that treats it as a list is unaffected.
"""

from __future__ import annotations

__all__ = ["CallableVariableList", "allow_optimizer_variables_call"]


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
