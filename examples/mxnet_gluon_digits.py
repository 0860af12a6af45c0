"""Train a Gluon MLP on scikit-learn's digits, data-parallel, the Horovod way (MXNet 1.9).

    mpirun -np 2 python examples/mxnet_gluon_digits.py        (or: perseusrun -np 2 python ...)

Run it from the MXNet environment (bash tools/setup_mxnet_env.sh prints its bin dir). Each rank trains on
its shard of the training set; DistributedTrainer averages the gradients across ranks every step; rank 0
prints the averaged loss and accuracy and the throughput, and at the end whether every rank holds the same
parameters. The data ships with scikit-learn (no download).
"""

import argparse
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from sklearn.datasets import load_digits

import perseus.mxnet as hvd


def build_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(10))
    return net


def metric_average(value, name):
    """The mean of a Python number over all ranks."""
    return hvd.allreduce(mx.nd.array([value], dtype="float64"), name=name).asnumpy()[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    mx.random.seed(args.seed + rank)  # different initial values per rank: broadcast_parameters fixes that

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.float32)
    perm = np.random.default_rng(0).permutation(len(x))
    train_idx, test_idx = perm[:1500], perm[1500:]
    train_x, train_y = x[train_idx][rank::size], y[train_idx][rank::size]  # this rank's shard
    test_x, test_y = x[test_idx][rank::size], y[test_idx][rank::size]

    net = build_net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    params = net.collect_params()
    # The shapes are inferred at the first forward pass: broadcast_parameters broadcasts each parameter
    # from rank 0 as soon as MXNet initialises it.
    hvd.broadcast_parameters(params, root_rank=0)
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": args.lr * size, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(args.seed + rank)
    # Every rank takes the same number of steps per epoch (a rank with a step fewer would leave the others
    # waiting for its gradients).
    steps = len(x[train_idx]) // size // args.batch_size

    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(train_x))
        start, total_loss = time.perf_counter(), 0.0
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            data, label = mx.nd.array(train_x[batch]), mx.nd.array(train_y[batch])
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(len(batch))
            total_loss += loss.mean().asscalar()
        elapsed = time.perf_counter() - start
        predictions = net(mx.nd.array(test_x)).argmax(axis=1).asnumpy()
        correct = hvd.allreduce(mx.nd.array([(predictions == test_y).sum(), len(test_y)], dtype="float64"),
                                op=hvd.Sum, name="accuracy").asnumpy()
        train_loss = metric_average(total_loss / max(steps, 1), "train_loss")
        throughput = metric_average(steps * args.batch_size / elapsed, "throughput") * size
        if rank == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}  test accuracy {correct[0] / correct[1]:.3f}  "
                  f"throughput {throughput:.0f} samples/s on {size} ranks", flush=True)

    flat = mx.nd.concat(*[p.data().reshape((-1,)) for p in params.values()], dim=0)
    gathered = hvd.allgather(flat.reshape((1, -1)), name="final_params").asnumpy()
    same = all(np.array_equal(gathered[0], gathered[r]) for r in range(size))
    if rank == 0:
        print(f"parameters identical on all {size} ranks: {same}", flush=True)
    hvd.shutdown()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
