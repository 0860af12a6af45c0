"""The driver side of test_ray_cluster.py, run inside the emulated host where Ray's head runs.

``python ray_cluster_job.py static HEAD:PORT``: RayExecutor with 2 workers on each of 2 nodes trains and returns
every rank's (rank, size, host, parameters). ``python ray_cluster_job.py elastic-rank|elastic-actor HEAD:PORT``:
an ElasticRayExecutor job on 4 slots where rank 3's process (on the second node) is killed at step 12, or the
agent actor of the second node is killed from here; the job must finish on what is left. The last line printed
is JSON.
"""

import json
import os
import sys
import time

import cloudpickle
import ray

from perseus.ray import ElasticRayExecutor, RayExecutor

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def train(steps):
    import socket

    import torch

    import perseus.torch as hvd

    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(8, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
    return hvd.rank(), hvd.size(), socket.gethostname(), [float(x) for p in model.parameters() for x in p.flatten()]


def elastic_train(kill_rank):
    import signal
    import socket

    import torch

    import perseus.torch as hvd
    from perseus.ray import ray_logger

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0)

    @hvd.elastic.run
    def loop(state):
        while state.step < 40:
            if kill_rank and state.step == 12 and hvd.size() == 4 and hvd.rank() == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            if hvd.rank() == 0:
                ray_logger.log({"step": state.step, "size": hvd.size()})
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            state.step += 1
            time.sleep(0.1)
            if state.step % 4 == 0:
                state.commit()
        return hvd.rank(), hvd.size(), socket.gethostname(), state.step, [float(p.sum()) for p in model.parameters()]

    return loop(state)


def main(mode, address):
    ray.init(address=address, log_to_driver=True)
    if mode == "static":
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=90), num_hosts=2, num_workers_per_host=2)
        executor.start()
        try:
            out = executor.run(train, args=[4])
        finally:
            executor.shutdown()
    else:
        settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4, elastic_timeout=60)
        executor = ElasticRayExecutor(settings, cpus_per_slot=1)
        executor.start()
        killed = []

        def kill_agent(info):  # called with what rank 0 logs: the agent goes once generation 0 trained 8 steps
            if mode == "elastic-actor" and not killed and info["size"] == 4 and info["step"] >= 8:
                agent = next(a for a, name, _ in executor._agents.values() if name == "perseus-node-1")
                ray.kill(agent)
                killed.append(info["step"])
                print(f"killed the agent actor of perseus-node-1 at step {info['step']}", flush=True)
        try:
            out = executor.run(elastic_train, args=[mode == "elastic-rank"], callbacks=[kill_agent])
        finally:
            executor.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
