"""Keras support shared by perseus.tensorflow.keras and perseus.keras (Keras 3 and tf-keras 2), for a given
Keras module (``tf.keras`` or the ``keras`` package).

- :mod:`perseus.tensorflow._keras.frontend`: the public functions of both modules (optimizers, load_model, value
  collectives).
- :mod:`perseus.tensorflow._keras.callbacks`, :mod:`perseus.tensorflow._keras.elastic`: callbacks and elastic callbacks, per Keras
  module (:mod:`perseus.tensorflow._keras.classes` builds them).
- :mod:`perseus.tensorflow._keras.embedding`: DistributedEmbedding, per Keras module.

These modules sit above perseus.tensorflow's and nothing there imports them: the DistributedOptimizer itself
is :mod:`perseus.tensorflow.keras_optimizer` (``perseus.tensorflow.DistributedOptimizer`` wraps Keras
optimizers too), the eager reductions of plain values :mod:`perseus.tensorflow.keras_values` and the Keras 2
spellings that Keras 3 accepts :mod:`perseus.tensorflow.keras2_api`.
"""
