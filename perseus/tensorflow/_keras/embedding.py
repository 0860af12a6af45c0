"""EmbRace for Keras 3 (TensorFlow backend): ``perseus.keras.DistributedEmbedding`` and
``perseus.tensorflow.keras.DistributedEmbedding``.

The layer keeps a column shard of the ``[input_dim, output_dim]`` table on each rank of its process set (the
first ``output_dim % size`` ranks hold one column more) and works as ``perseus.torch.DistributedEmbedding``
does: the forward allgathers the ids, looks up this rank's columns for every rank's unique ids and exchanges
them with an alltoall; the gradient sums duplicate ids, sends each rank its columns of the coalesced rows
(alltoall) and gives the shard the rows received from every rank, divided by the number of ranks (op=Average,
as the DistributedOptimizer averages the other gradients). The forward and the gradient each run as one
``tf.py_function`` (eagerly and in ``model.fit``'s compiled step; not under XLA), through
``tf.custom_gradient``.

The shard variable carries ``perseus_model_parallel = True``: the Keras DistributedOptimizer applies its
gradient as it is, and ``BroadcastGlobalVariablesCallback`` leaves it (and its optimizer slots) alone.
Vertical scheduling (``prefetch``) exists only in the torch module.

The layer's behaviour is the plain class ``_DistributedEmbedding``; :func:`make_embedding_class` derives the
public class from it and the Keras module's ``layers.Layer``.
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from perseus.runtime import collectives as _c
from perseus.base.partition import even_counts
from perseus.runtime.process_sets import global_process_set
from perseus.base.reduce_ops import Average, ReduceOp, Sum
from perseus.tensorflow._keras.classes import keras_class
from perseus.tensorflow._core import to_numpy

__all__ = ["make_embedding_class", "MODEL_PARALLEL_ATTR"]

MODEL_PARALLEL_ATTR = "perseus_model_parallel"

PRIORITY_GRADIENT = 2_000_000
PRIORITY_FORWARD = 1_000_000


def _segment_sum(keys: np.ndarray, values: np.ndarray):
    """``(unique keys, values summed per key)`` (keys sorted)."""
    if keys.size == 0:
        return keys, values[:0]
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    return sorted_keys[starts], np.add.reduceat(values[order], starts, axis=0)


class _DistributedEmbedding:
    """``keras.layers.Embedding`` with the table split by columns across the ranks (EmbRace).

    Args:
        input_dim, output_dim, embeddings_initializer, mask_zero: as ``keras.layers.Embedding``. The
            initializer is called for the full ``[input_dim, output_dim]`` table and this rank keeps its
            columns (seed Keras the same way on every rank, or pass ``weights``).
        weights: optional full table ``[input_dim, output_dim]`` (the same on every rank).
        sparse: give the shard a ``tf.IndexedSlices`` gradient (rows touched by any rank) instead of a
            dense one.
        op: ``Average`` (default, matches the DistributedOptimizer's default) or ``Sum``.
        process_set: the ranks sharing the table (``output_dim`` must be at least its size).

    The layer's ``name`` names its collectives: build the model the same way on every rank. Every rank
    must run the layer (and its gradient) the same number of times.
    """

    def __init__(self, input_dim, output_dim, embeddings_initializer="uniform", mask_zero=False,
                 weights=None, sparse=False, op=Average, process_set=global_process_set, **kwargs):
        super().__init__(**kwargs)
        import keras as _k
        if _k.backend.backend() != "tensorflow":
            raise NotImplementedError("perseus DistributedEmbedding supports the TensorFlow backend of Keras")
        op = ReduceOp(op)
        if op not in (Average, Sum):
            raise ValueError(f"perseus DistributedEmbedding: op must be Average or Sum, not {op.name}")
        ps_id, size, rank = _c.runtime().process_set_info(process_set)
        if output_dim < size:
            raise ValueError(f"perseus DistributedEmbedding: output_dim {output_dim} is smaller than the "
                             f"{size} ranks of the process set; every rank needs at least one column")
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.embeddings_initializer = self._keras_module.initializers.get(embeddings_initializer)
        self.mask_zero, self.sparse, self.op = bool(mask_zero), bool(sparse), op
        self.process_set = process_set
        self._size, self._rank = size, rank
        self._job_ranks = list(_c.runtime().process_set_ranks(ps_id))
        self._widths = even_counts(self.output_dim, size)
        starts = [sum(self._widths[:k]) for k in range(size)]
        self._bounds = [(s, s + w) for s, w in zip(starts, self._widths)]
        self.columns = self._bounds[rank]
        self._scale = 1.0 / size if op == Average else 1.0
        self._initial = None if weights is None else np.asarray(weights[0] if isinstance(weights, (list, tuple))
                                                                else weights)
        if self._initial is not None and self._initial.shape != (self.input_dim, self.output_dim):
            raise ValueError(f"perseus DistributedEmbedding: weights has shape {self._initial.shape}; "
                             f"expected the full table ({self.input_dim}, {self.output_dim})")
        self.supports_masking = self.mask_zero

    def build(self, input_shape=None):
        c0, c1 = self.columns

        def init(shape, dtype=None):
            full = self._initial if self._initial is not None else np.asarray(
                self.embeddings_initializer((self.input_dim, self.output_dim), dtype=dtype))
            return np.ascontiguousarray(full[:, c0:c1]).astype(dtype or self.variable_dtype)

        self.embeddings = self.add_weight(shape=(self.input_dim, c1 - c0), initializer=init,
                                          name="embeddings", trainable=True)
        _mark(self.embeddings)
        self.built = True

    def compute_mask(self, inputs, mask=None):
        if not self.mask_zero:
            return None
        return tf.not_equal(inputs, 0)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    # -- collectives ----------------------------------------------------------------------------------
    def _what(self):
        return f"perseus DistributedEmbedding({self.name!r})"

    def _allgather(self, array, kind, priority):
        holder = []

        def alloc(shape):
            holder.append(np.empty(shape, array.dtype))
            return holder[0]
        h = _c.allgather_async(array, alloc, f"embrace.{self.name}.{kind}", self.process_set, priority,
                               finish=lambda r: (holder[0], [int(x) for x in r[0].received_splits]))
        return _c.synchronize(h)

    def _alltoall(self, array, splits, kind, priority):
        holder = []

        def alloc(shape):
            holder.append(np.empty(shape, array.dtype))
            return holder[0]
        h = _c.alltoall_async(np.ascontiguousarray(array), splits, alloc, f"embrace.{self.name}.{kind}",
                              self.process_set, priority, finish=lambda r: holder[0])
        return _c.synchronize(h)

    def _plan(self, ids):
        all_ids, counts = self._allgather(ids, "ids", PRIORITY_FORWARD)
        bad = (all_ids < 0) | (all_ids >= self.input_dim)
        if bad.any():
            owner = np.repeat(np.arange(self._size), counts)
            ranks = sorted({self._job_ranks[i] for i in owner[bad].tolist()})
            raise IndexError(f"{self._what()}: token id {int(all_ids[bad][0])} on rank(s) {ranks} is out of "
                             f"range for input_dim={self.input_dim}; every rank of the process set raises "
                             "this error")
        owner = np.repeat(np.arange(self._size, dtype=np.int64), counts)
        keys, inverse = np.unique(owner * self.input_dim + all_ids, return_inverse=True)
        uniq = keys % self.input_dim
        ucounts = np.bincount(keys // self.input_dim, minlength=self._size).astype(np.int64)
        me = self._rank
        start, ustart = sum(counts[:me]), int(ucounts[:me].sum())
        mine = inverse.reshape(-1)[start:start + counts[me]] - ustart
        return uniq.astype(np.int64), ucounts, mine.astype(np.int64)

    # -- numpy bodies -----------------------------------------------------------------------------------
    def _forward_np(self, ids_t, shard_t):
        ids = np.ascontiguousarray(ids_t.numpy().reshape(-1).astype(np.int64))
        shard = to_numpy(shard_t)
        uniq, ucounts, inverse = self._plan(ids)
        w = shard.shape[1]
        values = shard[uniq].reshape(-1)
        received = self._alltoall(values, [int(u) * w for u in ucounts], "lookup", PRIORITY_FORWARD)
        mine = int(ucounts[self._rank])
        parts = np.split(received, np.cumsum([mine * wk for wk in self._widths])[:-1])
        rows = np.concatenate([p.reshape(mine, wk) for p, wk in zip(parts, self._widths)], axis=1)
        out = rows[inverse].reshape(tuple(ids_t.shape) + (self.output_dim,))
        return out, uniq, ucounts, inverse

    def _gradient_np(self, dy_t, uniq_t, ucounts_t, inverse_t):
        uniq, ucounts, inverse = uniq_t.numpy(), ucounts_t.numpy(), inverse_t.numpy()
        dy = to_numpy(dy_t).reshape(-1, self.output_dim)
        me = self._rank
        mine = int(ucounts[me])
        _, coalesced = _segment_sum(inverse, dy)  # every local unique row occurs: rows 0..mine-1 in order
        send = np.concatenate([coalesced[:, c0:c1].reshape(-1) for c0, c1 in self._bounds]) if mine else \
            np.zeros(0, dy.dtype)
        w = self.columns[1] - self.columns[0]
        received = self._alltoall(send, [mine * wk for wk in self._widths], "grad", PRIORITY_GRADIENT)
        rows, values = _segment_sum(uniq, received.reshape(-1, w))
        values = values * np.asarray(self._scale, values.dtype)
        if self.sparse:
            return rows.astype(np.int64), values
        dense = np.zeros((self.input_dim, w), dy.dtype)
        dense[rows] = values
        return dense

    def call(self, inputs):
        ids = tf.cast(inputs, tf.int64)
        shard = tf.convert_to_tensor(self.embeddings)
        dtype = shard.dtype
        layer = self

        @tf.custom_gradient
        def lookup(w):
            out, uniq, ucounts, inverse = tf.py_function(layer._forward_np, [ids, w],
                                                         [dtype, tf.int64, tf.int64, tf.int64])
            out.set_shape(ids.shape.concatenate([layer.output_dim]))

            def grad(dy):
                if layer.sparse:
                    rows, values = tf.py_function(layer._gradient_np, [dy, uniq, ucounts, inverse],
                                                  [tf.int64, dtype])
                    values.set_shape([None, w.shape[1]])
                    return tf.IndexedSlices(values, rows, tf.shape(w, out_type=tf.int64))
                g = tf.py_function(layer._gradient_np, [dy, uniq, ucounts, inverse], dtype)
                g.set_shape(w.shape)
                return g
            return out, grad

        return lookup(shard)

    # -- full table -------------------------------------------------------------------------------------
    def full_weights(self):
        """The full ``[input_dim, output_dim]`` table on every rank (collective over the process set)."""
        shard = np.ascontiguousarray(to_numpy(tf.convert_to_tensor(self.embeddings)))
        if self._size == 1:
            return shard.copy()
        flat, _ = self._allgather(shard.reshape(-1), "full", 0)
        parts = np.split(flat, np.cumsum([self.input_dim * w for w in self._widths])[:-1])
        return np.concatenate([p.reshape(self.input_dim, w) for p, w in zip(parts, self._widths)], axis=1)

    def set_full_weights(self, table):
        """Copy this rank's columns of a full ``[input_dim, output_dim]`` table into the shard (local)."""
        table = np.asarray(table)
        if table.shape != (self.input_dim, self.output_dim):
            raise ValueError(f"{self._what()}: expected the full table ({self.input_dim}, {self.output_dim}),"
                             f" got {table.shape}")
        c0, c1 = self.columns
        self.embeddings.assign(np.ascontiguousarray(table[:, c0:c1]))

    def get_config(self):
        config = super().get_config()
        config.update(input_dim=self.input_dim, output_dim=self.output_dim, mask_zero=self.mask_zero,
                      sparse=self.sparse, op=int(self.op),
                      embeddings_initializer=self._keras_module.initializers.serialize(
                          self.embeddings_initializer))
        return config


class _Unsupported:
    """Stands for DistributedEmbedding where the Keras module is not Keras 3: creating one raises
    NotImplementedError."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("perseus DistributedEmbedding needs Keras 3 (the keras package >= 3, "
                                  "or tf.keras in TensorFlow >= 2.16); tf-keras 2 is not supported")


@functools.lru_cache(maxsize=None)
def make_embedding_class(keras):
    """The DistributedEmbedding layer class for the Keras module ``keras``: a ``keras.layers.Layer`` for
    Keras 3, a class whose constructor raises NotImplementedError for tf-keras 2."""
    if not hasattr(keras, "Variable") or not hasattr(keras.layers.Layer, "add_weight"):
        return keras_class("DistributedEmbedding", _Unsupported, object)
    return keras_class("DistributedEmbedding", _DistributedEmbedding, keras.layers.Layer, _keras_module=keras)


def _mark(variable):
    """Mark a Keras variable (and the tf.Variable behind it) as a per-rank shard."""
    for target in (variable, getattr(variable, "value", None)):
        if target is None:
            continue
        try:
            setattr(target, MODEL_PARALLEL_ATTR, True)
        except (AttributeError, TypeError):
            pass
