"""Train a small Keras classifier on scikit-learn's digits with a TF2 custom training loop, data-parallel.

    perseusrun -np 2 python examples/tensorflow2_digits.py      (or: mpirun -np 2 python ...)

Each rank trains on its own shard of the training set; ``hvd.DistributedGradientTape`` averages the
gradients across ranks inside a ``tf.function`` step; rank 0 prints the loss, test accuracy and throughput
(averaged over ranks with ``hvd.allreduce``). At the end every rank checks that all ranks hold the same
weights and exits with an error if they do not. The data ships with scikit-learn (no download).
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's start-up banner out of the output

import numpy as np
import tensorflow as tf
import keras
from sklearn.datasets import load_digits

import perseus.tensorflow as hvd


def build_model():
    return keras.Sequential([
        keras.Input(shape=(8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def tf_variables(variables):
    """The tf.Variable inside each Keras 3 variable (``.value``). Handing tf.Variable objects to the tape and
    to broadcast_variables keeps the script runnable on horovod.tensorflow too, which takes no Keras 3
    variables there."""
    return [v.value if isinstance(v, keras.Variable) else v for v in variables]


def load_shards(rank, size):
    """This rank's share of a fixed 1500/297 train/test split (same split on every rank)."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(x))
    train, test = perm[:1500], perm[1500:]
    # Every rank gets the same number of training samples, so every rank runs the same number of steps
    # (each step is a collective: a rank with an extra step would wait for peers that never come).
    per_rank = len(train) // size
    mine = train[rank::size][:per_rank]
    return (x[mine], y[mine]), (x[test[rank::size]], y[test[rank::size]])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by the number of ranks")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    hvd.init()
    # One compute thread per rank: the ranks share the machine's cores.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    # Seeded differently on each rank on purpose: the broadcast below is what makes the ranks agree.
    keras.utils.set_random_seed(args.seed + hvd.rank())

    (x_train, y_train), (x_test, y_test) = load_shards(hvd.rank(), hvd.size())
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shuffle(len(x_train), seed=args.seed + hvd.rank(), reshuffle_each_iteration=True)
             .batch(args.batch_size, drop_remainder=True))
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(256)

    model = build_model()
    optimizer = keras.optimizers.SGD(learning_rate=args.lr * hvd.size(), momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        # The wrapped tape returns gradients averaged over all ranks.
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, tf_variables(model.trainable_variables))
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def eval_step(images, labels):
        predicted = tf.argmax(model(images, training=False), axis=1)
        return tf.reduce_sum(tf.cast(tf.equal(predicted, labels), tf.float64))

    first_step = True
    for epoch in range(1, args.epochs + 1):
        start, seen, total_loss, batches = time.perf_counter(), 0, 0.0, 0
        for images, labels in train:
            loss = train_step(images, labels)
            if first_step:
                # The ranks started from different random weights, and the optimizer's own variables (the
                # momentum slots, the step counter) do not exist until apply_gradients has run once. So the
                # broadcast comes after the first step, when every variable exists: rank 0's model and
                # optimizer state are copied to all ranks, and from here on identical averaged gradients
                # keep the ranks identical. (Broadcasting before the first step would miss the optimizer.)
                hvd.broadcast_variables(tf_variables(model.variables), root_rank=0)
                hvd.broadcast_variables(tf_variables(optimizer.variables), root_rank=0)
                first_step = False
            seen += int(images.shape[0])
            total_loss += float(loss)
            batches += 1
        elapsed = time.perf_counter() - start

        correct = sum(float(eval_step(images, labels)) for images, labels in test)
        train_loss = float(hvd.allreduce(tf.constant(total_loss / max(batches, 1)), name="train_loss"))
        counts = hvd.allreduce(tf.constant([correct, float(len(x_test))], tf.float64), op=hvd.Sum,
                               name="accuracy").numpy()
        throughput = float(hvd.allreduce(tf.constant(seen / elapsed), op=hvd.Sum, name="throughput"))
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}  test accuracy {counts[0] / counts[1]:.3f}  "
                  f"throughput {throughput:.0f} samples/s on {hvd.size()} ranks", flush=True)

    # Every rank gathers every rank's weights (model and optimizer) and compares them bit for bit.
    flat = tf.concat([tf.reshape(tf.cast(v, tf.float64), [-1])
                      for v in model.variables + optimizer.variables], axis=0)
    gathered = hvd.allgather(tf.expand_dims(flat, 0), name="final_weights").numpy()
    rank, size = hvd.rank(), hvd.size()
    differing = [r for r in range(size) if not np.array_equal(gathered[r], gathered[0])]
    if rank == 0:
        print(f"weights identical on all {size} ranks: {not differing}", flush=True)
    hvd.shutdown()
    if differing:
        sys.exit(f"rank {rank}: the weights of ranks {differing} differ from rank 0's")


if __name__ == "__main__":
    main()
