"""The rank side of the elastic tests (test_elastic.py, test_elastic_faults.py), run by perseusrun's elastic
launcher, and the reference it is compared with.

    python elastic_job.py train OUT_DIR          (under perseusrun --host-discovery-script ...)
    python elastic_job.py reference OUT_DIR      (one process, no perseus: the same steps, full batch)
    python elastic_job.py plain OUT_DIR          (a script without elastic.run: one allreduce)

The model is a small MLP; step s uses a global batch of GLOBAL samples drawn from seed s, split over the ranks;
each rank's loss is its samples' summed loss / GLOBAL and gradients are summed over ranks, so a step's update
does not depend on how many ranks share the batch. The state is committed after every step.

Every rank appends one JSON line per event to OUT_DIR/events.jsonl (start, restored, step, done); rank 0
writes the final parameters to OUT_DIR/final.npy. Faults are injected from the environment:

    FAULT_KIND   kill (SIGKILL self) | stop (SIGSTOP self) | raise (ValueError in the training function) |
                 exit (os._exit(3)) | mismatch (a collective no other rank makes) | none
    FAULT_AT     step (top of the step) | backward (while gradients are being reduced) | commit (during the
                 copy of the commit to the keepers) | random (a timer at a random moment of the step) |
                 outside (before elastic.run is called; with FAULT_KIND=raise)
    FAULT_RANK   rank that faults (default 1);  FAULT_STEP  it does at the first step >= this (default 5)
    FAULT_GEN    generation in which it does (default 0; "all": every generation)
    STEPS        steps in all (default 24);  STEP_SLEEP  seconds of pretend compute per step (default 0.05)
    WAIT_FILE    if set: after step FAULT_STEP rank 0 waits until this file exists (the test changes hosts)
"""

import json
import os
import random
import signal
import socket
import sys
import threading
import time

import numpy as np
import torch

GLOBAL = 12
STEPS = int(os.environ.get("STEPS", "24"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.05"))
KIND = os.environ.get("FAULT_KIND", "none")
AT = os.environ.get("FAULT_AT", "step")
FRANK = int(os.environ.get("FAULT_RANK", "1"))
FSTEP = int(os.environ.get("FAULT_STEP", "5"))
FGEN = os.environ.get("FAULT_GEN", "0")
GEN = int(os.environ.get("PERSEUS_ELASTIC_GENERATION", "0"))


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL, 16, generator=g), torch.randn(GLOBAL, 4, generator=g)


def reference(out):
    model, opt = model_and_optimizer()
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        (((model(x) - y) ** 2).sum() / GLOBAL).backward()
        opt.step()
    np.save(os.path.join(out, "reference.npy"), flat(model))


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def train(out):
    import faulthandler

    import perseus.torch as hvd

    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> prints every thread's stack (a hang's diagnosis)

    hvd.init()
    rank = hvd.rank()
    events = open(os.path.join(out, "events.jsonl"), "a")

    attempts = []

    def event(kind, **kw):
        events.write(json.dumps(dict(kind=kind, gen=GEN, attempt=len(attempts), rank=hvd.rank(),
                                     size=hvd.size(), host=socket.gethostname(), pid=os.getpid(), t=time.time(),
                                     **kw)) + "\n")
        events.flush()

    model, opt = model_and_optimizer()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Sum)
    state = hvd.elastic.TorchState(model, opt, step=0)
    event("start")
    def faulty():
        """Whether this process faults: with FAULT_GEN=all, whichever process is rank FAULT_RANK now (ranks are
        renumbered when the job re-forms in process, so the fault strikes again); else the process that started
        as rank FAULT_RANK in generation FAULT_GEN."""
        if KIND == "none":
            return False
        if FGEN == "all":
            return hvd.rank() == FRANK
        return rank == FRANK and int(FGEN) == GEN

    fired = []  # a fault fires once per process, at the first step >= FAULT_STEP

    def fault():
        if KIND == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif KIND == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif KIND == "exit":
            os._exit(3)

    if AT == "backward":
        def hook(grad):
            if faulty() and state.step >= FSTEP and not fired:
                fired.append(1)
                time.sleep(0.01)  # let the other gradients' reductions start
                if KIND == "raise":
                    raise ValueError(f"injected failure at step {FSTEP}")
                fault()
            return grad
        list(model.parameters())[0].register_hook(hook)

    if AT == "commit":
        store_put = None

        def arm():
            nonlocal store_put
            session = state._elastic_session
            store_put = session.store.put

            def put(version, payload):
                if faulty() and state.step >= FSTEP + 1 and not fired:
                    fired.append(1)
                    threading.Timer(0.002, fault).start()
                return store_put(version, payload)
            session.store.put = put

    @hvd.elastic.run
    def loop(state):
        if AT == "commit" and store_put is None:
            arm()
        attempts.append(1)
        event("restored", step=state.step)
        while state.step < STEPS:
            s = state.step
            if faulty() and s >= FSTEP and (not fired or KIND == "mismatch") and AT in ("step", "random"):
                fired.append(1)  # a mismatch comes back at every attempt; the other faults strike once
                if AT == "step":
                    if KIND == "raise":
                        raise ValueError(f"injected failure at step {s}")
                    if KIND == "mismatch":
                        hvd.allreduce(torch.ones(3), name="only.on.one.rank")
                    fault()
                elif AT == "random":
                    threading.Timer(random.uniform(0.0, 0.1), fault).start()
            x, y = batch(s)
            share = np.array_split(np.arange(GLOBAL), hvd.size())[hvd.rank()]
            opt.zero_grad()
            (((model(x[share]) - y[share]) ** 2).sum() / GLOBAL).backward()
            opt.step()
            time.sleep(STEP_SLEEP)
            state.step = s + 1
            state.commit()
            event("step", step=state.step)
            wait = os.environ.get("WAIT_FILE")
            if wait and hvd.rank() == 0 and state.step == FSTEP and GEN == 0:
                deadline = time.time() + 60
                while not os.path.exists(wait) and time.time() < deadline:
                    time.sleep(0.1)
        return state.step

    if AT == "outside" and faulty():
        raise ValueError("injected failure outside elastic.run")
    final = loop(state)
    event("done", step=final)
    if hvd.rank() == 0:
        np.save(os.path.join(out, "final.npy"), flat(model))
    hvd.shutdown()


def plain(out):
    """A script that never calls elastic.run, run by the elastic launcher all the same."""
    import perseus.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    if hvd.rank() == 0:
        with open(os.path.join(out, "plain.txt"), "w") as f:
            f.write(f"{int(total[0])}\n")
    hvd.shutdown()


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    {"reference": reference, "plain": plain}.get(mode, train)(out_dir)
