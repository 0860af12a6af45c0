"""Train a small classifier on scikit-learn's digits, data-parallel, the Horovod way.

    perseusrun -np 2 python examples/pytorch_digits.py        (or: mpirun -np 2 python ...)
    perseusrun -np 2 python examples/pytorch_digits.py --device cuda     (one GPU per rank, as Horovod pins)

Each rank trains on its shard of the training set; gradients are averaged across ranks every step;
rank 0 prints the loss, accuracy and throughput. The data ships with scikit-learn (no download).
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import perseus.torch as hvd


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(float(value)), name=name).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: rank r trains on GPU (local rank r modulo the GPUs this host has)")
    args = parser.parse_args()

    hvd.init()
    if args.device == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        torch.backends.cudnn.deterministic = True  # comparable with the CPU run's loss
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train = TensorDataset(x[perm[:1500]], y[perm[:1500]])
    test = TensorDataset(x[perm[1500:]], y[perm[1500:]])
    train_sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True,
                                       seed=args.seed)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(test, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = DataLoader(test, batch_size=256, sampler=test_sampler)

    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        start, seen, total_loss, batches = time.perf_counter(), 0, 0.0, 0
        for data, target in train_loader:
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            seen += len(data)
            total_loss += loss.item()
            batches += 1
        elapsed = time.perf_counter() - start
        model.eval()
        correct = count = 0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                correct += (model(data).argmax(1) == target).sum().item()
                count += len(data)
        train_loss = metric_average(total_loss / max(batches, 1), "train_loss")
        accuracy = hvd.allreduce(torch.tensor([correct, count], dtype=torch.float64), op=hvd.Sum,
                                 name="accuracy")
        throughput = metric_average(seen / elapsed, "throughput") * hvd.size()
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}  test accuracy "
                  f"{accuracy[0].item() / accuracy[1].item():.3f}  throughput {throughput:.0f} samples/s "
                  f"on {hvd.size()} ranks ({args.device})", flush=True)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = hvd.allgather(params.unsqueeze(0), name="final_params")
    if hvd.rank() == 0:
        same = all(torch.equal(gathered[0], gathered[r]) for r in range(hvd.size()))
        print(f"parameters identical on all {hvd.size()} ranks: {same}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
