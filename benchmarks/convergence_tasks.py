"""The training problems of benchmarks/compression_convergence.py: data, model, loss, optimizer and metric.

Every task is small enough to train on a 2-core machine in a minute or two per run, and is built so that the
same seed gives the same data and initial weights for every compression variant and rank count.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

class DigitsNet(nn.Module):
    """The CNN of examples/pytorch_digits.py."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class Task:
    """A training problem: data, model, loss and the final metric.

    ``shard(rank, size)`` is a rank's part of the training data; ``batch(shard, step, per_rank, gen, cache)``
    this rank's part of global batch ``step`` (``gen`` and ``cache`` belong to one run);
    ``evaluate(model, rank, size)`` this rank's partial sums over the test data, summed over the ranks and
    turned into metrics by ``finish``.
    """

    name = ""
    metric = ""            # "accuracy" (higher is better) or "loss" (lower is better)
    steps = 0
    global_batch = 0
    lr = 0.0
    clip = 0.0
    momentum = 0.0
    #: the optimizer of the recipe: "sgd" (momentum ``momentum``, given by --momentum for the older tasks)
    #: or "adamw"
    optimizer = "sgd"

    def model(self) -> nn.Module:
        raise NotImplementedError

    def make_optimizer(self, params):
        """The recipe's optimizer over ``params`` (before DistributedOptimizer wraps it)."""
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)

    def schedule(self, step: int) -> float:
        """The learning-rate factor at ``step``: cosine decay to zero over the run."""
        return 0.5 * (1.0 + math.cos(math.pi * step / self.steps))


class Classification(Task):
    """A task over tensors ``x_train``/``y_train``/``x_test``/``y_test`` (class labels): each rank reads every
    size-th training example, reshuffled every epoch; cross-entropy loss; metric: test accuracy."""

    metric = "accuracy"

    def shard(self, rank, size):
        return torch.arange(rank, len(self.x_train), size)

    def batch(self, shard, step, per_rank, gen, cache):
        return _epoch_batch(shard, step, per_rank, gen, cache, lambda idx: (self.x_train[idx], self.y_train[idx]))

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model, rank, size):
        idx = torch.arange(rank, len(self.x_test), size)
        with torch.no_grad():
            out = model(self.x_test[idx])
        correct = (out.argmax(1) == self.y_test[idx]).sum().item()
        loss = F.cross_entropy(out, self.y_test[idx], reduction="sum").item()
        return [correct, loss, len(idx)]

    @staticmethod
    def finish(sums):
        correct, loss, count = sums
        return {"accuracy": correct / count, "test_loss": loss / count}


class Digits(Classification):
    name = "digits"

    def __init__(self, args):
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
        y = torch.tensor(digits.target, dtype=torch.long)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        n_test = args.digits_test
        self.x_train, self.y_train = x[perm[n_test:]], y[perm[n_test:]]
        self.x_test, self.y_test = x[perm[:n_test]], y[perm[:n_test]]
        self.global_batch = args.digits_batch
        self.steps = args.digits_epochs * (len(self.x_train) // self.global_batch)
        self.lr = args.digits_lr
        self.clip = 0.0
        self.recipe = {"train": len(self.x_train), "test": n_test, "epochs": args.digits_epochs,
                       "global_batch": self.global_batch, "steps": self.steps, "lr": self.lr}

    def model(self):
        return DigitsNet()



def _epoch_batch(shard, step, per_rank, gen, cache, fetch):
    """Batch ``step`` of a rank: its shard reshuffled every epoch (the same permutation stream for every
    variant of a seed), drop-last batches. ``cache`` belongs to one run."""
    per_epoch = len(shard) // per_rank
    epoch, pos = divmod(step, per_epoch)
    if cache.get("epoch") != epoch:
        cache["epoch"], cache["order"] = epoch, shard[torch.randperm(len(shard), generator=gen)]
    order = cache["order"]
    return fetch(order[pos * per_rank:(pos + 1) * per_rank])


class ZipfMarkov:
    """A first-order Markov chain over ``vocab`` tokens: from token ``i`` the next token is ``perm[i][r]``
    with probability proportional to ``1 / (r + 1) ** exponent`` (a Zipf law over a per-token random
    permutation). Every row has the same entropy, so the chain's entropy rate is that of the Zipf law."""

    def __init__(self, vocab=500, exponent=1.1, seed=1234):
        rng = np.random.default_rng(seed)
        p = 1.0 / np.arange(1, vocab + 1) ** exponent
        self.p = p / p.sum()
        self.perm = np.stack([rng.permutation(vocab) for _ in range(vocab)]).astype(np.int64)
        self.vocab = vocab

    def entropy_rate(self) -> float:
        return float(-(self.p * np.log(self.p)).sum())

    def generate(self, n, seed) -> np.ndarray:
        rng = np.random.default_rng(seed)
        ranks = np.searchsorted(np.cumsum(self.p), rng.random(n), side="right").clip(0, self.vocab - 1)
        out = np.empty(n, np.int64)
        tok = int(rng.integers(self.vocab))
        perm = self.perm
        for i in range(n):
            tok = perm[tok, ranks[i]]
            out[i] = tok
        return out


class GRULM(nn.Module):
    def __init__(self, vocab, emb, hidden):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.rnn = nn.GRU(emb, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        h, _ = self.rnn(self.embed(x))
        return self.out(h)


class ZipfLM(Task):
    name = "lm"
    metric = "loss"

    def __init__(self, args):
        self.chain = ZipfMarkov(args.lm_vocab, args.lm_zipf, seed=1234)
        self.train = torch.from_numpy(self.chain.generate(args.lm_train_tokens, seed=1))
        self.test = torch.from_numpy(self.chain.generate(args.lm_test_tokens, seed=2))
        self.seq = args.lm_seq
        self.global_batch = args.lm_batch
        self.steps = args.lm_steps
        self.lr = args.lm_lr
        self.clip = args.lm_clip
        self.args = args
        self.recipe = {"vocab": args.lm_vocab, "zipf": args.lm_zipf, "train_tokens": args.lm_train_tokens,
                       "test_tokens": args.lm_test_tokens, "seq": self.seq, "global_batch": self.global_batch,
                       "steps": self.steps, "lr": self.lr, "clip": self.clip, "emb": args.lm_emb,
                       "hidden": args.lm_hidden, "entropy_rate": self.chain.entropy_rate()}

    def model(self):
        return GRULM(self.args.lm_vocab, self.args.lm_emb, self.args.lm_hidden)

    def shard(self, rank, size):
        n = len(self.train) // size
        return self.train[rank * n:(rank + 1) * n]

    def batch(self, shard, step, per_rank, gen, cache):
        starts = torch.randint(0, len(shard) - self.seq - 1, (per_rank,), generator=gen)
        windows = torch.stack([shard[s:s + self.seq + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x).reshape(-1, self.chain.vocab), y.reshape(-1))

    def evaluate(self, model, rank, size):
        seq = 64
        windows = self.test[:len(self.test) // (seq + 1) * (seq + 1)].view(-1, seq + 1)[rank::size]
        with torch.no_grad():
            out = model(windows[:, :-1])
            loss = F.cross_entropy(out.reshape(-1, self.chain.vocab), windows[:, 1:].reshape(-1),
                                   reduction="sum").item()
        return [loss, windows[:, 1:].numel()]

    @staticmethod
    def finish(sums):
        loss, count = sums
        return {"loss": loss / count}


class SparseLinear(Task):
    """Least squares where the signal lives in small-gradient coordinates (see the module docstring)."""

    name = "linear"
    metric = "loss"

    def __init__(self, args):
        rng = np.random.default_rng(7)
        self.d, self.loud = 1000, 20
        n_train, n_test = 24000, 4000
        scale = np.ones(self.d, np.float32)
        scale[:self.loud] = 10.0
        w = rng.standard_normal(self.d).astype(np.float32)
        w[:self.loud] = 0.0
        x = rng.standard_normal((n_train + n_test, self.d)).astype(np.float32) * scale
        y = x @ w + 0.1 * rng.standard_normal(n_train + n_test).astype(np.float32)
        self.x_train, self.y_train = torch.from_numpy(x[:n_train]), torch.from_numpy(y[:n_train])
        self.x_test, self.y_test = torch.from_numpy(x[n_train:]), torch.from_numpy(y[n_train:])
        self.var = float(self.y_test.var())
        self.global_batch = args.linear_batch
        self.steps = args.linear_steps
        self.lr = args.linear_lr
        self.clip = 0.0
        self.recipe = {"features": self.d, "loud": self.loud, "train": n_train, "test": n_test,
                       "global_batch": self.global_batch, "steps": self.steps, "lr": self.lr}

    def model(self):
        m = nn.Linear(self.d, 1, bias=False)
        nn.init.zeros_(m.weight)
        return m

    def shard(self, rank, size):
        return torch.arange(rank, len(self.x_train), size)

    def batch(self, shard, step, per_rank, gen, cache):
        return _epoch_batch(shard, step, per_rank, gen, cache, lambda idx: (self.x_train[idx], self.y_train[idx]))

    def loss(self, model, batch):
        x, y = batch
        return 0.5 * F.mse_loss(model(x).squeeze(1), y)

    def evaluate(self, model, rank, size):
        idx = torch.arange(rank, len(self.x_test), size)
        with torch.no_grad():
            err = model(self.x_test[idx]).squeeze(1) - self.y_test[idx]
        return [float((err ** 2).sum()), len(idx)]

    def finish(self, sums):
        sq, count = sums
        return {"loss": sq / count / self.var}




class TeacherMLP(Classification):
    """Classification of synthetic data by an MLP with momentum SGD: the setting in which top-k with momentum
    applied after aggregation falls behind dense.

    Data: scikit-learn's make_classification, 64 features (32 informative, 16 redundant), 10 classes of 2
    clusters each, class separation 2, 2% flipped labels, fixed seed; 8,000 training and 2,000 test points.
    Model: 64 -> hidden -> hidden -> 10 with ReLU (hidden 512 by default: 300K parameters). Recipe: SGD,
    momentum 0.9, weight decay 1e-4, lr 0.05 with cosine decay, global batch 96, 600 steps (--mlp-*).
    """

    name = "mlp"
    optimizer = "sgd"

    def __init__(self, args):
        from sklearn.datasets import make_classification

        n_train, n_test, d, classes = 8000, 2000, 64, 10
        x, y = make_classification(n_samples=n_train + n_test, n_features=d, n_informative=32, n_redundant=16,
                                   n_classes=classes, n_clusters_per_class=2, class_sep=2.0, flip_y=0.02,
                                   random_state=11)
        x = torch.tensor(x, dtype=torch.float32)
        y = torch.tensor(y, dtype=torch.long)
        self.x_train, self.y_train = x[:n_train], y[:n_train]
        self.x_test, self.y_test = x[n_train:], y[n_train:]
        self.d, self.classes, self.hidden = d, classes, args.mlp_hidden
        self.global_batch = args.mlp_batch
        self.steps = args.mlp_steps
        self.lr = args.mlp_lr
        self.momentum = args.mlp_momentum
        self.weight_decay = 1e-4
        self.clip = 0.0
        self.recipe = {"train": n_train, "test": n_test, "features": d, "classes": classes,
                       "hidden": self.hidden, "global_batch": self.global_batch, "steps": self.steps,
                       "lr": self.lr, "optimizer": "sgd", "momentum": self.momentum,
                       "weight_decay": self.weight_decay}

    def model(self):
        h = self.hidden
        return nn.Sequential(nn.Linear(self.d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, self.classes))

    def make_optimizer(self, params):
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)



class TinyEncoder(nn.Module):
    """A causal transformer encoder: token and position embeddings, ``layers`` pre-norm encoder layers,
    a linear output tied to nothing."""

    def __init__(self, vocab, d_model, heads, layers, seq):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

    def forward(self, x):
        t = x.shape[1]
        h = self.embed(x) + self.pos[:t]
        h = self.encoder(h, mask=self.mask[:t, :t], is_causal=True)
        return self.out(self.norm(h))


class ZipfTransformer(ZipfLM):
    """The Zipf-Markov next-token task of ``lm`` learnt by a small transformer encoder with AdamW.

    Model: d_model 64, 4 heads, 2 layers, feed-forward 128, causal mask, windows of 32 tokens (94K
    parameters with a 200-token vocabulary). Recipe: AdamW (betas 0.9/0.999, weight decay 0.01), lr 3e-3,
    100 warm-up steps then cosine decay, global batch 32 windows. Metrics: held-out loss (nats/token) and
    next-token accuracy.
    """

    name = "transformer"
    metric = "loss"
    optimizer = "adamw"

    def __init__(self, args):
        self.chain = ZipfMarkov(args.tf_vocab, args.lm_zipf, seed=1234)
        self.train = torch.from_numpy(self.chain.generate(args.lm_train_tokens // 2, seed=1))
        self.test = torch.from_numpy(self.chain.generate(args.lm_test_tokens // 2, seed=2))
        self.seq = args.lm_seq
        self.global_batch = args.tf_batch
        self.steps = args.tf_steps
        self.lr = args.tf_lr
        self.warmup = min(100, self.steps // 5)
        self.clip = 0.0
        self.args = args
        self.recipe = {"vocab": args.tf_vocab, "zipf": args.lm_zipf, "train_tokens": len(self.train),
                       "seq": self.seq, "global_batch": self.global_batch, "steps": self.steps, "lr": self.lr,
                       "optimizer": "adamw", "weight_decay": 0.01, "lr_warmup": self.warmup,
                       "d_model": 64, "heads": 4, "layers": 2, "entropy_rate": self.chain.entropy_rate()}

    def model(self):
        return TinyEncoder(self.args.tf_vocab, 64, 4, 2, self.seq)

    def make_optimizer(self, params):
        return torch.optim.AdamW(params, lr=self.lr, betas=(0.9, 0.999), weight_decay=0.01)

    def schedule(self, step):
        if step < self.warmup:
            return (step + 1) / self.warmup
        return 0.5 * (1.0 + math.cos(math.pi * (step - self.warmup) / max(1, self.steps - self.warmup)))

    def evaluate(self, model, rank, size):
        seq = self.seq
        windows = self.test[:len(self.test) // (seq + 1) * (seq + 1)].view(-1, seq + 1)[rank::size]
        with torch.no_grad():
            out = model(windows[:, :-1]).reshape(-1, self.chain.vocab)
            target = windows[:, 1:].reshape(-1)
            loss = F.cross_entropy(out, target, reduction="sum").item()
            correct = (out.argmax(1) == target).sum().item()
        return [loss, correct, target.numel()]

    @staticmethod
    def finish(sums):
        loss, correct, count = sums
        return {"loss": loss / count, "accuracy": correct / count}


class ShortMLP(TeacherMLP):
    """The ``mlp`` task in a few hundred steps with a narrower network (hidden 128, 300 steps, 26K
    parameters), where top-k without momentum correction falls further behind."""

    name = "mlp_short"

    def __init__(self, args):
        super().__init__(args)
        self.hidden = 128
        self.steps = 300
        self.recipe.update(hidden=128, steps=300)


TASKS = {"digits": Digits, "lm": ZipfLM, "linear": SparseLinear, "mlp": TeacherMLP, "mlp_short": ShortMLP,
         "transformer": ZipfTransformer}
