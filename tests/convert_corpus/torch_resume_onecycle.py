"""Resume-capable training: a checkpoint is loaded if present, OneCycleLR schedule, a log file."""

import argparse
import os
import tempfile

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--checkpoint", default=os.path.join(tempfile.mkdtemp(), "ckpt.pt"))
    return p.parse_args()


def main():
    args = get_args()
    torch.manual_seed(6)
    torch.set_num_threads(1)
    rng = np.random.RandomState(6)
    x = torch.tensor(rng.randn(256, 12), dtype=torch.float32)
    y = torch.tensor(rng.randint(0, 5, 256))
    train_set = TensorDataset(x, y)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=False)
    model = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5, nesterov=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=args.epochs * len(loader))
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    for epoch in range(args.epochs):
        for batch, (inputs, labels) in enumerate(loader):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
            scheduler.step()
        with open(args.checkpoint + ".log", "a") as log:
            log.write(f"epoch {epoch} loss {loss.item():.4f}\n")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.checkpoint)
    out = os.environ.get("CORPUS_PARAMS_OUT")
    if out:
        np.savez(out.format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
                 *[p.detach().numpy() for p in model.parameters()])


if __name__ == "__main__":
    main()
