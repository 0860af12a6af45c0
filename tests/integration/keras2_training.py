"""tf-keras 2 training on every rank (run under mpirun with TF_USE_LEGACY_KERAS=1): model.fit with the
DistributedOptimizer over new and legacy tf-keras optimizers, with local aggregation, and SGD's momentum
correction with top-k; the checks compare against single-process training on the global batch (momentum
correction: against dense distributed training) and print one line per check."""

import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import perseus.tensorflow.keras as hvd  # noqa: E402

keras = tf.keras
assert keras.__name__.startswith("tf_keras"), f"expected tf-keras 2 as tf.keras, got {keras.__name__}"
hvd.init()
R, N = hvd.rank(), hvd.size()


def make_model():
    model = keras.Sequential([keras.layers.Dense(6, activation="tanh", input_shape=(5,)), keras.layers.Dense(1)])
    rng = np.random.RandomState(0)
    model.set_weights([rng.uniform(-0.5, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    return model


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


rng = np.random.RandomState(1)
PER, BS = 12, 4
X = rng.randn(PER * N, 5).astype("float32")
Y = rng.randn(PER * N, 1).astype("float32")
ORDER = np.concatenate([np.arange(k * PER, (k + 1) * PER).reshape(-1, BS) for k in range(N)], axis=1).ravel()

CASES = {
    "sgd-momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "legacy-adam": lambda: keras.optimizers.legacy.Adam(0.01),
    "legacy-sgd": lambda: keras.optimizers.legacy.SGD(0.05, momentum=0.9),
}
failed = False
for name, make_opt in CASES.items():
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(make_opt()), loss="mse")
    model.fit(X[R * PER:(R + 1) * PER], Y[R * PER:(R + 1) * PER], batch_size=BS, epochs=2, shuffle=False,
              verbose=0)
    ref = make_model()
    ref.compile(optimizer=make_opt(), loss="mse")
    ref.fit(X[ORDER], Y[ORDER], batch_size=BS * N, epochs=2, shuffle=False, verbose=0)
    gathered = hvd.allgather(flat(model)[None])
    same = bool(all(np.array_equal(g, gathered[0]) for g in gathered))
    diff = float(np.abs(flat(model) - flat(ref)).max())
    ok = same and diff < 1e-4
    failed |= not ok
    print(f"rank {R} {name}: identical={same} max_diff_vs_global_batch={diff:.2e} {'OK' if ok else 'FAIL'}")

# Momentum correction: SGD's momentum moves into top-k. At density 1 it trains as dense momentum SGD, and the
# optimizer's own momentum slots stay zero; at density 0.1 the ranks stay identical.
MOMENTUM_CASES = {
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd-nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "legacy-sgd": lambda: keras.optimizers.legacy.SGD(0.05, momentum=0.9),
    "legacy-sgd-nesterov": lambda: keras.optimizers.legacy.SGD(0.05, momentum=0.9, nesterov=True),
}


def momentum_slots(opt, model):
    if hasattr(opt, "momentums"):
        return [m.numpy() for m in opt.momentums]
    return [opt.get_slot(v, "momentum").numpy() for v in model.trainable_weights]


def fit_with(make_opt, compression):
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(), compression=compression)
    model.compile(optimizer=opt, loss="mse")
    model.fit(X[R * PER:(R + 1) * PER], Y[R * PER:(R + 1) * PER], batch_size=BS, epochs=2, shuffle=False,
              verbose=0)
    return flat(model), momentum_slots(opt, model)


for name, make_opt in MOMENTUM_CASES.items():
    full, full_slots = fit_with(make_opt, hvd.Compression.topk(1.0))
    dense, dense_slots = fit_with(make_opt, hvd.Compression.none)
    sparse, sparse_slots = fit_with(make_opt, hvd.Compression.topk(0.1))
    gathered = hvd.allgather(np.concatenate([full, sparse])[None])
    same = bool(all(np.array_equal(g, gathered[0]) for g in gathered))
    diff = float(np.abs(full - dense).max())
    untouched = not any(np.any(s) for s in full_slots + sparse_slots) and any(np.any(s) for s in dense_slots)
    ok = same and diff < 1e-5 and untouched and not np.allclose(sparse, dense)
    failed |= not ok
    print(f"rank {R} momentum correction {name}: identical={same} max_diff_vs_dense={diff:.2e} "
          f"slots_untouched={untouched} {'OK' if ok else 'FAIL'}")

# Local aggregation over 2 passes with averaging equals one step on the mean of the two passes' gradients.
var = tf.Variable([0.0, 0.0])
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2,
                               average_aggregated_gradients=True)


@tf.function
def step(scale):
    grads_and_vars = opt._compute_gradients(lambda: tf.reduce_sum(var * scale), var_list=[var])
    opt.apply_gradients(grads_and_vars)


for i in range(4):
    step(tf.constant([R + 1.0, 1.0]))
expect = -2 * np.array([(N + 1) / 2.0, 1.0])
ok = np.allclose(var.numpy(), expect) and int(opt.iterations.numpy()) == 4
failed |= not ok
print(f"rank {R} aggregation: {var.numpy().tolist()} expected {expect.tolist()} {'OK' if ok else 'FAIL'}")
sys.exit(1 if failed else 0)
