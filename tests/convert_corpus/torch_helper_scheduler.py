"""Optimizer and learning-rate schedule built in helper functions; logs to a file."""

import logging
import os
import tempfile

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

LOG_DIR = tempfile.mkdtemp()


def build_model():
    return nn.Sequential(nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 3))


def build_optimizer(model, lr=0.1):
    # plain SGD with a little weight decay
    return torch.optim.SGD(model.parameters(), lr=lr, weight_decay=1e-4)


def build_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def get_loader(batch_size):
    g = np.random.RandomState(2)
    x = torch.tensor(g.randn(192, 10), dtype=torch.float32)
    y = torch.tensor(g.randint(0, 3, 192))
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False, drop_last=True)


def run(batch_size, epochs=3):
    torch.manual_seed(3)
    model = build_model()
    optimizer = build_optimizer(model)
    scheduler = build_scheduler(optimizer)
    train_loader = get_loader(batch_size)
    criterion = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        for inputs, targets in train_loader:
            optimizer.zero_grad()
            criterion(model(inputs), targets).backward()
            optimizer.step()
        scheduler.step()
        logging.info("epoch %d lr %.4f", epoch, scheduler.get_last_lr()[0])
    return model


if __name__ == "__main__":
    torch.set_num_threads(1)
    logging.basicConfig(filename=os.path.join(LOG_DIR, "train.log"), level=logging.INFO)
    trained = run(int(os.environ.get("BATCH_SIZE", "32")))
    if os.environ.get("CORPUS_PARAMS_OUT"):
        np.savez(os.environ["CORPUS_PARAMS_OUT"].format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
                 *[p.detach().numpy() for p in trained.parameters()])
