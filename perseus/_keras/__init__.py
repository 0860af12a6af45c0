"""Keras support shared by perseus.tensorflow.keras and perseus.keras (Keras 3 and tf-keras 2), for a given
Keras module (``tf.keras`` or the ``keras`` package).

- :mod:`perseus._keras.frontend`: the public functions of both modules (optimizers, load_model, value
  collectives).
- :mod:`perseus._keras.callbacks`, :mod:`perseus._keras.elastic`: callbacks and elastic callbacks, per Keras
  module (:mod:`perseus._keras.classes` builds them).
- :mod:`perseus._keras.embedding`: DistributedEmbedding, per Keras module.
- :mod:`perseus._keras.values`: eager reductions of plain values.
- :mod:`perseus._keras.keras2_api`: Keras 2 spellings accepted by Keras 3.

These modules sit above perseus.tensorflow's (the DistributedOptimizer itself is
:mod:`perseus.tensorflow.keras_optimizer`, as ``perseus.tensorflow.DistributedOptimizer`` wraps Keras
optimizers too); perseus.tensorflow imports only ``values`` and ``keras2_api`` from here, which import no
perseus.tensorflow module.
"""
