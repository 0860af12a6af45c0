"""A Horovod PyTorch script (converted to perseus by renaming the imports)."""

import os

import numpy as np
import torch
import torch.nn as nn
import horovod.torch as hvd
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

hvd.init()
torch.manual_seed(7 + hvd.rank())  # different start on every rank: the broadcast must fix it
torch.set_num_threads(1)

rng = np.random.RandomState(7)
data = TensorDataset(torch.tensor(rng.randn(128, 3), dtype=torch.float32),
                     torch.tensor(rng.randn(128, 1), dtype=torch.float32))
sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank())
loader = DataLoader(data, batch_size=16, sampler=sampler)

model = nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    avg = hvd.allreduce(loss.detach(), name="loss")
    if hvd.rank() == 0:
        print(f"epoch {epoch}: loss {avg.item():.4f} on {hvd.size()} ranks")

if os.environ.get("CORPUS_PARAMS_OUT"):
    np.savez(os.environ["CORPUS_PARAMS_OUT"].format(rank=hvd.rank()),
             *[p.detach().numpy() for p in model.parameters()])
