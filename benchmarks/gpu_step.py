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

``--backend gloo`` runs the same comparison on CPU, where CI can run it: the launcher moves CPU tensors with
torch's Gloo backend (``PERSEUS_DEVICE_BACKEND=gloo``), against DDP on Gloo. Modes: ``local``, ``perseus``
(the launcher with its device buckets), ``perseus_rounds`` (the launcher, one unit per negotiation round: device
buckets off), ``perseus_host`` (perseus's own CPU channels, no launcher) and ``ddp``. ``--launch-cost-ms``
injects a fixed cost into every launch, perseus's and DDP's alike (a sleep where each issues its collective),
standing in for an expensive NCCL call. Both backends report launches per step (perseus: ``device_stats()``;
DDP: its communication hook's calls, one per bucket) and, after the interleaved rounds, how far each mode's
parameters are from DDP's (every mode trains the same steps on the same data).
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


def resnet18(classes):
    """ResNet-18's layout and parameter shapes, as examples/pytorch_synthetic_benchmark.py defines it (for when
    torchvision is not installed)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                        "pytorch_synthetic_benchmark.py")
    spec = importlib.util.spec_from_file_location("perseus_example_resnet", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ResNet(module.MODELS["resnet18"], num_classes=classes)


_image = [96]  # side of the synthetic images (--image-size)


def make_model(name):
    if name == "resnet18":
        try:
            import torchvision

            model = torchvision.models.resnet18(num_classes=100)
        except ImportError:
            model = resnet18(100)
        return model, (3, _image[0], _image[0]), 100
    if name == "mlp":  # many small tensors: per-tensor overhead dominates
        layers = []
        for _ in range(24):
            layers += [nn.Linear(256, 256), nn.ReLU()]
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 256), *layers, nn.Linear(256, 10)), (3, 8, 8), 10
    raise ValueError(name)


class Counter:
    """Launches: perseus's from its launcher's counters, DDP's from its communication hook."""

    def __init__(self):
        self.ddp = 0

    def launches(self, mode):
        return self.ddp if mode == "ddp" else hvd.device_stats()["launches"]


_counter = Counter()
_launch_cost_s = [0.0]


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
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model = nn.parallel.DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device.index])

        def hook(state, bucket):  # one call per bucket: DDP's launches
            _counter.ddp += 1
            if _launch_cost_s[0]:
                time.sleep(_launch_cost_s[0])
            return default_hooks.allreduce_hook(state, bucket)
        model.register_comm_hook(None, hook)
    torch.manual_seed(1)
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, classes, (batch,), device=device)

    launcher = mode not in ("perseus_stage", "perseus_host")
    blocking = _device.CudaStreams.blocking  # (the default)
    cycle_us = 2000 if mode == "perseus_nccl_cycle2ms" else 0
    budget = 0 if mode == "perseus_rounds" else None  # None: the budget perseus chose (measured)

    def step():
        # What the settings decide, switched per mode within one job.
        if device.type == "cuda":
            _device._nccl = launcher
            _device.CudaStreams.blocking = blocking
        else:
            _device._gloo = launcher
        set_params(cycle_us, budget)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    step.model = model.module if mode == "ddp" else model
    return step


_tunes = [0]
_chosen_budget = [None]  # the device buckets' budget perseus chose, while a mode runs with buckets off


def set_params(cycle_us, budget):
    """Change the negotiation cycle and the device buckets' budget at run time (a TUNE request: collective, the
    same values on every rank). ``budget`` None: the one perseus chose (measured when its groups were built)."""
    engine = hvd.mpi_ops._runtime.engine
    fusion, inplace, channels, current, algorithm, _, current_budget = engine.params(0)[:7]
    if budget is None:
        budget = current_budget if _chosen_budget[0] is None else _chosen_budget[0]
    elif current_budget and budget != current_budget:
        _chosen_budget[0] = current_budget
    if current != cycle_us or current_budget != budget:
        _tunes[0] += 1
        hvd.synchronize(engine.tune(0, f"bench.params.{_tunes[0]}", fusion, inplace, channels, cycle_us, algorithm,
                                    budget))


def set_cycle_time(cycle_us):
    set_params(cycle_us, None)


def small_allreduce(mode, device, calls):
    """Per-call seconds of ``calls`` synchronous all-reduces of 256 floats."""
    t = torch.ones(256, device=device)
    if mode.startswith("perseus_nccl"):
        _device._nccl = True
        _device.CudaStreams.blocking = mode == "perseus_nccl_blocking"  # (the finalizer's wait only)
        set_cycle_time(0)

        def once(i):  # (completion is stream-ordered: the host waits for the stream, as torch's does below)
            hvd.allreduce_(t, op=hvd.Sum, name="small")
            torch.cuda.current_stream().synchronize()
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


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, steps, device, mode):
    """(seconds per step, launches per step) over ``steps`` steps (the slowest rank's time), after one untimed step
    (the mode's settings switched, and its device buckets learned again where the budget changed)."""
    step()
    _sync(device)
    MPI.COMM_WORLD.Barrier()
    launches = _counter.launches(mode)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    elapsed = time.perf_counter() - start
    launches = (_counter.launches(mode) - launches) / steps
    return MPI.COMM_WORLD.allreduce(elapsed, op=MPI.MAX) / steps, launches


def _inject_launch_cost(seconds):
    """Every collective perseus's launcher issues (its launches, and the measurement its bucket budget comes from)
    and every DDP bucket (its hook) sleeps ``seconds`` first."""
    _launch_cost_s[0] = seconds
    if seconds:
        real = _device._Launcher._collective

        def slow_collective(self, *args):
            time.sleep(seconds)
            return real(self, *args)
        _device._Launcher._collective = slow_collective


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                        help="nccl: CUDA tensors (a GPU); gloo: CPU tensors, the launcher on Gloo vs DDP on Gloo")
    parser.add_argument("--models", default="resnet18,mlp")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=96, help="side of ResNet-18's synthetic images")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--launch-cost-ms", type=float, default=0.0,
                        help="a fixed cost added to every launch of perseus and DDP alike")
    parser.add_argument("--out", default="", help="write the results here (JSON)")
    parser.add_argument("--jsonl", default="", help="append the results here as one JSON line")
    args = parser.parse_args()

    _image[0] = args.image_size
    gloo = args.backend == "gloo"
    if gloo:
        os.environ["PERSEUS_DEVICE_BACKEND"] = "gloo"
    hvd.init()
    if gloo:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    _inject_launch_cost(args.launch_cost_ms / 1e3)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = MPI.COMM_WORLD.bcast(29500 + os.getpid() % 1000 if hvd.rank() == 0 else None, root=0)
    os.environ.setdefault("MASTER_PORT", str(port))
    ddp_error = None
    try:
        if gloo:
            dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())
        else:
            dist.init_process_group("nccl", rank=hvd.rank(), world_size=hvd.size(), device_id=device)
    except Exception as exc:  # noqa: BLE001 - reported in the results, the other modes still run
        ddp_error = f"{type(exc).__name__}: {exc}"
    if gloo:
        modes = ["local", "perseus", "perseus_rounds", "perseus_host"]
    else:
        modes = ["local", "perseus_nccl", "perseus_nccl_cycle2ms", "perseus_stage"]
    modes += [] if ddp_error else ["ddp"]
    results = {"backend": args.backend, "device": "cpu" if gloo else torch.cuda.get_device_name(device),
               "ranks": hvd.size(), "torch": torch.__version__,
               "nccl": None if gloo else ".".join(map(str, torch.cuda.nccl.version())),
               "batch_per_rank": args.batch, "steps_per_round": args.steps, "rounds": args.rounds,
               "launch_cost_ms": args.launch_cost_ms,
               "ddp_error": ddp_error, "models": {}}
    for name in args.models.split(","):
        steps = {m: build(m, name, args.batch, device) for m in modes}
        for m in modes:  # warm-up: cuDNN choices, NCCL and perseus channels, pinned buffers, learned buckets
            time_steps(steps[m], 3, device, m)
        samples = {m: [] for m in modes}
        launches = {m: [] for m in modes}
        for _ in range(args.rounds):
            for m in modes:
                t, n = time_steps(steps[m], args.steps, device, m)
                samples[m].append(t)
                launches[m].append(n)
        med = {m: statistics.median(v) for m, v in samples.items()}
        params = sum(p.numel() for p in make_model(name)[0].parameters())
        entry = {"parameters": params, "median_step_ms": {m: round(v * 1e3, 3) for m, v in med.items()},
                 "samples_ms": {m: [round(x * 1e3, 3) for x in v] for m, v in samples.items()},
                 "ratio_to_local": {m: round(v / med["local"], 3) for m, v in med.items()},
                 "launches_per_step": {m: statistics.median(v) for m, v in launches.items() if m != "local"}}
        if "ddp" in med:
            entry["ratio_to_ddp"] = {m: round(v / med["ddp"], 3) for m, v in med.items()}
            ref = [p.detach().cpu() for p in steps["ddp"].model.parameters()]
            entry["max_param_diff_vs_ddp"] = {
                m: max(float((p.detach().cpu() - q).abs().max()) for p, q in zip(steps[m].model.parameters(), ref))
                for m in modes if m not in ("local", "ddp")}
        stats = hvd.device_stats()
        entry["device_bucket_bytes"] = _chosen_budget[0] or stats["bucket_bytes"]
        entry["measured_launch_cost_ms"] = round(stats.get("launch_cost_s", float("nan")) * 1e3, 3)
        results["models"][name] = entry
        if hvd.rank() == 0:
            print(name, json.dumps(entry["median_step_ms"]), json.dumps(entry.get("ratio_to_ddp")),
                  json.dumps(entry["launches_per_step"]), flush=True)
    if not ddp_error and not gloo:
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
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(results) + "\n")
    if not ddp_error:
        dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
