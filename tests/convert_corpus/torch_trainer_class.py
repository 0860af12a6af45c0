"""A small Trainer class: the model, optimizer and loader live on ``self``; shuffled data, tqdm bar."""

import os

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm


class Trainer:
    def __init__(self, epochs=2, batch_size=16):
        torch.manual_seed(5)
        self.epochs = epochs
        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        r = np.random.RandomState(5)
        x = torch.tensor(r.randn(160, 4), dtype=torch.float32)
        y = torch.tensor((r.randn(160) > 0).astype(np.int64))
        self.train_loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)

    def fit(self):
        loss_fn = nn.CrossEntropyLoss()
        for epoch in range(self.epochs):
            for x, y in tqdm(self.train_loader, desc=f"epoch {epoch}"):
                self.optimizer.zero_grad()
                loss_fn(self.model(x), y).backward()
                self.optimizer.step()

    def dump(self, path):
        np.savez(path.format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
                 *[p.detach().numpy() for p in self.model.parameters()])


if __name__ == "__main__":
    torch.set_num_threads(1)
    trainer = Trainer(batch_size=int(os.environ.get("BATCH_SIZE", "16")))
    trainer.fit()
    if "CORPUS_PARAMS_OUT" in os.environ:
        trainer.dump(os.environ["CORPUS_PARAMS_OUT"])
