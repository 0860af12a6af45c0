"""Write a stand-in for LIBSVM's ``mnist.bz2`` (the file Horovod's Spark MNIST examples read from ``--data-dir``
when it is there, instead of downloading it): scikit-learn's bundled 8x8 digits scaled to 28x28 pixels
(0-255), 784 features per row in LIBSVM's sparse text format, bzip2-compressed.

    python tools/mnist_libsvm.py DATA_DIR        # writes DATA_DIR/mnist.bz2 (1797 rows)
"""

from __future__ import annotations

import bz2
import os
import sys

import numpy as np


def digits_rows() -> tuple[np.ndarray, np.ndarray]:
    """(images as (rows, 784) floats in 0..255, labels)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.kron(digits.images / 16.0 * 255.0, np.ones((3, 3)))  # 8x8 -> 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))).round()           # -> 28x28
    return images.reshape(len(images), 784), digits.target.astype(np.int64)


def write(data_dir: str) -> str:
    """Write ``data_dir/mnist.bz2``; returns its path."""
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, "mnist.bz2")
    x, y = digits_rows()
    with bz2.open(path, "wt") as f:
        for pixels, label in zip(x, y):
            nonzero = np.flatnonzero(pixels)
            f.write(str(label) + "".join(f" {i + 1}:{int(pixels[i])}" for i in nonzero) + "\n")  # 1-based
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(write(sys.argv[1]))
