"""Digits classifier that keeps the best model (lowest validation loss) during training and reloads it from
its checkpoint file for the final test."""

import os
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


def splits():
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    train = TensorDataset(x[:256], y[:256])
    val = TensorDataset(x[256:768], y[256:768])
    test = TensorDataset(x[768:], y[768:])
    return train, val, test


def evaluate(model, loader):
    model.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            loss += F.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            n += len(y)
    model.train()
    return loss / n, correct / n


def main():
    torch.manual_seed(11)
    torch.set_num_threads(1)
    batch_size = int(os.environ.get("BATCH_SIZE", "32"))
    train_set, val_set, test_set = splits()
    train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=False)
    val_loader = DataLoader(val_set, batch_size=128)
    test_loader = DataLoader(test_set, batch_size=128)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    best_path = os.path.join(tempfile.mkdtemp(), "best.pt")
    best_loss = float("inf")
    for epoch in range(14):
        for x, y in train_loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        val_loss, val_acc = evaluate(model, val_loader)
        print(f"epoch {epoch}: val loss {val_loss:.4f} acc {val_acc:.3f}")
        if val_loss < best_loss:
            best_loss = val_loss
            torch.save(model.state_dict(), best_path)
    model.load_state_dict(torch.load(best_path))
    test_loss, test_acc = evaluate(model, test_loader)
    print(f"best model: val loss {best_loss:.4f}, test loss {test_loss:.4f} acc {test_acc:.3f}")
    out = os.environ.get("CORPUS_PARAMS_OUT")
    if out:
        np.savez(out.format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
                 *[p.detach().numpy() for p in model.parameters()])


if __name__ == "__main__":
    main()
