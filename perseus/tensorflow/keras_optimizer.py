"""The Keras DistributedOptimizer (Keras 3 and tf-keras 2), for perseus.tensorflow, perseus.tensorflow.keras and
perseus.keras.

:func:`create_distributed_optimizer` returns an optimizer of a dynamically created subclass of the wrapped
optimizer's class, with the same class name and module (a saved model loads without perseus), whose gradients
are reduced across the ranks before they are applied:

- **Keras 3** (``keras>=3``, what ``tf.keras`` is in TensorFlow >= 2.16): ``apply`` (which ``apply_gradients``
  and ``model.fit`` call) reduces the gradients it is given, then applies them. The TensorFlow backend is
  supported (eagerly and in ``model.fit``'s compiled step; not under XLA ``jit_compile=True``); the JAX and
  PyTorch backends raise NotImplementedError. Keras resolves ``model.compile(jit_compile="auto")`` (its
  default) to XLA when TensorFlow sees a GPU; a model whose optimizer is one of these resolves it to no XLA
  instead, and an explicit ``jit_compile=True`` raises NotImplementedError at ``compile`` (:func:`no_auto_xla`).
- **tf-keras 2** (``TF_USE_LEGACY_KERAS=1`` with the ``tf-keras`` package, or ``import tf_keras``), new and
  legacy optimizers: as in Horovod, the gradients are reduced where they are computed (``minimize``,
  ``compute_gradients``/``_compute_gradients``, ``get_gradients``); ``apply_gradients`` applies what it gets.

With ``backward_passes_per_step > 1`` gradients are summed locally and reduced every that many passes
(:mod:`perseus.tensorflow.gradient_aggregation`).

With Keras' SGD and a sparsifying compressor (``Compression.topk``...), the momentum moves into the compressor
(momentum correction, :mod:`perseus.tensorflow.keras_momentum`).

With ``op=Adasum`` nothing is reduced where gradients are computed: the optimizer applies each rank's own
gradients (summed locally over ``backward_passes_per_step`` passes) and the resulting updates are combined by
Adasum where they are applied (:mod:`perseus.tensorflow.adasum_optimizer`); registered local variables and
model-parallel shards keep their local update.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from perseus.runtime import guard as _guard
from perseus.runtime.process_sets import global_process_set
from perseus.base.reduce_ops import Adasum, Average, ReduceOp, Sum
from perseus.tensorflow.adasum_optimizer import apply_adasum, check_adasum_options, local_gradients_fn
from perseus.tensorflow.compression import Compression
from perseus.tensorflow.gradient_aggregation import LocalGradientAggregationHelper, is_model_parallel, var_key
from perseus.tensorflow.gradient_tape import _make_allreduce_grads_fn
from perseus.tensorflow.keras_momentum import local_step_for, plain_sgd_mixin, plain_step, sgd_kind

__all__ = ["distributed_optimizer", "create_distributed_optimizer", "distributed_class", "is_keras3_optimizer",
           "CallableList", "load_model", "check_keras_op", "no_auto_xla"]


class CallableList(list):
    """A list that can also be called (``opt.variables`` and ``opt.variables()`` both work)."""

    def __call__(self):
        return self


def is_keras3_optimizer(cls) -> bool:
    """True for Keras 3 optimizer classes (they have ``stateless_apply``), False for tf-keras 2 ones."""
    return hasattr(cls, "stateless_apply")


def check_keras_op(op):
    """``op`` as a ReduceOp: Keras optimizers reduce with Average, Sum or Adasum (ValueError otherwise)."""
    op = ReduceOp(op)
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"perseus: the Keras DistributedOptimizer supports op=Average, op=Sum or op=Adasum, not "
                         f"{op.name} (Min, Max and Product do not combine gradients)")
    return op


class _Settings:
    def __init__(self, name, device_dense, device_sparse, compression, sparse_as_dense, gradient_predivide_factor,
                 op, backward_passes_per_step, average_aggregated_gradients, groups, process_set,
                 scale_local_gradients):
        self.name = name
        self.device_dense, self.device_sparse = device_dense, device_sparse
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.gradient_predivide_factor = gradient_predivide_factor
        self.op = op
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = average_aggregated_gradients
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients


class _DistributedBase:
    """Set-up and the gradient reduction common to both Keras generations."""

    _HAS_AGGREGATE_GRAD = True
    _perseus = None  # a _Settings, set on the dynamic class
    _perseus_sgd = None  # the Keras SGD generation (keras_momentum.sgd_kind) when the class is an SGD

    def _perseus_setup(self):
        s = self._perseus
        scope = s.name or f"Distributed{type(self).__name__}"
        self._perseus_scope = scope
        if s.op == Adasum:  # the gradients stay local; _apply_step combines the updates
            self._allreduce_grads = local_gradients_fn(s.sparse_as_dense)
        else:
            self._allreduce_grads = _make_allreduce_grads_fn(scope, s.device_dense, s.device_sparse,
                                                             s.compression, s.sparse_as_dense, s.op,
                                                             s.gradient_predivide_factor, s.groups, s.process_set)
        self._local_vars = set()
        self.process_set = s.process_set
        self.scale_local_gradients = s.scale_local_gradients
        self._agg_helper = None
        if s.backward_passes_per_step > 1:
            self._agg_helper = LocalGradientAggregationHelper(
                s.backward_passes_per_step, self._reduce_global, s.average_aggregated_gradients,
                s.process_set.size, s.scale_local_gradients)

    def _reduce_global(self, grads, variables, local=None):
        """Reduce the global gradients ``grads``; ``local``: the compressor's momentum correction (a LocalStep)
        or None."""
        return self._allreduce_grads(grads, variables, local=local)

    def _momentum_step(self, variables):
        """The momentum correction for a step applying gradients of ``variables`` (None: the optimizer
        applies its own momentum); see perseus/tensorflow/keras_momentum.py."""
        helper_locals = self._agg_helper._local_vars if self._agg_helper else ()
        if self._local_vars or helper_locals or any(is_model_parallel(v) for v in variables):
            return None
        s = self._perseus
        return local_step_for(self, self._perseus_sgd, s.compression, s.process_set)

    def _keeps_local_update(self, var) -> bool:
        """Whether ``var``'s update stays this rank's own under op=Adasum (a registered local variable or a
        model-parallel shard)."""
        helper_locals = self._agg_helper._local_vars if self._agg_helper else ()
        key = var_key(var)
        return key in self._local_vars or key in helper_locals or is_model_parallel(var)

    def _apply_step(self, apply_fn, variables):
        """Run ``apply_fn()`` (the wrapped optimizer's apply of the gradients of ``variables``); with op=Adasum
        every rank's update is then combined by Adasum (collective). Returns what apply_fn or
        :func:`perseus.tensorflow.adasum_optimizer.apply_adasum` returns."""
        s = self._perseus
        if s.op != Adasum:
            return apply_fn()
        return apply_adasum(apply_fn, variables, s.compression, s.process_set, self._perseus_scope,
                            self._keeps_local_update)

    def register_local_var(self, var):
        """Keep ``var``'s gradient local to this rank (divided by the set size when ``scale_local_gradients``)."""
        if self._agg_helper:
            self._agg_helper.register_local_var(var)
        else:
            self._local_vars.add(var_key(var))

    def _allreduce(self, grads, variables, local=None):
        """Reduce ``grads`` (one per variable, None allowed) across the process set; local ones stay local.
        ``local``: the compressor's momentum correction (a LocalStep), or None."""
        grads, variables = list(grads), list(variables)
        if self._agg_helper:
            return self._agg_helper.compute_gradients(grads, variables, local)
        glob = [i for i, v in enumerate(variables)
                if var_key(v) not in self._local_vars and not is_model_parallel(v)]
        out = list(grads)
        for i, r in zip(glob, self._reduce_global([grads[i] for i in glob], [variables[i] for i in glob], local)):
            out[i] = r
        if self.scale_local_gradients and self._local_vars:
            n = float(self.process_set.size())
            for i, (g, v) in enumerate(zip(grads, variables)):
                if g is not None and var_key(v) in self._local_vars:
                    out[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape) \
                        if isinstance(g, tf.IndexedSlices) else g / n
        return out


class _Keras3Distributed(_DistributedBase):
    """Keras 3: ``apply`` reduces the gradients, then applies them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._perseus_setup()

    @property
    def variables(self):
        return CallableList(super().variables)

    def apply(self, grads, trainable_variables=None):
        """Reduce ``grads`` across the ranks, then apply them (Keras 3 ``Optimizer.apply``)."""
        import keras
        if keras.backend.backend() != "tensorflow":
            raise NotImplementedError(
                f"perseus: the Keras DistributedOptimizer supports the TensorFlow backend of Keras 3, not "
                f"'{keras.backend.backend()}'; use perseus.torch for PyTorch models")
        grads = list(grads)
        if not grads:
            return super().apply(grads, trainable_variables)
        if trainable_variables is None:
            variables = list(self._trainable_variables)
        else:
            trainable_variables = list(trainable_variables)
            variables = trainable_variables
            if not self.built:
                self.build(variables)
                self.built = True
        local = self._momentum_step(variables)
        reduced = self._allreduce(grads, variables, local)
        parent = super()

        def apply_now():
            return self._apply_step(lambda: parent.apply(reduced, trainable_variables), variables)
        with plain_step(self, local is not None):
            if self._agg_helper is None:
                return apply_now()

            def apply_cycle():
                apply_now()
                return tf.constant(True)
            return self._agg_helper.apply_gradients(apply_cycle, self)


class _Keras2Distributed(_DistributedBase):
    """tf-keras 2: gradients are reduced where they are computed, as Horovod does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._perseus_setup()
        #: the gradients last computed here went through the momentum correction (apply them plainly)
        self._perseus_corrected = False

    def _reduce_computed(self, grads, variables):
        """Reduce gradients this optimizer computed, with the momentum correction when it applies."""
        variables = list(variables)
        local = self._momentum_step(variables)
        self._perseus_corrected = local is not None
        return self._allreduce(grads, variables, local)

    def compute_gradients(self, loss, var_list, tape=None):
        """Compute the gradients of ``loss`` and reduce them across the ranks; a list of (grad, var)."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        tape = tf.GradientTape() if tape is None else tape
        parent = super()
        if hasattr(parent, "_compute_gradients"):
            grads_and_vars = parent._compute_gradients(loss, var_list, grad_loss, tape=tape)
        else:
            grads_and_vars = parent.compute_gradients(loss, var_list, tape=tape)
        grads, variables = zip(*grads_and_vars)
        return list(zip(self._reduce_computed(grads, variables), variables))

    def get_gradients(self, loss, params):
        """Legacy-optimizer gradients of ``loss``, reduced across the ranks."""
        return self._reduce_computed(super().get_gradients(loss, params), params)

    def apply_gradients(self, *args, **kwargs):
        """Apply (already reduced) gradients; with local aggregation only at the end of a cycle. Gradients
        computed by this optimizer with momentum correction are applied by a momentum-free SGD step. With
        op=Adasum the gradients are this rank's own, and every rank's update is combined after the apply
        (collective)."""
        corrected, self._perseus_corrected = self._perseus_corrected, False
        if args:
            args = (list(args[0]),) + tuple(args[1:])
        elif "grads_and_vars" in kwargs:
            kwargs["grads_and_vars"] = list(kwargs["grads_and_vars"])
        pairs = args[0] if args else kwargs.get("grads_and_vars", [])
        parent = super()

        def apply_now():
            return self._apply_step(lambda: parent.apply_gradients(*args, **kwargs), [v for _, v in pairs])
        with plain_step(self, corrected):
            if self._agg_helper is None:
                return apply_now()

            def apply_cycle():
                apply_now()
                return tf.constant(True)
            return self._agg_helper.apply_gradients(apply_cycle, self)


def _variables_is_property(cls) -> bool:
    for klass in cls.__mro__:
        if "variables" in klass.__dict__:
            return isinstance(klass.__dict__["variables"], property)
    return False


def _is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is a perseus DistributedOptimizer (or Keras' loss-scale wrapper of one)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return isinstance(optimizer, _DistributedBase) or isinstance(inner, _DistributedBase)


def no_auto_xla() -> None:
    """Keras 3: ``model.compile(jit_compile="auto")`` (the default) resolves to XLA when TensorFlow sees a GPU,
    and perseus's collectives cannot run under XLA. From the first Keras 3 DistributedOptimizer on, a model whose
    optimizer is a perseus DistributedOptimizer resolves "auto" to no XLA, and ``jit_compile=True`` raises
    NotImplementedError naming the fix; other models are left as Keras makes them. Idempotent."""
    try:
        from keras.src.trainers.trainer import Trainer
    except ImportError:  # (another Keras layout: nothing to adjust)
        return
    resolve = Trainer._resolve_auto_jit_compile
    if getattr(resolve, "_perseus", False):
        return

    def _resolve_auto_jit_compile(self):
        if _is_distributed(getattr(self, "optimizer", None)):
            return False
        return resolve(self)

    prop = Trainer.jit_compile

    def _set_jit_compile(self, value):
        if value and _is_distributed(getattr(self, "optimizer", None)):
            raise NotImplementedError(
                "perseus: this model's optimizer is a perseus DistributedOptimizer, whose collectives cannot run "
                "under XLA; compile with jit_compile=False (or leave the default, jit_compile='auto', which then "
                "means no XLA)")
        prop.fset(self, value)

    _resolve_auto_jit_compile._perseus = True
    Trainer._resolve_auto_jit_compile = _resolve_auto_jit_compile
    Trainer.jit_compile = property(prop.fget, _set_jit_compile, prop.fdel, prop.__doc__)


def distributed_class(cls, settings: _Settings):
    """The distributed subclass of optimizer class ``cls`` (same ``__name__`` and ``__module__``)."""
    keras3 = is_keras3_optimizer(cls)
    kind = sgd_kind(cls, keras3)
    if keras3:
        mixin = _Keras3Distributed
        body = {}
        no_auto_xla()
    else:
        mixin = _Keras2Distributed
        if _variables_is_property(cls):
            body = {"variables": property(lambda self: CallableList(super(mixin, self).variables))}
        else:
            body = {"variables": property(lambda self: CallableList(super(mixin, self).variables()))}
    body.update(_perseus=settings, _perseus_sgd=kind, __module__=cls.__module__, __qualname__=cls.__qualname__)
    plain = plain_sgd_mixin(kind)
    return type(cls.__name__, (mixin, plain, cls) if plain else (mixin, cls), body)


def create_distributed_optimizer(optimizer, name=None, device_dense='', device_sparse='', compression=None,
                                 sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                                 backward_passes_per_step=1, average_aggregated_gradients=False, groups=None,
                                 process_set=global_process_set, scale_local_gradients=True):
    """A new optimizer configured like ``optimizer`` whose gradients are reduced across ``process_set``.

    The result is built from ``optimizer.get_config()`` (its slot variables are not copied, as in Horovod).
    ``op=Adasum`` combines each rank's update instead of reducing gradients (module docstring).

    Raises:
        ValueError: an op other than Average, Sum or Adasum; ``gradient_predivide_factor`` with an op other
            than Average.
        NotImplementedError: ``op=Adasum`` with ``groups``, a communicating compressor, or an optimizer made
            with ``use_ema=True``.
    """
    _guard.refuse("the Keras DistributedOptimizer")
    op = check_keras_op(op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op == Adasum:
        check_adasum_options(compression, groups, gradient_predivide_factor)
        if getattr(optimizer, "use_ema", False):
            raise NotImplementedError("DistributedOptimizer(op=Adasum): use_ema is not supported (the moving "
                                      "average would follow each rank's local update); create the optimizer "
                                      "with use_ema=False")
    if groups is not None and not (isinstance(groups, list) or int(groups) > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of variables.")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    settings = _Settings(name, device_dense, device_sparse, compression or Compression.none, sparse_as_dense,
                         gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
                         groups, process_set, scale_local_gradients)
    cls = distributed_class(type(optimizer), settings)
    return cls.from_config(optimizer.get_config())


def distributed_optimizer(optimizer, name=None, device_dense='', device_sparse='', compression=None,
                          sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                          backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                          groups=None, process_set=global_process_set, scale_local_gradients=True):
    """:func:`create_distributed_optimizer` with Horovod's deprecated ``num_groups`` (a DeprecationWarning;
    it stands for ``groups`` when that is None). See perseus.tensorflow.keras.DistributedOptimizer."""
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed",
                      DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    return create_distributed_optimizer(optimizer, name, device_dense, device_sparse, compression,
                                        sparse_as_dense, gradient_predivide_factor, op, backward_passes_per_step,
                                        average_aggregated_gradients, groups, process_set, scale_local_gradients)


def load_model(keras, wrap_optimizer, optimizer_modules, filepath, custom_optimizers=None, custom_objects=None):
    """``keras.models.load_model`` whose optimizer comes back wrapped by ``wrap_optimizer(cls)``.

    Every optimizer class found in ``optimizer_modules`` (and ``custom_optimizers``) is registered under its
    class name and its lower-case name as a distributed subclass, so the saved optimizer configuration is
    deserialised straight into a DistributedOptimizer.
    """
    classes = {}
    for module in optimizer_modules:
        for value in vars(module).values():
            if isinstance(value, type) and hasattr(value, "get_config") and hasattr(value, "from_config") \
                    and "optimizer" in getattr(value, "__module__", "").lower():
                classes[value.__name__] = value
    for cls in custom_optimizers or []:
        classes[cls.__name__] = cls
    objects = {}
    for cls_name, cls in classes.items():
        try:
            wrapped = wrap_optimizer(cls)
        except (TypeError, ValueError):
            continue
        objects[cls_name] = wrapped
        objects[cls_name.lower()] = wrapped
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)
