"""Numeric kernels the engine needs beyond what MPI provides (16-bit float arithmetic).

The kernels are vectorised NumPy (``reference.py``); every call works on whole buffers, never per element.
"""

from perseus._native.reference import bf16_to_f32, combine, f32_to_bf16, reduce_into, scale_into

__all__ = ["bf16_to_f32", "combine", "f32_to_bf16", "reduce_into", "scale_into"]
