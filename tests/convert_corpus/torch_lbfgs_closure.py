"""Softmax regression on the digits with L-BFGS (strong Wolfe line search): optimizer.step(closure) on large
mini-batches, the closure evaluated several times per step."""

import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


def main():
    torch.manual_seed(14)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    digits = load_digits()
    x = torch.tensor(digits.data[:1024] / 16.0)
    y = torch.tensor(digits.target[:1024])
    loader = DataLoader(TensorDataset(x, y), batch_size=int(os.environ.get("BATCH_SIZE", "256")), shuffle=False)
    model = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=8, history_size=6,
                                  line_search_fn="strong_wolfe")
    for epoch in range(2):
        for inputs, labels in loader:
            def closure():
                optimizer.zero_grad()
                loss = F.cross_entropy(model(inputs), labels)
                loss.backward()
                return loss

            loss = optimizer.step(closure)
        print(f"epoch {epoch}: loss {loss.item():.5f}")
    out = os.environ.get("CORPUS_PARAMS_OUT")
    if out:
        np.savez(out.format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
                 *[p.detach().numpy() for p in model.parameters()])


if __name__ == "__main__":
    main()
