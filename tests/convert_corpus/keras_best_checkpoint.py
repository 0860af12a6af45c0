"""Keras digits classifier: a ModelCheckpoint callback keeps the best model (lowest validation loss), which is
loaded back with load_model for the final test; the last weights are saved, then loaded into a fresh model."""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402


def build_model():
    return tf.keras.Sequential([
        tf.keras.Input((64,)),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])


def main():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.keras.utils.set_random_seed(13)
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, y_train = x[:256], y[:256]
    x_val, y_val = x[256:768], y[256:768]
    x_test, y_test = x[768:], y[768:]
    model = build_model()
    model.compile(optimizer=tf.keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    folder = tempfile.mkdtemp()
    best_path = os.path.join(folder, "best.keras")
    model.fit(x_train, y_train, batch_size=int(os.environ.get("BATCH_SIZE", "32")), epochs=14, shuffle=False,
              validation_data=(x_val, y_val), verbose=2,
              callbacks=[tf.keras.callbacks.ModelCheckpoint(best_path, monitor="val_loss", save_best_only=True)])
    last_path = os.path.join(folder, "last.weights.h5")
    model.save_weights(last_path)

    best = tf.keras.models.load_model(best_path)
    test_loss, test_acc = best.evaluate(x_test, y_test, verbose=0)
    print(f"best model: test loss {test_loss:.4f} acc {test_acc:.3f}")
    fresh = build_model()
    fresh.load_weights(last_path)
    out = os.environ.get("CORPUS_PARAMS_OUT")
    if out:
        np.savez(out.format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
                 *best.get_weights(), *fresh.get_weights())


if __name__ == "__main__":
    main()
