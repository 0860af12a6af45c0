"""Training in two phases: the first trains two epochs and writes a checkpoint (model, Adam state, epoch);
the second finds that checkpoint, loads it into a fresh model and optimizer, and trains two more epochs."""

import os
import tempfile

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

CHECKPOINT = os.path.join(tempfile.mkdtemp(), "resume.pt")


def make_data():
    rng = np.random.RandomState(12)
    x = rng.randn(192, 7).astype(np.float32)
    y = (np.sin(x[:, :1] * 2) + x[:, 1:2] * x[:, 2:3]).astype(np.float32)
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def run_phase(phase, epochs, batch_size):
    torch.manual_seed(100 + phase)  # a different fresh model in each phase: the checkpoint must override it
    model = nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    first_epoch = 0
    if os.path.exists(CHECKPOINT):
        checkpoint = torch.load(CHECKPOINT)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        first_epoch = checkpoint["epoch"] + 1
        print(f"phase {phase}: resumed from epoch {checkpoint['epoch']}")
    train_loader = DataLoader(make_data(), batch_size=batch_size, shuffle=False)
    for epoch in range(first_epoch, first_epoch + epochs):
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        print(f"phase {phase} epoch {epoch}: loss {loss.item():.4f}")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, CHECKPOINT)
    return model


if __name__ == "__main__":
    torch.set_num_threads(1)
    batch = int(os.environ.get("BATCH_SIZE", "32"))
    run_phase(1, 2, batch)
    final = run_phase(2, 2, batch)
    if os.environ.get("CORPUS_PARAMS_OUT"):
        np.savez(os.environ["CORPUS_PARAMS_OUT"].format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
                 *[p.detach().numpy() for p in final.parameters()])
