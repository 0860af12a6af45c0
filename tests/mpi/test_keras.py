"""perseus.tensorflow.keras and perseus.keras (Keras 3) under mpirun: the DistributedOptimizer in model.fit and
in custom steps, local aggregation, partial reduction, callbacks, load_model, KerasState, value helpers and
errors. References come from a single-process run on the global batch, computed on every rank."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import perseus.keras as hvd_keras  # noqa: E402
import perseus.tensorflow.keras as hvd  # noqa: E402

pytestmark = pytest.mark.timeout(180)

R, N = None, None


@pytest.fixture(autouse=True)
def _ranks():
    global R, N
    R, N = hvd.rank(), hvd.size()


def make_model(seed=0, width=6):
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(width, activation="tanh"),
                              keras.layers.Dense(1)])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.uniform(-0.5, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    return model


def data(samples=48, seed=1):
    rng = np.random.RandomState(seed)
    return rng.randn(samples, 5).astype("float32"), rng.randn(samples, 1).astype("float32")


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


def assert_same_on_all_ranks(values):
    gathered = hvd.allgather(values[None])
    for other in gathered[1:]:
        np.testing.assert_array_equal(other, gathered[0])


def global_batch_order(samples, per_rank_batch):
    """Sample order of single-process training whose batch k is the union of every rank's batch k."""
    per = samples // N
    return np.concatenate([np.arange(k * per, (k + 1) * per).reshape(-1, per_rank_batch) for k in range(N)],
                          axis=1).ravel()


@pytest.mark.parametrize("make_opt", [lambda: keras.optimizers.SGD(0.05, momentum=0.9),
                                      lambda: keras.optimizers.Adam(0.01),
                                      lambda: keras.optimizers.RMSprop(0.01)], ids=["sgd", "adam", "rmsprop"])
def test_fit_matches_single_process_on_global_batch(make_opt):
    x, y = data(12 * N)
    per, bs = 12, 4
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(make_opt()), loss="mse")
    model.fit(x[R * per:(R + 1) * per], y[R * per:(R + 1) * per], batch_size=bs, epochs=3, shuffle=False,
              verbose=0)
    ref = make_model()
    ref.compile(optimizer=make_opt(), loss="mse")
    order = global_batch_order(len(x), bs)
    ref.fit(x[order], y[order], batch_size=bs * N, epochs=3, shuffle=False, verbose=0)
    assert_same_on_all_ranks(flat(model))
    np.testing.assert_allclose(flat(model), flat(ref), rtol=1e-4, atol=1e-5)


def test_wrapped_optimizer_keeps_class_name_and_config():
    opt = keras.optimizers.Adam(0.003, beta_1=0.8)
    wrapped = hvd.DistributedOptimizer(opt)
    assert type(wrapped).__name__ == "Adam" and isinstance(wrapped, keras.optimizers.Adam)
    assert type(wrapped).__module__ == type(opt).__module__
    assert wrapped.get_config() == opt.get_config()
    copy = type(wrapped).from_config(wrapped.get_config())
    assert copy.get_config() == opt.get_config() and hasattr(copy, "_allreduce_grads")
    assert callable(wrapped.variables) and isinstance(wrapped.variables, list)


def test_sum_op_and_predivide_in_custom_step():
    var = keras.Variable(np.zeros(3, "float32"))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum)
    grad = tf.constant(np.full(3, R + 1.0, "float32"))
    opt.apply([grad], [var])
    np.testing.assert_allclose(var.numpy(), -np.full(3, N * (N + 1) / 2.0))
    var2 = keras.Variable(np.zeros(3, "float32"))
    opt2 = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), gradient_predivide_factor=2.0)

    @tf.function
    def step():
        opt2.apply([grad], [var2])
    step()
    np.testing.assert_allclose(var2.numpy(), -np.full(3, (N + 1) / 2.0), rtol=1e-6)


@pytest.mark.parametrize("average", [True, False])
def test_backward_passes_per_step_aggregates_locally(average):
    passes = 3
    var = keras.Variable(np.zeros(2, "float32"))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=passes,
                                   average_aggregated_gradients=average)

    @tf.function
    def step(g):
        opt.apply([g], [var])

    mean_rank_grad = (N + 1) / 2.0
    for i in range(7):
        step(tf.constant([R + 1.0, 2.0 * (R + 1)]))
        cycles = (i + 1) // passes
        scale = 1.0 if average else float(passes)
        expect = -cycles * scale * np.array([mean_rank_grad, 2 * mean_rank_grad])
        np.testing.assert_allclose(var.numpy(), expect, rtol=1e-6)
        assert int(opt.iterations.numpy()) == i + 1
    assert int(opt._agg_helper.counter.numpy()) == 7 % passes


def test_partial_distributed_optimizer_keeps_local_layer_gradients():
    model = make_model(seed=R)  # different weights per rank: gradients differ
    local = model.layers[0]
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=[local])
    x, y = data(8, seed=R)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    reduced = opt._allreduce(grads, model.trainable_variables)
    local_ids = {id(v) for v in local.trainable_weights}
    for var, g, r in zip(model.trainable_variables, grads, reduced):
        if id(var) in local_ids:
            np.testing.assert_allclose(r.numpy(), g.numpy() / N, rtol=1e-6)
        else:
            everyone = hvd.allgather(g.numpy()[None])
            np.testing.assert_allclose(r.numpy(), np.asarray(everyone).mean(0), rtol=1e-5, atol=1e-7)


def test_broadcast_and_metric_average_callbacks():
    model = make_model(seed=10 + R)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = data(16, seed=R)
    root = N - 1
    root_start = flat(make_model(seed=10 + root))

    class Capture(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 1:
                self.second = flat(self.model)

        def on_epoch_end(self, epoch, logs=None):
            self.logs = dict(logs)

    capture = Capture()
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(root),
                                   hvd.callbacks.MetricAverageCallback(), capture])
    assert_same_on_all_ranks(capture.second)
    assert not np.allclose(capture.second, root_start)  # one step was taken from the root's weights
    assert_same_on_all_ranks(flat(model))
    losses = hvd.allgather(np.array([capture.logs["loss"]]))
    np.testing.assert_allclose(losses, losses[0])
    assert history.history["loss"][0] == pytest.approx(capture.logs["loss"])


def test_learning_rate_warmup_and_schedule():
    initial = 0.1 * N
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(initial)), loss="mse")
    seen = {}

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen[(self.epoch, batch)] = float(np.asarray(self.model.optimizer.learning_rate))

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    x, y = data(16)
    model.fit(x, y, batch_size=8, epochs=5, shuffle=False, verbose=0, callbacks=[
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=initial, warmup_epochs=2),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial, multiplier=0.5, start_epoch=2,
                                                   end_epoch=4),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial, multiplier=lambda e: 0.01, start_epoch=4),
        Record()])
    steps = 2
    assert len(seen) == 5 * steps
    for (epoch, batch), lr in seen.items():
        if epoch < 2:
            e = epoch + batch / steps + 1.0 / steps
            expect = initial / N * (e * (N - 1) / 2 + 1)
        elif epoch < 4:
            expect = initial * 0.5 ** (epoch - 2)
        else:
            expect = initial * 0.01
        assert lr == pytest.approx(expect, rel=1e-5), (epoch, batch)


def test_best_model_checkpoint_requires_a_path(tmp_path):
    cb = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = data(8)
    with pytest.raises(ValueError, match="filepath"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[cb])
    cb.filepath = str(tmp_path / f"best{R}.keras")
    model.fit(x, y, epochs=2, verbose=0, callbacks=[cb])
    assert os.path.exists(cb.filepath)


def test_load_model_rewraps_the_optimizer(tmp_path):
    x, y = data(16)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / f"model{R}.keras")
    model.save(path)
    plain = keras.models.load_model(path)  # loads without perseus
    assert type(plain.optimizer).__name__ == "Adam" and not hasattr(plain.optimizer, "_allreduce_grads")
    loaded = hvd.load_model(path)
    assert type(loaded.optimizer).__name__ == "Adam" and hasattr(loaded.optimizer, "_allreduce_grads")
    np.testing.assert_array_equal(flat(loaded), flat(model))
    loaded.fit(x[R::N], y[R::N], batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_same_on_all_ranks(flat(loaded))


def test_keras_state_sync_commit_restore():
    model = make_model(seed=20 + R)
    opt = keras.optimizers.Adam(0.01)
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    state = hvd.elastic.KerasState(model, opt, batch=5 + R, epoch=R)
    state.sync()
    np.testing.assert_array_equal(flat(model), flat(make_model(seed=20)))
    assert (state.batch, state.epoch) == (5, 0)
    committed = flat(model)
    model.set_weights([w + 1 for w in model.get_weights()])
    state.batch = 9
    state.restore()
    np.testing.assert_array_equal(flat(model), committed)
    assert state.batch == 5
    model.set_weights([w * 2 for w in model.get_weights()])
    state.commit()
    model.set_weights([w * 0 for w in model.get_weights()])
    state.restore()
    np.testing.assert_array_equal(flat(model), committed * 2)


def test_value_helpers():
    np.testing.assert_allclose(hvd.allreduce(np.full(3, R + 1.0)), np.full(3, (N + 1) / 2))
    np.testing.assert_allclose(hvd_keras.allreduce(np.full(2, R + 1.0), op=hvd.Sum), np.full(2, N * (N + 1) / 2))
    np.testing.assert_array_equal(hvd.allgather(np.array([[R]])), np.arange(N).reshape(N, 1))
    np.testing.assert_array_equal(hvd.broadcast(np.array([R, R]), root_rank=N - 1), [N - 1, N - 1])
    out = hvd.reducescatter(np.ones((N * 2, 2)) * (R + 1), op=hvd.Sum)
    np.testing.assert_allclose(out, np.full((2, 2), N * (N + 1) / 2))


def test_unsupported_ops_and_backends_are_clear_errors():
    import perseus.tensorflow as hvd_tf

    with pytest.raises(ValueError, match="op=Average, op=Sum or op=Adasum"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd_tf.Min)
    with pytest.raises(ValueError, match="predivide"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(RuntimeError, match="eager"):
        hvd.broadcast_global_variables(0)


def test_mismatched_models_fail_on_every_rank():
    model = make_model(width=4 + R)  # ranks disagree about the gradient shapes
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = data(8)
    with pytest.raises(tf.errors.FailedPreconditionError):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    # The engine is still usable afterwards.
    np.testing.assert_allclose(hvd.allreduce(np.ones(2), op=hvd.Sum), np.full(2, N))


def test_broadcast_variables_accepts_keras_variables():
    import perseus.tensorflow as hvd_tf
    model = make_model(seed=30 + R)
    hvd_tf.broadcast_variables(model.variables, root_rank=0)
    np.testing.assert_array_equal(flat(model), flat(make_model(seed=30)))


def test_broadcast_keras_variables_in_tf_function_as_horovods_tf2_example():
    # Horovod's tensorflow2_synthetic_benchmark.py: inside a tf.function, after the first step, broadcast
    # model.variables and opt.variables() (a Keras 2 call; Keras 3 made it a property).
    import perseus.tensorflow as hvd_tf
    model = make_model(seed=40 + R)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    x, y = data(8, seed=41 + R)

    @tf.function
    def step(first_batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd_tf.broadcast_variables(model.variables, root_rank=0)
            hvd_tf.broadcast_variables(opt.variables(), root_rank=0)

    step(True)
    assert isinstance(opt.variables, list) and opt.variables() == list(opt.variables)
    step(False)
    assert_same_on_all_ranks(flat(model))
    assert_same_on_all_ranks(np.concatenate([np.ravel(v.numpy()) for v in opt.variables]))


def test_broadcast_keras_variables_in_a_tf1_graph():
    import perseus.tensorflow as hvd_tf
    graph = tf.Graph()
    with graph.as_default():
        variables = [keras.Variable(np.full((3,), R, np.float32)), keras.Variable(np.full((2, 2), 10 + R))]
        assign = hvd_tf.broadcast_variables(variables, root_rank=N - 1)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(assign)
            values = sess.run([tf.convert_to_tensor(v) for v in variables])
    np.testing.assert_array_equal(values[0], np.full((3,), N - 1, np.float32))
    np.testing.assert_array_equal(values[1], np.full((2, 2), 10 + N - 1))


def test_compile_accepts_keras2_run_tf_function_argument():
    # Horovod's Keras examples pass experimental_run_tf_function=False, which Keras 3 alone rejects.
    model = make_model(seed=50)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  experimental_run_tf_function=False)
    x, y = data(16, seed=51 + R)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert_same_on_all_ranks(flat(model))
    with pytest.raises(TypeError, match="no_such_argument"):
        model.compile(optimizer="sgd", loss="mse", no_such_argument=True)


def test_optimizer_lr_is_keras2s_name_of_learning_rate():
    # Horovod's elastic examples rescale the rate after a reset with opt.lr.assign(...), a Keras 2 spelling.
    opt = keras.optimizers.SGD(0.1)
    opt.lr.assign(0.25)
    assert float(opt.learning_rate) == pytest.approx(0.25) and float(opt.lr) == pytest.approx(0.25)
    opt.lr = 0.5
    assert float(opt.learning_rate) == pytest.approx(0.5)


def test_default_jit_compile_on_a_machine_with_a_gpu_trains(monkeypatch):
    """Keras 3 resolves compile(jit_compile="auto") to XLA when TensorFlow lists a GPU; with a perseus optimizer it
    resolves to no XLA and fit trains, other models keep Keras' choice, and jit_compile=True says what to do.
    (TensorFlow is made to list a GPU on this CPU machine.)"""
    real = tf.config.list_physical_devices

    def with_a_gpu(device_type=None):
        devices = real(device_type)
        if device_type in (None, "GPU"):
            devices = list(devices) + [tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")]
        return devices
    monkeypatch.setattr(tf.config, "list_physical_devices", with_a_gpu)
    plain = make_model()
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    assert plain.jit_compile is True, "the simulated GPU did not make Keras choose XLA"
    x, y = data(12)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    assert model.jit_compile is False
    before = flat(model)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert not np.allclose(flat(model), before)
    assert_same_on_all_ranks(flat(model))
    with pytest.raises(NotImplementedError, match="jit_compile=False"):
        make_model().compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse",
                             jit_compile=True)
