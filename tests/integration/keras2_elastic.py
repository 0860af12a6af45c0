"""The Keras elastic path with tf-keras 2 (run under TF_USE_LEGACY_KERAS=1 by test_keras2.py, on 2 or
more ranks): KerasState made from a compiled model whose optimizer has no slots yet, a collective that fails on
every rank in the first batches, and the retry loop going back to the state the job started from.

Checks a tf-keras 2 optimizer and a legacy one; prints one "<name> OK" line per check on rank 0.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow import keras  # noqa: E402

import perseus.tensorflow.keras as hvd  # noqa: E402


def make_model(seed):
    model = keras.Sequential([keras.layers.Dense(6, activation="tanh", input_shape=(4,)), keras.layers.Dense(2)])
    rng = np.random.RandomState(seed)
    model.set_weights([rng.uniform(-0.5, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    return model


def values(variables):
    return np.concatenate([np.ravel(np.asarray(v.numpy(), np.float64)) for v in variables])


def same_on_every_rank(array):
    gathered = hvd.allgather(np.asarray(array)[None])
    for other in gathered[1:]:
        np.testing.assert_array_equal(other, gathered[0])


def check(name, make_optimizer):
    r = hvd.rank()
    model = make_model(seed=10 + r)
    model.compile(optimizer=hvd.DistributedOptimizer(make_optimizer()), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0)
    slots = state._variables()[len(model.variables):]
    assert len(slots) > len(model.trainable_variables), slots  # iterations and one slot per weight at least
    initial = values(slots)
    rng = np.random.RandomState(r)
    x, y = rng.randn(8, 4).astype("float32"), rng.randn(8, 2).astype("float32")
    attempts = []

    class FailOnce(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1 and len(attempts) == 1:
                hvd.allreduce(np.ones(2 + r, np.float32), name=f"keras2_elastic.{name}.mismatch")

    @hvd.elastic.run
    def train(state):
        attempts.append((values(model.variables), values(state._variables()[len(model.variables):])))
        model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[FailOnce()])

    train(state)
    assert len(attempts) == 2, attempts
    np.testing.assert_array_equal(attempts[1][0], values(make_model(seed=10).variables))  # rank 0's start
    np.testing.assert_array_equal(attempts[1][1], initial)  # iterations 0, the slots' initial values
    assert int(model.optimizer.iterations.numpy()) == 4
    same_on_every_rank(values(model.variables))
    if r == 0:
        print(f"{name} OK", flush=True)


def main():
    hvd.init()
    assert keras.optimizers.Adam.__module__.startswith("tf_keras"), keras.optimizers.Adam  # tf-keras 2, not Keras 3
    check("adam", lambda: keras.optimizers.Adam(0.01))
    check("legacy_sgd_momentum", lambda: keras.optimizers.legacy.SGD(0.05, momentum=0.9))
    hvd.shutdown()


if __name__ == "__main__":
    main()
