"""GPU training step and small all-reduces: perseus (NCCL launcher, host staging) vs torch DDP, side by side.

    mpirun -np 2 python benchmarks/gpu_step.py --out results.json      (tools/gpu_check.sh runs it)

Every rank trains the same model on CUDA. The modes alternate in rounds (interleaved, so drift in clocks or
load hits each alike): ``local`` (no communication: the compute floor), ``perseus_nccl`` (DistributedOptimizer;
all-reduces through perseus's NCCL launcher), ``perseus_nccl_cycle2ms`` (the same with a 2 ms negotiation
cycle for every request, instead of the 1 ms device cycle during bursts), ``perseus_stage``
(PERSEUS_DEVICE_BACKEND=stage: gradients staged through host memory and reduced by perseus's MPI channels)
and ``ddp`` (DistributedDataParallel on NCCL). Then the per-call cost of one small synchronous all-reduce
(1 KB, the call returning once the result is there): perseus's NCCL launcher (its finalizer spinning on the
done event, or sleeping on a blocking-sync event) vs ``torch.distributed.all_reduce`` on NCCL followed by a
stream synchronize. Rank 0 writes medians and ratios to ``--out`` (JSON).

Several processes on one GPU: NCCL would refuse two ranks on one device, so each rank announces its own
NCCL_HOSTID and NCCL treats them as separate hosts talking over loopback sockets (correct, not fast), and
perseus's staging runs over MPI's shared memory. Such a run measures overheads on one card; it says nothing
about NVLink or multi-host speed.
"""

import argparse
import json
import os
import statistics
import time

from mpi4py import MPI

_rank = MPI.COMM_WORLD.Get_rank()
os.environ.setdefault("NCCL_HOSTID", f"perseus-bench-{_rank}")  # before torch loads NCCL
os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
os.environ.setdefault("NCCL_P2P_DISABLE", "1")
os.environ.setdefault("NCCL_SHM_DISABLE", "1")
os.environ.setdefault("NCCL_IB_DISABLE", "1")
os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import perseus.torch as hvd  # noqa: E402
from perseus.torch import device as _device  # noqa: E402


def make_model(name):
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=100), (3, 96, 96), 100
    if name == "mlp":  # many small tensors: per-tensor overhead dominates
        layers = []
        for _ in range(24):
            layers += [nn.Linear(256, 256), nn.ReLU()]
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 256), *layers, nn.Linear(256, 10)), (3, 8, 8), 10
    raise ValueError(name)


def build(mode, name, batch, device):
    torch.manual_seed(0)
    model, shape, classes = make_model(name)
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if mode.startswith("perseus"):
        opt = hvd.DistributedOptimizer(opt, named_parameters=[(f"{mode}.{name}.{n}", p) for n, p in
                                                              model.named_parameters()])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, classes, (batch,), device=device)

    nccl = mode != "perseus_stage"
    blocking = False
    cycle_us = 2000 if mode == "perseus_nccl_cycle2ms" else 0

    def step():
        # What the settings decide, switched per mode within one job.
        _device._nccl = nccl
        _device.CudaStreams.blocking = blocking
        set_cycle_time(cycle_us)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


_tunes = [0]


def set_cycle_time(cycle_us):
    """Change the negotiation cycle at run time (a TUNE request: collective, same values on every rank)."""
    engine = hvd.mpi_ops._runtime.engine
    fusion, inplace, channels, current, algorithm = engine.params(0)[:5]
    if current != cycle_us:
        _tunes[0] += 1
        hvd.synchronize(engine.tune(0, f"bench.cycle.{_tunes[0]}", fusion, inplace, channels, cycle_us, algorithm))


def small_allreduce(mode, device, calls):
    """Per-call seconds of ``calls`` synchronous all-reduces of 256 floats."""
    t = torch.ones(256, device=device)
    if mode.startswith("perseus_nccl"):
        _device._nccl = True
        _device.CudaStreams.blocking = mode == "perseus_nccl_blocking"
        set_cycle_time(0)

        def once(i):
            hvd.allreduce_(t, op=hvd.Sum, name="small")
    else:
        def once(i):  # synchronous too: the call returns when the result is there
            dist.all_reduce(t)
            torch.cuda.current_stream().synchronize()
    for i in range(10):
        once(i)
    torch.cuda.synchronize()
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for i in range(calls):
        once(i)
    torch.cuda.synchronize()
    return MPI.COMM_WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX) / calls


def time_steps(step, steps):
    torch.cuda.synchronize()
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return MPI.COMM_WORLD.allreduce(elapsed, op=MPI.MAX) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,mlp")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    hvd.init()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = MPI.COMM_WORLD.bcast(29500 + os.getpid() % 1000 if hvd.rank() == 0 else None, root=0)
    os.environ.setdefault("MASTER_PORT", str(port))
    ddp_error = None
    try:
        dist.init_process_group("nccl", rank=hvd.rank(), world_size=hvd.size(), device_id=device)
    except Exception as exc:  # noqa: BLE001 - reported in the results, the other modes still run
        ddp_error = f"{type(exc).__name__}: {exc}"
    modes = ["local", "perseus_nccl", "perseus_nccl_cycle2ms", "perseus_stage"] + ([] if ddp_error else ["ddp"])
    results = {"device": torch.cuda.get_device_name(device), "ranks": hvd.size(), "torch": torch.__version__,
               "nccl": ".".join(map(str, torch.cuda.nccl.version())), "batch_per_rank": args.batch,
               "steps_per_round": args.steps, "rounds": args.rounds, "ddp_error": ddp_error, "models": {}}
    for name in args.models.split(","):
        steps = {m: build(m, name, args.batch, device) for m in modes}
        for m in modes:  # warm-up: cuDNN choices, NCCL and perseus channels, pinned buffers
            time_steps(steps[m], 3)
        samples = {m: [] for m in modes}
        for _ in range(args.rounds):
            for m in modes:
                samples[m].append(time_steps(steps[m], args.steps))
        med = {m: statistics.median(v) for m, v in samples.items()}
        params = sum(p.numel() for p in make_model(name)[0].parameters())
        entry = {"parameters": params, "median_step_ms": {m: round(v * 1e3, 3) for m, v in med.items()},
                 "samples_ms": {m: [round(x * 1e3, 3) for x in v] for m, v in samples.items()},
                 "ratio_to_local": {m: round(v / med["local"], 3) for m, v in med.items()}}
        if "ddp" in med:
            entry["ratio_to_ddp"] = {m: round(v / med["ddp"], 3) for m, v in med.items()}
        results["models"][name] = entry
        if hvd.rank() == 0:
            print(name, json.dumps(entry["median_step_ms"]), json.dumps(entry.get("ratio_to_ddp")), flush=True)
    if not ddp_error:
        small = {m: [] for m in ("perseus_nccl", "perseus_nccl_blocking", "torch_nccl")}
        for _ in range(args.rounds):
            for m in small:
                small[m].append(small_allreduce(m, device, 200))
        med = {m: statistics.median(v) * 1e6 for m, v in small.items()}
        results["small_allreduce_us"] = {"median": {m: round(v, 1) for m, v in med.items()},
                                         "samples": {m: [round(x * 1e6, 1) for x in v] for m, v in small.items()},
                                         "perseus_over_torch": round(med["perseus_nccl"] / med["torch_nccl"], 3)}
        if hvd.rank() == 0:
            print("small all-reduce (us)", json.dumps(results["small_allreduce_us"]["median"]), flush=True)
    if hvd.rank() == 0:
        text = json.dumps(results, indent=2)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    if not ddp_error:
        dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
