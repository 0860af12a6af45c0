"""TensorFlow 2 custom training loop: tf.data pipeline, GradientTape inside a tf.function."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main(batch_size=32, epochs=2):
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.keras.utils.set_random_seed(10)
    rng = np.random.RandomState(10)
    features = rng.randn(256, 4).astype(np.float32)
    labels = rng.randint(0, 3, 256).astype(np.int64)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(batch_size)

    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="relu"),
                                 tf.keras.layers.Dense(3)])
    optimizer = tf.keras.optimizers.Adam(learning_rate=0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for epoch in range(epochs):
        for x, y in dataset:
            loss = train_step(x, y)
        print(f"epoch {epoch}: loss {float(loss):.4f}")
    return model


if __name__ == "__main__":
    trained = main(batch_size=int(os.environ.get("BATCH_SIZE", "32")))
    if os.environ.get("CORPUS_PARAMS_OUT"):
        np.savez(os.environ["CORPUS_PARAMS_OUT"].format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
                 *trained.get_weights())
