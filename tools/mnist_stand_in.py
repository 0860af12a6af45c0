"""Run a Horovod MNIST example script unchanged, on perseus, with a locally made stand-in for MNIST.

Horovod's MNIST examples download the data set at start-up, which a machine without internet access cannot
do. This runs the script through the import alias after replacing ``mnist.load_data`` (of ``keras``,
``tf.keras`` and ``tf_keras``) with scikit-learn's bundled 8x8 digits, scaled to 28x28 uint8 images and split
1500/297 like MNIST's train/test arrays. Everything else in the script runs as written.

    mpirun -np 2 python tools/mnist_stand_in.py tensorflow2_keras_mnist.py [script args]
"""

from __future__ import annotations

import importlib
import sys

import numpy as np


def digits_as_mnist(path: str = "mnist.npz"):
    """``((x_train, y_train), (x_test, y_test))`` shaped and typed like ``mnist.load_data()``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.kron(digits.images / 16.0 * 255.0, np.ones((3, 3)))  # 8x8 -> 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))).round().astype(np.uint8)  # -> 28x28
    labels = digits.target.astype(np.uint8)
    return (images[:1500], labels[:1500]), (images[1500:], labels[1500:])


def _patch(module_name: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    module.load_data = digits_as_mnist


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    import tensorflow as tf

    for name in ("keras.datasets.mnist", "tf_keras.datasets.mnist"):
        _patch(name)
    tf.keras.datasets.mnist.load_data = digits_as_mnist
    from perseus.compat import horovod_alias

    horovod_alias._main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
