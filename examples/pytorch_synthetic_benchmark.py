"""Synthetic-data training throughput, the shape of Horovod's pytorch_synthetic_benchmark.py.

    perseusrun -np 2 python examples/pytorch_synthetic_benchmark.py [--model resnet18] [--batch-size 16]

A ResNet (defined here, no torchvision needed) trains on random images; the script reports images/sec per
rank and in total. ``--library horovod`` runs the same script on Horovod, for side-by-side comparisons.
"""

import argparse
import importlib
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-18/34 layout (BasicBlock), 1000 classes."""

    def __init__(self, blocks=(2, 2, 2, 2), num_classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for i, n in enumerate(blocks):
            cout = 64 * 2 ** i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if j == 0 and i > 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


MODELS = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    ap.add_argument("--batch-size", type=int, default=16, help="per rank")
    ap.add_argument("--image-size", type=int, default=96)
    ap.add_argument("--num-warmup-batches", type=int, default=3)
    ap.add_argument("--num-batches-per-iter", type=int, default=5)
    ap.add_argument("--num-iters", type=int, default=5)
    ap.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16")
    ap.add_argument("--library", default="perseus", choices=["perseus", "horovod"])
    args = ap.parse_args()
    hvd = importlib.import_module(f"{args.library}.torch")

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)
    model = ResNet(MODELS[args.model])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        return loss

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    nparams = sum(p.numel() for p in model.parameters())
    log(f"Model: {args.model} ({nparams / 1e6:.1f}M parameters), batch size {args.batch_size} per rank, "
        f"image {args.image_size}px, {hvd.size()} ranks, library {args.library}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    img_secs = []
    for i in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{i}: {img_sec:.1f} img/sec per rank")
        img_secs.append(img_sec)
    loss = benchmark_step().item()
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    log(f"Final loss {loss:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
