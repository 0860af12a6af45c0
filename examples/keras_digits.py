"""Train a small Keras classifier on scikit-learn's digits with model.fit, data-parallel, the Horovod way.

    perseusrun -np 2 python examples/keras_digits.py        (or: mpirun -np 2 python ...)

Each rank fits on its shard of the training set. The DistributedOptimizer averages gradients across ranks
every step; callbacks broadcast rank 0's initial state, warm the learning rate up from lr/size to lr (the
global batch is size times larger), average the epoch metrics over ranks, and rank 0 keeps the best model.
Works with Keras 3 (TensorFlow backend) and, with TF_USE_LEGACY_KERAS=1 and tf-keras installed, tf-keras 2.
The data ships with scikit-learn (no download).
"""

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import perseus.tensorflow.keras as hvd  # noqa: E402

keras = tf.keras


def build_model():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.002, help="for the global batch")
    parser.add_argument("--warmup-epochs", type=int, default=2)
    args = parser.parse_args()

    hvd.init()
    tf.random.set_seed(1000 + hvd.rank())  # different initial weights per rank: the broadcast must fix them
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int64")
    perm = np.random.RandomState(0).permutation(len(x))
    x_train, y_train = x[perm[:1500]], y[perm[:1500]]
    x_test, y_test = x[perm[1500:]], y[perm[1500:]]
    shard = slice(hvd.rank(), None, hvd.size())

    model = build_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(args.lr))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=args.lr, warmup_epochs=args.warmup_epochs),
        hvd.callbacks.MetricAverageCallback(),
    ]
    best_path = None
    if hvd.rank() == 0:
        best_path = os.path.join(tempfile.mkdtemp(), "best.keras")
        callbacks.append(hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=best_path))

    start = time.perf_counter()
    history = model.fit(x_train[shard], y_train[shard], batch_size=args.batch_size, epochs=args.epochs,
                        validation_data=(x_test[shard], y_test[shard]), callbacks=callbacks,
                        verbose=0, shuffle=True)
    elapsed = time.perf_counter() - start
    if hvd.rank() == 0:
        for epoch, (loss, acc, val) in enumerate(zip(history.history["loss"], history.history["accuracy"],
                                                     history.history["val_accuracy"])):
            print(f"epoch {epoch + 1}: train loss {loss:.4f} train accuracy {acc:.3f} test accuracy {val:.3f}")
        print(f"throughput {len(x_train) * args.epochs / elapsed:.0f} samples/s over {hvd.size()} rank(s); "
              f"best model saved: {os.path.exists(best_path)}")

    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    gathered = hvd.allgather(weights[None])
    identical = all(np.array_equal(g, gathered[0]) for g in gathered)
    if hvd.rank() == 0:
        print(f"weights identical on all {hvd.size()} ranks: {identical}")
    if not identical:
        raise SystemExit("model weights differ between ranks")


if __name__ == "__main__":
    main()
