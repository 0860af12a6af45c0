"""The rank side of the TensorFlow elastic tests (test_elastic_tf.py), run by perseusrun's elastic launcher, and
the reference it is compared with: elastic_job.py's arrangement (events, final parameters, faults) for
perseus.tensorflow.elastic and the Keras elastic path.

    python elastic_job_tf.py train OUT_DIR       (under perseusrun --host-discovery-script ...)
    python elastic_job_tf.py reference OUT_DIR   (one process, no perseus: the same steps, full batch)

The model is a small Keras MLP; step s uses a global batch of GLOBAL samples drawn from seed s, split evenly
over the ranks (GLOBAL is a multiple of 1, 2 and 3 ranks), and minimises the batch's mean squared error, so a
step's update does not depend on how many ranks share it. JOB_MODE picks how a rank trains:

    tf      a custom loop in a tf.function with DistributedGradientTape(op=Sum); TensorFlowState keeps the
            model's and the optimizer's variables; committed after every step
    keras   model.fit with DistributedOptimizer, one step per epoch; TensorFlowKerasState keeps model and
            optimizer; the elastic callbacks count the epochs and commit at the end of each

Every rank appends one JSON line per event to OUT_DIR/events.jsonl (start, reset, restored, step, done) and writes its
final parameters to OUT_DIR/final-rankR.npy; rank 0 also to OUT_DIR/final.npy. Faults come from the
environment as in elastic_job.py:

    FAULT_KIND   kill (SIGKILL self) | none;   FAULT_AT  step (top of the step) | random (a timer at a random
                 moment of the step, most likely inside the step's graph)
    FAULT_RANK   rank that faults (default 1);  FAULT_STEP  it does at the first step >= this (default 5)
    FAULT_GEN    generation in which it does (default 0)
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

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL, IN, OUT = 12, 16, 4
STEPS = int(os.environ.get("STEPS", "24"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.05"))
MODE = os.environ.get("JOB_MODE", "tf")
KIND = os.environ.get("FAULT_KIND", "none")
AT = os.environ.get("FAULT_AT", "step")
FRANK = int(os.environ.get("FAULT_RANK", "1"))
FSTEP = int(os.environ.get("FAULT_STEP", "5"))
FGEN = int(os.environ.get("FAULT_GEN", "0"))
GEN = int(os.environ.get("PERSEUS_ELASTIC_GENERATION", "0"))


def make_model():
    model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(64, activation="tanh"),
                              keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(OUT)])
    rng = np.random.RandomState(0)
    model.set_weights([rng.uniform(-0.3, 0.3, w.shape).astype("float32") for w in model.get_weights()])
    return model


def make_optimizer():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def batch(step):
    rng = np.random.RandomState(1000 + step)
    return rng.randn(GLOBAL, IN).astype("float32"), rng.randn(GLOBAL, OUT).astype("float32")


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


def reference(out):
    model, opt = make_model(), make_optimizer()
    for step in range(STEPS):
        x, y = batch(step)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    np.save(os.path.join(out, "reference.npy"), flat(model))


class Job:
    """One rank's training: its events, its faults, and the pieces both modes share."""

    def __init__(self, hvd, out):
        self.hvd = hvd
        self.rank = hvd.rank()  # the rank this process started as
        self.events = open(os.path.join(out, "events.jsonl"), "a")
        self.attempts = 0
        self.fired = False

    def event(self, kind, **kw):
        self.events.write(json.dumps(dict(kind=kind, gen=GEN, attempt=self.attempts, rank=self.hvd.rank(),
                                          size=self.hvd.size(), host=socket.gethostname(), pid=os.getpid(),
                                          t=time.time(), **kw)) + "\n")
        self.events.flush()

    def watch_resets(self, state):
        """Record each reset callback's call, with the job's size then (it runs before the state's sync)."""
        state.register_reset_callbacks([lambda: self.event("reset")])

    def share(self, step):
        """This rank's part of step ``step``'s global batch."""
        x, y = batch(step)
        mine = np.array_split(np.arange(GLOBAL), self.hvd.size())[self.hvd.rank()]
        return x[mine], y[mine]

    def maybe_fault(self, step):
        """At the first step >= FAULT_STEP of generation FAULT_GEN, on the process that started as FAULT_RANK."""
        if KIND != "kill" or self.fired or step < FSTEP or self.rank != FRANK or GEN != FGEN:
            return
        self.fired = True
        if AT == "random":
            threading.Timer(random.uniform(0.0, 0.1), os.kill, (os.getpid(), signal.SIGKILL)).start()
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, step):
        """Pretend compute, record the committed step, and hold rank 0 for the test's host change."""
        self.event("step", step=step)
        wait = os.environ.get("WAIT_FILE")
        if wait and self.hvd.rank() == 0 and step == FSTEP and GEN == 0:
            deadline = time.time() + 60
            while not os.path.exists(wait) and time.time() < deadline:
                time.sleep(0.1)


def train_tf(job, model):
    """A custom loop; TensorFlowState keeps the variables of the model and the optimizer."""
    import perseus.tensorflow as hvd
    import perseus.tensorflow.elastic as elastic

    opt = make_optimizer()
    opt.build(model.trainable_variables)
    state = elastic.TensorFlowState(list(model.variables) + list(opt.variables), step=0)
    job.watch_resets(state)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((model(x) - y) ** 2) / (GLOBAL * OUT)
        grads = hvd.DistributedGradientTape(tape, op=hvd.Sum).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @elastic.run
    def loop(state):
        job.attempts += 1
        job.event("restored", step=state.step)
        while state.step < STEPS:
            job.maybe_fault(state.step)
            train_step(*job.share(state.step))
            time.sleep(STEP_SLEEP)
            state.step += 1
            state.commit()
            job.after_step(state.step)
        return state.step

    return loop(state)


def train_keras(job, model):
    """model.fit, one step per epoch; TensorFlowKerasState and the elastic callbacks."""
    import perseus.tensorflow.keras as hvd

    model.compile(optimizer=hvd.DistributedOptimizer(make_optimizer()), loss="mse")
    state = hvd.elastic.KerasState(model, epoch=0)  # the optimizer has no slots yet, as in Horovod's examples
    job.watch_resets(state)

    class Steps(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            job.maybe_fault(state.epoch)

        def on_epoch_end(self, epoch, logs=None):  # after the commit of the callbacks before this one
            time.sleep(STEP_SLEEP)
            job.after_step(state.epoch)

    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=STEPS + 1), Steps()]

    @hvd.elastic.run
    def loop(state):
        job.attempts += 1
        job.event("restored", step=state.epoch)
        shares = [job.share(s) for s in range(state.epoch, STEPS)]
        data = tf.data.Dataset.from_tensor_slices((np.stack([s[0] for s in shares]),
                                                   np.stack([s[1] for s in shares])))
        model.fit(data, epochs=STEPS - state.epoch, steps_per_epoch=1, shuffle=False, verbose=0,
                  callbacks=callbacks)
        return state.epoch

    return loop(state)


def train(out):
    import faulthandler

    import perseus.tensorflow as hvd

    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> prints every thread's stack (a hang's diagnosis)
    hvd.init()
    job = Job(hvd, out)
    model = make_model()
    job.event("start")
    final = (train_keras if MODE == "keras" else train_tf)(job, model)
    job.event("done", step=final)
    np.save(os.path.join(out, f"final-rank{hvd.rank()}.npy"), flat(model))
    if hvd.rank() == 0:
        np.save(os.path.join(out, "final.npy"), flat(model))
    hvd.shutdown()


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    {"reference": reference}.get(mode, train)(out_dir)
