"""perseus.tensorflow.SyncBatchNormalization: each rank normalises its slice with global-batch statistics; the
outputs, moving statistics and gradients equal plain BatchNormalization on the concatenated batch."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import perseus.tensorflow as hvd  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def batches(n, sizes, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randn(s, 3, 4).astype("float32") * (r + 1) + r for r, s in zip(range(n), sizes)]


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("uneven", [False, True])
def test_sync_batch_norm_matches_full_batch(mode, uneven):
    r, n = hvd.rank(), hvd.size()
    sizes = [2 + (k if uneven else 0) for k in range(n)]
    xs = batches(n, sizes)
    full = np.concatenate(xs)
    upstream = np.random.RandomState(1).randn(*full.shape).astype("float32")
    offsets = np.cumsum([0] + sizes)
    sync = hvd.SyncBatchNormalization(axis=-1, momentum=0.5)
    plain = tf.keras.layers.BatchNormalization(axis=-1, momentum=0.5)

    def run(layer, x, dy):
        x = tf.convert_to_tensor(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * dy)
        dx, dgamma = tape.gradient(loss, [x, layer.gamma])
        return y, dx, dgamma

    if mode == "function":
        run_sync, run_plain = tf.function(lambda x, dy: run(sync, x, dy)), tf.function(lambda x, dy: run(plain, x, dy))
    else:
        run_sync, run_plain = (lambda x, dy: run(sync, x, dy)), (lambda x, dy: run(plain, x, dy))
    mine = slice(offsets[r], offsets[r + 1])
    y, dx, dgamma = run_sync(xs[r], upstream[mine])
    y_ref, dx_ref, dgamma_ref = run_plain(full, upstream)
    np.testing.assert_allclose(y.numpy(), y_ref.numpy()[mine], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dx.numpy(), dx_ref.numpy()[mine], rtol=1e-3, atol=1e-4)
    # gamma's gradient: this rank's share of the sum; summed over ranks it is the full-batch gradient.
    total = hvd.allreduce(dgamma, op=hvd.Sum)
    np.testing.assert_allclose(total.numpy(), dgamma_ref.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(sync.moving_mean.numpy(), plain.moving_mean.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sync.moving_variance.numpy(), plain.moving_variance.numpy(), rtol=1e-4)


def test_fused_is_rejected():
    with pytest.raises(ValueError, match="fused"):
        hvd.SyncBatchNormalization(fused=True)
