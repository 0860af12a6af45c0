"""Classify synthetic blobs with a small MLP: argparse flags, one function per step of the job."""

import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--params-out", default=os.environ.get("CORPUS_PARAMS_OUT"))
    return parser.parse_args()


def make_data(n=256, features=8, classes=4):
    rng = np.random.RandomState(0)
    centers = rng.randn(classes, features) * 2.0
    labels = rng.randint(0, classes, size=n)
    x = centers[labels] + rng.randn(n, features)
    return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(labels))


class MLP(nn.Module):
    def __init__(self, features=8, hidden=16, classes=4):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def train_epoch(model, loader, optimizer):
    model.train()
    total = 0.0
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total / len(loader)


def save_params(model, path):
    if path:  # one file per process
        path = path.format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        np.savez(path, *[p.detach().numpy() for p in model.parameters()])


def main():
    args = parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    train_loader = DataLoader(make_data(), batch_size=args.batch_size, shuffle=False)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        loss = train_epoch(model, train_loader, optimizer)
        print(f"epoch {epoch}: loss {loss:.4f}")
    save_params(model, args.params_out)


if __name__ == "__main__":
    main()
