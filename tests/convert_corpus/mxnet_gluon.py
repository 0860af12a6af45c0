"""MXNet Gluon MLP regression: ArrayDataset + DataLoader, shapes inferred at the first forward pass,
SGD with momentum through gluon.Trainer, the parameters saved at the end."""

import os
import tempfile

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon


def build_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(1))
    return net


def main(batch_size=32, epochs=2):
    mx.random.seed(7)
    rng = np.random.RandomState(7)
    features = rng.randn(256, 5).astype(np.float32)
    targets = (features @ rng.randn(5, 1) + 0.1 * rng.randn(256, 1)).astype(np.float32)
    train_set = gluon.data.ArrayDataset(features, targets)
    train_loader = gluon.data.DataLoader(train_set, batch_size=batch_size, last_batch="discard")

    net = build_net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                            kvstore="device")
    loss_fn = gluon.loss.L2Loss()

    for epoch in range(epochs):
        for x, y in train_loader:
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(x.shape[0])
        print(f"epoch {epoch}: loss {loss.mean().asscalar():.4f}")
    net.save_parameters(os.path.join(tempfile.mkdtemp(), "mlp.params"))
    return net


if __name__ == "__main__":
    trained = main(batch_size=int(os.environ.get("BATCH_SIZE", "32")))
    if os.environ.get("CORPUS_PARAMS_OUT"):
        params = trained.collect_params()
        np.savez(os.environ["CORPUS_PARAMS_OUT"].format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
                 *[params[k].data().asnumpy() for k in sorted(params.keys())])
