# Linear regression written as a flat notebook-style script: no functions, Adam, a checkpoint at the end.
import os
import tempfile

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(1)
torch.set_num_threads(1)
BATCH = int(os.environ.get("BATCH_SIZE", "32"))

rng = np.random.RandomState(1)
X = rng.randn(256, 6).astype(np.float32)
w_true = rng.randn(6, 1).astype(np.float32)
Y = X @ w_true + 0.1 * rng.randn(256, 1).astype(np.float32)

data = TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))
loader = DataLoader(data, batch_size=BATCH)

net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
loss_fn = nn.MSELoss()

for epoch in range(2):
    for step, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        loss = loss_fn(net(xb), yb)
        loss.backward()
        opt.step()
        if step % 4 == 0:
            print("epoch", epoch, "step", step, "loss", loss.item())

# keep the trained weights
ckpt_dir = tempfile.mkdtemp()
torch.save(net.state_dict(), os.path.join(ckpt_dir, "net.pt"))

out = os.environ.get("CORPUS_PARAMS_OUT")
if out:
    np.savez(out.format(rank=os.environ.get("OMPI_COMM_WORLD_RANK", "0")),
             *[p.detach().numpy() for p in net.parameters()])
