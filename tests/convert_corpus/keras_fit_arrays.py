"""Keras model.fit on NumPy arrays: an optimizer object passed to compile, a log of the final loss."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras


def build_model():
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(1),
    ])


def main():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(8)
    rng = np.random.RandomState(8)
    x_train = rng.randn(256, 6).astype("float32")
    y_train = (x_train @ rng.randn(6, 1)).astype("float32")
    model = build_model()
    optimizer = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x_train, y_train, batch_size=int(os.environ.get("BATCH_SIZE", "32")), epochs=2,
                        shuffle=False, verbose=2)
    print("final loss", history.history["loss"][-1])
    out = os.environ.get("CORPUS_PARAMS_OUT")
    if out:
        np.savez(out.format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")), *model.get_weights())


if __name__ == "__main__":
    main()
