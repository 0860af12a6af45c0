"""Reduction operators, numbered as Horovod numbers them."""

import enum

__all__ = ["ReduceOp", "Average", "Sum", "Adasum", "Min", "Max", "Product", "resolve_op",
           "reject_adasum"]


class ReduceOp(enum.IntEnum):
    """Reduction applied by allreduce and reducescatter. Plain ints 0-5 compare equal to these."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


def resolve_op(op=None, average=None, default=Average) -> ReduceOp:
    """Return the ReduceOp for Horovod's ``op``/deprecated ``average`` arguments.

    Raises:
        ValueError: both ``op`` and ``average`` were given, or ``op`` is not a known operator.
    """
    if average is None and type(op) is ReduceOp:  # the common case, first
        return op
    import warnings

    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is None:
        return ReduceOp(default)
    try:
        return ReduceOp(int(op))
    except (ValueError, TypeError):
        raise ValueError(f"unknown reduction op {op!r}; use one of Average, Sum, Adasum, Min, Max, Product") \
            from None


def reject_adasum(op, what: str, error: type = NotImplementedError) -> ReduceOp:
    """Return ``op`` as a :class:`ReduceOp`; raise ``error`` naming the API ``what`` when it is Adasum.

    Every entry point that takes an ``op`` checks through here, on the caller's thread, so that the message is
    the same everywhere. ``error`` is ``ValueError`` where Horovod raises that (the Keras optimizer).
    """
    op = ReduceOp(op)
    if op == ReduceOp.ADASUM:
        raise error(f"perseus.{what}: op=Adasum is not implemented; use Average or Sum")
    return op
