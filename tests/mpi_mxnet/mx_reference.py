"""Inputs any rank can rebuild for any other rank, and NumPy references computed from all of them."""

import numpy as np

DTYPES = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]


def rank_data(rank: int, shape, dtype: str, seed: int = 0) -> np.ndarray:
    """Deterministic small integers (exact in every dtype, sums too) for ``rank``."""
    rng = np.random.default_rng(seed * 7919 + rank)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    lo, hi = (0, 8) if dtype.startswith("uint") else (-8, 8)
    return rng.integers(lo, hi, size=shape).astype(dtype)


def nd(array):
    """An NDArray with the values and dtype of ``array`` (MXNet keeps 0-d arrays as shape ())."""
    import mxnet as mx

    return mx.nd.array(array, dtype=array.dtype)


def reduce_ref(inputs, op: str) -> np.ndarray:
    """The exact reduction of ``inputs`` in float64 (bool: logical), before casting to the dtype."""
    if inputs[0].dtype == np.bool_:
        stack = np.stack(inputs)
        return {"Sum": stack.any(0), "Max": stack.any(0), "Min": stack.all(0), "Product": stack.all(0)}[op]
    stack = np.stack([a.astype(np.float64) for a in inputs])
    if op == "Sum":
        return stack.sum(0)
    if op == "Average":
        return stack.sum(0) / len(inputs)
    if op == "Min":
        return stack.min(0)
    if op == "Max":
        return stack.max(0)
    if op == "Product":
        return stack.prod(0)
    raise AssertionError(op)


def wrap(values: np.ndarray, dtype: str) -> np.ndarray:
    """Cast float64 results to ``dtype`` as a C cast would (wrap-around for small integers, truncation)."""
    if np.dtype(dtype).kind in "iu":
        return np.trunc(values).astype(np.int64).astype(dtype)
    return values.astype(dtype)
