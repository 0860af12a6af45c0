"""Keras classifier: optimizer given by name, a ModelCheckpoint callback, validation data."""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import keras  # noqa: E402

keras.utils.set_random_seed(9)
rng = np.random.default_rng(9)
x = rng.normal(size=(320, 5)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("int64")
x_train, y_train, x_val, y_val = x[:256], y[:256], x[256:], y[256:]

model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="relu"),
                          keras.layers.Dense(2)])
model.compile("sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
ckpt = os.path.join(tempfile.mkdtemp(), "best.keras")
model.fit(
    x_train,
    y_train,
    batch_size=int(os.environ.get("BATCH_SIZE", "32")),
    epochs=2,
    shuffle=False,
    validation_data=(x_val, y_val),
    callbacks=[
        keras.callbacks.ModelCheckpoint(ckpt, save_best_only=True),  # best model so far
    ],
)
model.save_weights(os.path.join(tempfile.mkdtemp(), "last.weights.h5"))
if os.environ.get("CORPUS_PARAMS_OUT"):
    np.savez(os.environ["CORPUS_PARAMS_OUT"].format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
             *model.get_weights())
