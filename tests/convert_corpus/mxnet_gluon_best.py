"""MXNet Gluon regression that saves its parameters whenever the validation loss improves, then loads the
best ones back (load_parameters) for the final evaluation."""

import os
import tempfile

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon


def main(batch_size=32, epochs=14):
    mx.random.seed(15)
    rng = np.random.RandomState(15)
    features = rng.randn(320, 6).astype(np.float32)
    targets = (np.tanh(features @ rng.randn(6, 1)) + 0.3 * rng.randn(320, 1)).astype(np.float32)
    train_set = gluon.data.ArrayDataset(features[:64], targets[:64])
    train_loader = gluon.data.DataLoader(train_set, batch_size=batch_size, last_batch="discard")
    val_x, val_y = mx.nd.array(features[64:]), mx.nd.array(targets[64:])

    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(32, activation="relu"), gluon.nn.Dense(1))
    net.initialize(mx.init.Xavier())
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})
    loss_fn = gluon.loss.L2Loss()
    best_path = os.path.join(tempfile.mkdtemp(), "best.params")
    best_loss = float("inf")
    for epoch in range(epochs):
        for x, y in train_loader:
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(x.shape[0])
        val_loss = loss_fn(net(val_x), val_y).mean().asscalar()
        print(f"epoch {epoch}: val loss {val_loss:.4f}")
        if val_loss < best_loss:
            best_loss = val_loss
            net.save_parameters(best_path)
    net.load_parameters(best_path)
    print(f"best val loss {best_loss:.4f}, reloaded: {loss_fn(net(val_x), val_y).mean().asscalar():.4f}")
    return net


if __name__ == "__main__":
    trained = main(batch_size=int(os.environ.get("BATCH_SIZE", "32")))
    if os.environ.get("CORPUS_PARAMS_OUT"):
        params = trained.collect_params()
        np.savez(os.environ["CORPUS_PARAMS_OUT"].format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
                 *[params[k].data().asnumpy() for k in sorted(params.keys())])
