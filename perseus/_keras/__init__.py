"""Keras support shared by perseus.tensorflow.keras and perseus.keras (Keras 3 and tf-keras 2).

- :mod:`perseus._keras.optimizer`: the distributed optimizer classes and ``load_model``.
- :mod:`perseus._keras.callbacks`, :mod:`perseus._keras.elastic`: callbacks and elastic state, per Keras module.
- :mod:`perseus._keras.aggregation`: local gradient aggregation (``backward_passes_per_step``).
- :mod:`perseus._keras.values`: eager reductions of plain values.
"""
