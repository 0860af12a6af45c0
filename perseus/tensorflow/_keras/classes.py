"""Building a class for a given Keras module from a plain class that holds the behaviour.

perseus.tensorflow.keras and perseus.keras each need the callbacks (and the embedding layer) as subclasses of
their own Keras module's base classes. The behaviour is written once, in a plain class (a mixin whose
``super()`` calls reach the Keras base); :func:`keras_class` combines it with a base class.
"""

from __future__ import annotations

__all__ = ["keras_class"]


def keras_class(name, logic, base, **attributes):
    """A new class ``name`` deriving from ``logic`` then ``base`` (so ``logic``'s methods override the base's),
    with ``logic``'s docstring and module, and ``attributes`` as class attributes."""
    body = {"__doc__": logic.__doc__, "__module__": logic.__module__, "__qualname__": name}
    body.update(attributes)
    return type(name, (logic, base), body)
