"""perseus.tensorflow.elastic and the Keras elastic path under mpirun: TensorFlowState and TensorFlowKerasState
(sync from rank 0, commit, restore, optimizer slots, extra values), reset callbacks, host-update checks, and the
run() retry loop recovering from a collective that failed on every rank, in a custom loop (eagerly and in a
tf.function) and in model.fit with the elastic callbacks. References are the same training without a failure."""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import perseus.tensorflow as hvd  # noqa: E402
import perseus.tensorflow.elastic as elastic  # noqa: E402
import perseus.tensorflow.keras as hvd_keras  # noqa: E402
from perseus.base.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: E402
from perseus.elastic import state as common_elastic  # noqa: E402
from perseus.elastic.state import HostUpdateResult  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def no_limit_override(monkeypatch):
    monkeypatch.delenv(common_elastic.RESET_LIMIT_ENV, raising=False)


def values(variables):
    """The variables' values, flattened and joined (float64), for comparing across ranks and commits."""
    return np.concatenate([np.ravel(np.asarray(v.numpy(), np.float64)) for v in variables])


def assert_everyone_has(array):
    """Every rank's ``array`` equals rank 0's, exactly; returns rank 0's."""
    gathered = hvd.allgather_object(np.asarray(array))
    for r, other in enumerate(gathered):
        np.testing.assert_array_equal(other, gathered[0], err_msg=f"rank {r} differs from rank 0")
    return gathered[0]


def make_model(seed):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.uniform(-0.5, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    return model


def batch_for(step, rank, n=8):
    rng = np.random.RandomState(1000 * step + rank)
    return rng.randn(n, 4).astype("float32"), rng.randn(n, 2).astype("float32")


def local_adam_steps(variables, optimizer, count, seed):
    """``count`` Adam steps on rank-local gradients (so that weights, slots and iterations differ by rank)."""
    for step in range(count):
        rng = np.random.RandomState(seed + step)
        optimizer.apply_gradients([(tf.constant(rng.randn(*v.shape).astype("float32")), v) for v in variables])


# ----------------------------------------------------------------------------- TensorFlowState


def test_tensorflow_state_sync_commit_restore_with_optimizer_slots():
    r = hvd.rank()
    w = tf.Variable(np.full((3, 2), 1.0 + r, np.float32))
    b = tf.Variable(np.full((2,), -1.0 - r, np.float32))
    opt = keras.optimizers.Adam(0.01)
    opt.build([w, b])
    local_adam_steps([w, b], opt, r + 1, seed=10 * r)  # rank r has done r + 1 steps
    kept = [w, b] + list(opt.variables)
    state = elastic.TensorFlowState(kept, epoch=10 + r, batch=20 + r, tags=[f"r{r}"])

    state.sync()
    synced = assert_everyone_has(values(kept))
    assert (state.epoch, state.batch, state.tags) == (10, 20, ["r0"])
    assert int(opt.iterations.numpy()) == 1  # rank 0's step count, with its slots
    assert np.any(synced[:8] != 1.0)  # weights moved by rank 0's step: not the initial values

    # restore() after uncommitted training puts the synced values back, slots included.
    local_adam_steps([w, b], opt, 2, seed=50 + r)
    state.epoch, state.tags = 99, ["changed"]
    state.restore()
    np.testing.assert_array_equal(values(kept), synced)
    assert (state.epoch, state.tags) == (10, ["r0"]) and int(opt.iterations.numpy()) == 1

    # commit() moves the restore point; restore() goes back to it, not to the sync.
    local_adam_steps([w, b], opt, 1, seed=70)
    state.epoch, state.batch = 11, 0
    state.commit()
    committed = values(kept)
    assert int(opt.iterations.numpy()) == 2
    local_adam_steps([w, b], opt, 3, seed=80)
    state.epoch = 12
    state.restore()
    np.testing.assert_array_equal(values(kept), committed)
    assert (state.epoch, state.batch) == (11, 0) and int(opt.iterations.numpy()) == 2
    assert_everyone_has(values(kept))


def test_tensorflow_state_payload_round_trip_on_another_rank():
    """What a rank commits (snapshot_payload) restores any rank's state (load_snapshot_payload + restore), as
    the elastic launcher's keepers use it."""
    r = hvd.rank()
    v = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r)
    state = elastic.TensorFlowState([v], step=r)
    state.commit()
    payload = hvd.broadcast_object(state.snapshot_payload(), root_rank=hvd.size() - 1)
    v.assign(tf.zeros_like(v))
    state.step = -1
    state.load_snapshot_payload(payload)
    np.testing.assert_array_equal(v.numpy(), 0.0)  # nothing put in place until restore()
    state.restore()
    np.testing.assert_array_equal(v.numpy(), np.arange(6).reshape(2, 3) + 10 * (hvd.size() - 1))
    assert state.step == hvd.size() - 1


# ----------------------------------------------------------------------------- TensorFlowKerasState


@pytest.mark.parametrize("keras_state", [elastic.TensorFlowKerasState, hvd_keras.elastic.KerasState],
                         ids=["TensorFlowKerasState", "keras.elastic.KerasState"])
def test_keras_state_keeps_model_and_optimizer(keras_state):
    r = hvd.rank()
    model = make_model(seed=20 + r)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    x, y = batch_for(0, r)
    model.fit(x, y, batch_size=4, epochs=r + 1, shuffle=False, verbose=0)  # 2 * (r + 1) local steps
    opt = model.optimizer
    everything = lambda: values(list(model.variables) + list(opt.variables))  # noqa: E731
    state = keras_state(model, epoch=r, batch=5 + r)
    assert state.optimizer is opt

    state.sync()
    synced = assert_everyone_has(everything())
    assert (state.epoch, state.batch) == (0, 5) and int(opt.iterations.numpy()) == 2
    momenta = [v for v in opt.variables if v is not opt.iterations and "momentum" in v.path]
    assert momenta and all(np.any(m.numpy() != 0) for m in momenta)  # slots came along, not just weights

    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    state.batch = 9
    state.restore()
    np.testing.assert_array_equal(everything(), synced)
    assert state.batch == 5

    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    state.epoch = 1
    state.commit()
    committed = everything()
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    state.restore()
    np.testing.assert_array_equal(everything(), committed)
    assert state.epoch == 1 and int(opt.iterations.numpy()) == 3


def test_tensorflow_states_reject_what_they_cannot_keep():
    model = keras.Sequential([keras.layers.Dense(2)])  # no input shape: not built
    with pytest.raises(ValueError, match="must be built"):
        elastic.TensorFlowKerasState(model)
    with pytest.raises(ValueError, match="needs the list of variables"):
        elastic.TensorFlowState()
    with pytest.raises(NotImplementedError, match="TF1 sessions"):
        elastic.TensorFlowState([tf.Variable(1.0)], session=object())


@pytest.mark.parametrize("make_optimizer", [lambda: keras.optimizers.Adam(0.01),
                                            lambda: keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.5)],
                         ids=["adam", "adagrad"])
def test_keras_state_with_a_lazily_built_optimizer_recovers_before_its_first_commit(make_optimizer):
    """As Horovod's Keras elastic examples do: the state is made from a compiled model whose optimizer has no
    slots yet; a collective fails in the first batches, before any commit. The job goes back to the state it
    started from, slots included (their initial values), instead of failing on the slots made meanwhile."""
    model = make_model(seed=60 + hvd.rank())
    model.compile(optimizer=hvd_keras.DistributedOptimizer(make_optimizer()), loss="mse")
    state = hvd_keras.elastic.KerasState(model, batch=0)
    x, y = batch_for(3, hvd.rank())
    attempts = []

    class FailOnce(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1 and len(attempts) == 1:
                hvd.allreduce(tf.ones([2 + hvd.rank()]), name="elastic_tf.first_batches_mismatch")

    @hvd_keras.elastic.run
    def train(state):
        attempts.append((values(model.variables), values(model.optimizer.variables)))
        model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[FailOnce()])

    train(state)
    assert len(attempts) == 2
    np.testing.assert_array_equal(attempts[1][0], values(make_model(seed=60).variables))  # rank 0's start
    fresh = make_optimizer()
    fresh.build(model.trainable_variables)
    np.testing.assert_allclose(attempts[1][1], values(fresh.variables))  # iterations 0, initial slots
    assert int(model.optimizer.iterations.numpy()) == 4
    assert_everyone_has(values(model.variables))


# ----------------------------------------------------------------------------- host updates, reset callbacks


def test_check_host_updates_is_decided_by_rank_0():
    state = elastic.TensorFlowState([tf.Variable([1.0, 2.0])], epoch=0)
    for _ in range(3):
        state.commit()  # nothing happened: no rank raises

    if hvd.rank() == hvd.size() - 1 and hvd.size() > 1:  # only a non-zero rank was told: nobody raises
        state.on_hosts_updated(5, HostUpdateResult.added)
    state.check_host_updates()

    if hvd.rank() == 0:  # rank 0 was told hosts were added: every rank raises, and must sync afterwards
        state.on_hosts_updated(7, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.commit()
    assert info.value.skip_sync is False
    if hvd.rank() == 0:
        state.on_hosts_updated(8, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.check_host_updates()
    assert info.value.skip_sync is True
    assert assert_everyone_has(np.array([state._last_updated_timestamp])) == [8]
    state.check_host_updates()  # an update is reported once


def test_run_resets_on_every_rank_after_a_host_update_and_calls_back_in_order():
    v = tf.Variable(np.full((2,), float(hvd.rank()), np.float32))
    state = elastic.TensorFlowState([v], step=0)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(("first", hvd.is_initialized(), hvd.size())),
                                    lambda: calls.append(("second", hvd.is_initialized(), hvd.size()))])
    attempts = []

    @elastic.run
    def train(state):
        attempts.append((state.step, values([v])))
        while state.step < 4:
            v.assign_add(tf.ones_like(v))
            state.step += 1
            if state.step == 2 and len(attempts) == 1 and hvd.rank() == 0:
                state.on_hosts_updated(1.0, HostUpdateResult.added)
            state.commit()
        return state.step

    assert train(state) == 4
    assert calls == [("first", True, hvd.size()), ("second", True, hvd.size())]
    assert len(attempts) == 2 and attempts[1][0] == 2  # hosts changed: the state is kept, not rolled back
    np.testing.assert_array_equal(attempts[1][1], [2.0, 2.0])  # and synced from rank 0 (an added host)
    np.testing.assert_array_equal(assert_everyone_has(values([v])), [4.0, 4.0])


# ----------------------------------------------------------------------------- run() with a custom loop


def make_training():
    model = make_model(seed=hvd.rank())  # different start on every rank: the first sync fixes that
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return model, opt, step


def train_reference(steps):
    model, opt, step = make_training()
    hvd.broadcast_variables(model.variables, root_rank=0)
    for s in range(steps):
        step(*batch_for(s, hvd.rank()))
    return values(model.variables)


@tf.function
def mismatched_allreduce():
    """A collective whose shape differs by rank: it fails on every rank, inside a graph."""
    return hvd.allreduce(tf.ones([2 + hvd.rank()]), name="elastic_tf.graph_mismatch")


@pytest.mark.parametrize("failure", ["raised", "mismatch_eager", "mismatch_in_tf_function"])
def test_run_recovers_a_custom_loop_from_the_last_commit(failure):
    steps, fail_at, commit_every = 9, 6, 2
    reference = train_reference(steps)

    model, opt, step = make_training()
    kept = list(model.variables) + list(opt.variables)
    state = elastic.TensorFlowState(kept, batch=0, commits=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.is_initialized())])
    attempts, commits = [], {}

    @elastic.run
    def train(state):
        attempts.append((state.batch, state.commits, values(kept)))
        while state.batch < steps:
            if state.batch == fail_at and len(attempts) == 1:
                step(*batch_for(state.batch, hvd.rank()))  # an uncommitted step, to be undone
                if failure == "raised":
                    raise HorovodInternalError("simulated failed collective")
                if failure == "mismatch_eager":
                    hvd.allreduce(tf.ones([2 + hvd.rank()]), name="elastic_tf.eager_mismatch")
                else:
                    mismatched_allreduce()
                raise AssertionError("the mismatched allreduce should have failed")
            step(*batch_for(state.batch, hvd.rank()))
            state.batch += 1
            if state.batch % commit_every == 0:
                state.commits += 1
                state.commit()
                commits[state.batch] = values(kept)
        return state.batch

    assert train(state) == steps
    assert len(attempts) == 2 and resets == [True]
    batch, ncommits, restored = attempts[1]
    last_commit = fail_at // commit_every * commit_every
    assert (batch, ncommits) == (last_commit, last_commit // commit_every)
    np.testing.assert_array_equal(restored, commits[last_commit])  # weights and momenta of the last commit
    assert_everyone_has(restored)
    final = assert_everyone_has(values(model.variables))
    np.testing.assert_allclose(final, reference, rtol=1e-6, atol=1e-6)
    out = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="elastic_tf.after")
    np.testing.assert_array_equal(out.numpy(), [hvd.size()] * 2)


def test_run_gives_up_after_the_reset_limit_on_every_rank(monkeypatch):
    monkeypatch.setenv(common_elastic.RESET_LIMIT_ENV, "1")
    state = elastic.TensorFlowState([tf.Variable(0.0)], epoch=hvd.rank())
    attempts = []

    @elastic.run
    def train(state):
        attempts.append(state.epoch)
        mismatched_allreduce()

    with pytest.raises(HorovodInternalError) as info:
        train(state)
    assert attempts == [0, 0]
    assert "giving up after 1 reset(s)" in str(info.value)
    out = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="elastic_tf.after_limit")
    np.testing.assert_array_equal(out.numpy(), [hvd.size()] * 2)


def test_run_does_not_retry_errors_of_the_training_code():
    state = elastic.TensorFlowState([tf.Variable(0.0)])
    attempts = []

    @elastic.run
    def train(state):
        attempts.append(1)
        tf.reshape(tf.ones([3]), [2])  # a TensorFlow error that is no collective's

    with pytest.raises(tf.errors.InvalidArgumentError):
        train(state)
    assert attempts == [1]


# ----------------------------------------------------------------------------- run() with model.fit


def fit_job(epochs, fail=None):
    """model.fit under elastic.run with the elastic callbacks, committing at the end of every epoch; ``fail``
    (epoch, batch): a collective that fails on every rank there, in the first attempt. Returns the final
    weights, the attempts' (epoch, weights) at their start, and the committed weights by epoch."""
    model = make_model(seed=100 + hvd.rank())
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    model.optimizer.build(model.trainable_variables)
    state = hvd_keras.elastic.KerasState(model, epoch=0, batch=0)
    x, y = batch_for(7, hvd.rank(), n=16)
    attempts, commits = [], {}

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if fail == (state.epoch, batch) and len(attempts) == 1:
                hvd.allreduce(tf.ones([2 + hvd.rank()]), name="elastic_tf.fit_mismatch")

        def on_epoch_end(self, epoch, logs=None):
            commits[state.epoch] = values(model.variables)

    callbacks = [hvd_keras.elastic.UpdateBatchStateCallback(state), hvd_keras.elastic.UpdateEpochStateCallback(state),
                 hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=1000), Probe()]

    @hvd_keras.elastic.run
    def train(state):
        attempts.append((state.epoch, values(model.variables)))
        model.fit(x, y, batch_size=4, epochs=epochs - state.epoch, shuffle=False, verbose=0, callbacks=callbacks)

    train(state)
    assert state.epoch == epochs
    return assert_everyone_has(values(model.variables)), attempts, commits


def test_run_resumes_model_fit_at_the_last_committed_epoch():
    epochs = 4
    reference, _, _ = fit_job(epochs)
    final, attempts, commits = fit_job(epochs, fail=(2, 1))
    assert [a[0] for a in attempts] == [0, 2]  # the second attempt starts after the 2 committed epochs
    np.testing.assert_array_equal(attempts[1][1], commits[2])
    assert_everyone_has(attempts[1][1])
    np.testing.assert_allclose(final, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("module", ["perseus.tensorflow.keras.elastic", "perseus.keras.elastic"])
def test_elastic_callbacks_commit_every_n_batches_and_at_epoch_ends(module):
    el = importlib.import_module(module)
    model = make_model(seed=5)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    state = el.KerasState(model, epoch=0, batch=0)
    commits = []
    commit = state.commit
    state.commit = lambda: (commits.append((state.epoch, state.batch)), commit())
    x, y = batch_for(9, hvd.rank())  # 8 samples: 4 batches of 2 per epoch
    model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0,
              callbacks=[el.UpdateBatchStateCallback(state), el.UpdateEpochStateCallback(state),
                         el.CommitStateCallback(state, batches_per_commit=3)])
    # Every 3rd batch across the epochs (batch 2 of epoch 0, batch 1 of epoch 1), and at each epoch's end.
    assert commits == [(0, 2), (1, 0), (1, 1), (2, 0)]
    assert (state.epoch, state.batch) == (2, 0)
