"""An encoder and a head trained with two optimizers (SGD and Adam) on the same loss."""

import os

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    torch.manual_seed(4)
    torch.set_num_threads(1)
    batch_size = int(os.environ.get("BATCH_SIZE", "32"))
    rs = np.random.RandomState(4)
    features = torch.tensor(rs.randn(128, 5), dtype=torch.float32)
    targets = features.sum(dim=1, keepdim=True) ** 2
    train_loader = DataLoader(TensorDataset(features, targets), batch_size=batch_size, shuffle=False)

    encoder = nn.Linear(5, 7)
    head = nn.Linear(7, 1)
    enc_opt = torch.optim.SGD(encoder.parameters(), lr=0.01)
    head_opt = torch.optim.Adam(head.parameters(), lr=0.005)

    for epoch in range(2):
        for x, y in train_loader:
            enc_opt.zero_grad()
            head_opt.zero_grad()
            loss = nn.functional.mse_loss(head(torch.relu(encoder(x))), y)
            loss.backward()
            enc_opt.step()
            head_opt.step()
        print(f"epoch {epoch} loss={loss.item():.4f}")

    out = os.environ.get("CORPUS_PARAMS_OUT")
    if out:
        params = list(encoder.parameters()) + list(head.parameters())
        np.savez(out.format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")), *[p.detach().numpy() for p in params])


main()
