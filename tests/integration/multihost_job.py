"""The rank side of test_multihost.py, run across emulated hosts by perseusrun.

    python multihost_job.py collectives HOSTS PER_HOST [NETWORK_INTERFACE]
    python multihost_job.py train HOSTS PER_HOST
    python multihost_job.py flows HOSTS PER_HOST     (PERSEUS_NUM_CHANNELS set by the caller, or not)

HOSTS are the emulated hosts' names, comma-separated. Ranks are expected to fill them in order (perseusrun maps
by slot): rank r runs on host number r // PER_HOST.
Every check that fails raises, which ends the whole job with a non-zero status; a rank that passes prints
one ``OK ...`` line.
"""

import os
import socket
import sys

import torch

import perseus.torch as hvd

BIG = 1 << 20  # elements: 4 MB as float32
NAMES = []  # the hosts' names, in the order ranks fill them (from the command line)


def check(cond, what):
    if not cond:
        raise AssertionError(f"rank {hvd.rank()} on {socket.gethostname()}: {what}")


def check_layout(hosts, per_host):
    r = hvd.rank()
    got = (hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())
    want = (hosts * per_host, r % per_host, per_host, r // per_host, hosts)
    check(got == want, f"(size, local_rank, local_size, cross_rank, cross_size) = {got}, expected {want}")
    check(socket.gethostname() == NAMES[r // per_host],
          f"runs on {socket.gethostname()}, expected {NAMES[r // per_host]}")


def check_allreduce():
    size, r = hvd.size(), hvd.rank()
    total = size * (size + 1) // 2  # sum over ranks of (rank + 1)
    moved = 0
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                  torch.uint8):
        for n in (1, 1000, 65537, BIG):
            if dtype in (torch.float16, torch.bfloat16, torch.uint8) and n == BIG:
                continue  # the large case once per wide type is enough
            # Small integers: every sum and mean below is exact in every dtype.
            base = (torch.arange(n) % 7).to(dtype)
            x = base * (r + 1)
            s = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dtype}.{n}")
            check(s.dtype == dtype and torch.equal(s, base * total), f"allreduce sum {dtype} x {n} is wrong")
            if dtype.is_floating_point:
                a = hvd.allreduce(x, op=hvd.Average, name=f"avg.{dtype}.{n}")
                want = (base.double() * total / size).to(dtype)
                check(torch.equal(a, want), f"allreduce average {dtype} x {n} is wrong")
            if n == BIG:
                moved += s.numel() * s.element_size()
    # A few more large ones, in place and asynchronous at once: the bytes that must cross between hosts.
    xs = [torch.full((BIG,), float(r + i)) for i in range(4)]
    handles = [hvd.allreduce_async_(x, op=hvd.Sum, name=f"big.{i}") for i, x in enumerate(xs)]
    for i, h in enumerate(handles):
        out = hvd.synchronize(h)
        check(torch.equal(out, torch.full((BIG,), float(size * (size - 1) // 2 + size * i))),
              f"async allreduce big.{i} is wrong")
        moved += out.numel() * 4
    return moved


def check_gather_broadcast_alltoall():
    size, r = hvd.size(), hvd.rank()
    # allgather: rank i gives i+1 rows of value i.
    g = hvd.allgather(torch.full((r + 1, 3), float(r)), name="gather")
    want = torch.cat([torch.full((i + 1, 3), float(i)) for i in range(size)])
    check(torch.equal(g, want), "allgather is wrong")
    g = hvd.allgather(torch.arange(BIG // 4, dtype=torch.int64) + r, name="gather.big")
    want = torch.cat([torch.arange(BIG // 4, dtype=torch.int64) + i for i in range(size)])
    check(torch.equal(g, want), "large allgather is wrong")
    # broadcast from the last rank (on the last host), small and large.
    for n in (5, BIG):
        b = hvd.broadcast(torch.full((n,), float(r)), root_rank=size - 1, name=f"bcast.{n}")
        check(torch.equal(b, torch.full((n,), float(size - 1))), f"broadcast of {n} elements is wrong")
    # alltoall: rank r sends k copies of 100*r + j to rank j; it receives 100*i + r from every rank i.
    k = 3
    send = torch.cat([torch.full((k,), 100.0 * r + j) for j in range(size)])
    got = hvd.alltoall(send, name="a2a")
    check(torch.equal(got, torch.cat([torch.full((k,), 100.0 * i + r) for i in range(size)])), "alltoall is wrong")
    # Uneven splits: rank r sends j+1 rows to rank j.
    splits = torch.tensor([j + 1 for j in range(size)])
    send = torch.cat([torch.full((j + 1, 2), 10.0 * r + j) for j in range(size)])
    got, received = hvd.alltoall(send, splits=splits, name="a2a.uneven")
    check(received.tolist() == [r + 1] * size, f"alltoall received splits {received.tolist()}")
    check(torch.equal(got, torch.cat([torch.full((r + 1, 2), 10.0 * i + r) for i in range(size)])),
          "alltoall with splits is wrong")


def collectives(hosts, per_host, nic=None):
    hvd.init()
    check_layout(hosts, per_host)
    if nic is not None:
        check(os.environ.get("PERSEUS_NETWORK_INTERFACE") == nic,
              f"PERSEUS_NETWORK_INTERFACE is {os.environ.get('PERSEUS_NETWORK_INTERFACE')!r}, expected {nic!r}")
    moved = check_allreduce()
    check_gather_broadcast_alltoall()
    print(f"OK collectives rank {hvd.rank()} of {hvd.size()} on {socket.gethostname()} "
          f"local {hvd.local_rank()}/{hvd.local_size()} cross {hvd.cross_rank()}/{hvd.cross_size()} "
          f"large allreduce bytes {moved}", flush=True)


def train(hosts, per_host):
    hvd.init()
    check_layout(hosts, per_host)
    torch.manual_seed(1234 + hvd.rank())  # different initial weights on every rank: the broadcast must fix it
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    gen = torch.Generator().manual_seed(99 + hvd.rank())  # every rank its own data
    w_true = torch.linspace(-1, 1, 16)
    losses = []
    for _ in range(8):
        x = torch.randn(32, 16, generator=gen)
        y = (x @ w_true).unsqueeze(1)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(hvd.allreduce(loss.detach(), name="loss").item())
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = hvd.allgather(flat.unsqueeze(0), name="params")
    check(all(torch.equal(every[0], every[i]) for i in range(hvd.size())), "parameters differ between ranks")
    check(not torch.equal(flat, start), "training did not change the parameters")
    check(losses[-1] < losses[0], f"loss did not fall: {losses}")
    print(f"OK train rank {hvd.rank()} on {socket.gethostname()} loss {losses[0]:.4f} -> {losses[-1]:.4f}",
          flush=True)


def hitopk(hosts, per_host):
    """Hierarchical top-k across hosts: density 1 equals the dense all-reduce, every rank gets the same
    result, and what was sent plus every rank's residual equals the dense sum; then a short training run."""
    hvd.init()
    check_layout(hosts, per_host)
    torch.manual_seed(7 + hvd.rank())
    x = torch.randn(10007)
    dense = hvd.allreduce(x, name="hitopk.dense", op=hvd.Sum)
    for density in (1.0, 0.05):
        comp = hvd.Compression.hitopk(density)
        y = hvd.allreduce(x, name=f"hitopk.{density}", compression=comp, op=hvd.Sum)
        every = hvd.allgather(y.unsqueeze(0), name=f"hitopk.all.{density}")
        check(all(torch.equal(every[0], every[i]) for i in range(hvd.size())), "hitopk results differ")
        left = hvd.allreduce(torch.from_numpy(comp.residual(f"hitopk.{density}").copy()),
                             name=f"hitopk.res.{density}", op=hvd.Sum)
        check(torch.allclose(y + left, dense, atol=1e-4), f"density {density}: sent + residuals != dense sum")
        if density == 1.0:
            check(torch.allclose(y, dense, atol=1e-4), "density 1 differs from the dense all-reduce")
        else:
            nonzero = int((y != 0).sum())
            check(nonzero <= hosts * 0.05 * 10007 + hvd.size() * 2, f"too many nonzeros: {nonzero}")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compression=hvd.Compression.hitopk(0.1),
                                   named_parameters=model.named_parameters())
    gen = torch.Generator().manual_seed(99 + hvd.rank())
    for _ in range(5):
        xb = torch.randn(32, 16, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), xb.sum(1, keepdim=True)).backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = hvd.allgather(flat.unsqueeze(0), name="hitopk.params")
    check(all(torch.equal(every[0], every[i]) for i in range(hvd.size())), "parameters differ between ranks")
    try:  # a gradient whose size differs on one rank fails on every rank, naming it
        hvd.allreduce(torch.ones(100 if hvd.rank() == 0 else 101), name="hitopk.bad",
                      compression=hvd.Compression.hitopk(0.1))
    except hvd.HorovodInternalError as exc:
        check("hitopk.bad" in str(exc), f"the error does not name the tensor: {exc}")
    else:
        check(False, "a size mismatch was not reported")
    print(f"OK hitopk rank {hvd.rank()} on {socket.gethostname()}", flush=True)


def tcp_connections_to(peer_ip):
    """Established TCP connections of this process to peer_ip (IPv4), from /proc/net/tcp and our fds."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    want = "".join(f"{int(part):02X}" for part in reversed(peer_ip.split(".")))  # little-endian hex
    count = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if state == "01" and remote.split(":")[0] == want and inode in inodes:
                count += 1
    return count


def flows(hosts, per_host):
    """Every channel must have its own TCP connection to the other host once large all-reduces ran. The
    channels are those in use (init() chooses them by topology when PERSEUS_NUM_CHANNELS is unset), as the
    settings report them and as the engine runs them."""
    from perseus.runtime.state import runtime

    hvd.init()
    check_layout(hosts, per_host)
    channels = runtime().settings.num_channels
    check(runtime().engine.params(0)[2] == channels, f"engine runs {runtime().engine.params(0)[2]} channels, "
                                                     f"settings say {channels}")
    xs = [torch.full((BIG,), 1.0) for _ in range(2 * channels)]  # 4 MB each: one unit per channel, twice
    for h in [hvd.allreduce_async_(x, op=hvd.Sum, name=f"flow.{i}") for i, x in enumerate(xs)]:
        hvd.synchronize(h)
    check(all(torch.equal(x, torch.full((BIG,), float(hvd.size()))) for x in xs), "allreduce is wrong")
    peer = socket.gethostbyname(NAMES[1 - hvd.rank() // per_host])
    n = tcp_connections_to(peer)
    hvd.barrier()  # nobody closes a connection before every rank has counted
    print(f"OK flows rank {hvd.rank()} channels {channels} connections {n}", flush=True)


if __name__ == "__main__":
    mode, NAMES[:], n_per_host = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    n_hosts = len(NAMES)
    if mode == "collectives":
        collectives(n_hosts, n_per_host, sys.argv[4] if len(sys.argv) > 4 else None)
    elif mode == "train":
        train(n_hosts, n_per_host)
    elif mode == "flows":
        flows(n_hosts, n_per_host)
    elif mode == "hitopk":
        hitopk(n_hosts, n_per_host)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    hvd.shutdown()
