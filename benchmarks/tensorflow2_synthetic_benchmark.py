"""Synthetic-data training throughput with TensorFlow 2: a ResNet trained by a tf.function step.

    mpirun -np 2 python benchmarks/tensorflow2_synthetic_benchmark.py [--batch-size 32] [--image-size 64]
    python benchmarks/tensorflow2_synthetic_benchmark.py            (1 rank: no communication, for scale)
    python benchmarks/tensorflow2_synthetic_benchmark.py --summarize benchmarks/results/STAMP.jsonl

A ResNet-18/34 (Keras 3 layers, defined here) trains on random images with SGD; the gradients of each step
are averaged across ranks by ``DistributedGradientTape``. ``--library horovod`` runs the same script on
horovod.tensorflow, for side-by-side comparisons. Prints img/s per rank for every iteration, then the median
per rank and the total over ranks; ``--json FILE`` appends the figures as one JSON line, and
``--summarize FILE`` turns such lines into a table.
"""

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def resnet(blocks, image_size, num_classes):
    """ResNet with BasicBlocks (blocks=(2, 2, 2, 2) is ResNet-18), channels last."""
    import keras
    from keras import layers

    def conv_bn(x, filters, kernel, stride):
        x = layers.Conv2D(filters, kernel, stride, padding="same", use_bias=False)(x)
        return layers.BatchNormalization()(x)

    def basic_block(x, filters, stride):
        y = layers.ReLU()(conv_bn(x, filters, 3, stride))
        y = conv_bn(y, filters, 3, 1)
        shortcut = x if stride == 1 and x.shape[-1] == filters else conv_bn(x, filters, 1, stride)
        return layers.ReLU()(layers.Add()([y, shortcut]))

    inputs = keras.Input(shape=(image_size, image_size, 3))
    x = layers.ReLU()(conv_bn(inputs, 64, 7, 2))
    x = layers.MaxPooling2D(3, 2, padding="same")(x)
    for stage, n in enumerate(blocks):
        for j in range(n):
            x = basic_block(x, 64 * 2 ** stage, 2 if j == 0 and stage > 0 else 1)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(num_classes)(x))


MODELS = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}


def tf_variables(variables):
    """The tf.Variable inside each Keras 3 variable (``.value``): horovod.tensorflow's tape and
    broadcast_variables take no Keras 3 variables, and the script runs on both libraries."""
    import keras
    return [v.value if isinstance(v, keras.Variable) else v for v in variables]


def benchmark(args):
    import tensorflow as tf
    import keras

    hvd = importlib.import_module(f"{args.library}.tensorflow")
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    keras.utils.set_random_seed(42)

    model = resnet(MODELS[args.model], args.image_size, args.num_classes)
    optimizer = keras.optimizers.SGD(learning_rate=0.01 * hvd.size(), momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    images = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    labels = tf.random.uniform([args.batch_size], maxval=args.num_classes, dtype=tf.int64)
    trainable = tf_variables(model.trainable_variables)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, trainable)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def run_batches(n):
        start = time.perf_counter()
        for _ in range(n):
            loss = train_step()
        float(loss)  # the step's result, so the time covers its whole computation
        return time.perf_counter() - start

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    nparams = sum(int(tf.size(v)) for v in model.trainable_variables)
    log(f"Model: {args.model} ({nparams / 1e6:.1f}M parameters), batch size {args.batch_size} per rank, "
        f"image {args.image_size}px, {hvd.size()} ranks, library {args.library}"
        f"{', fp16 allreduce' if args.fp16_allreduce else ''}")
    run_batches(1)
    # All variables (model and optimizer's) exist after the first step: start every rank from rank 0's.
    hvd.broadcast_variables(tf_variables(model.variables), root_rank=0)
    hvd.broadcast_variables(tf_variables(optimizer.variables), root_rank=0)
    run_batches(args.num_warmup_batches)
    img_secs = []
    for i in range(args.num_iters):
        img_sec = args.batch_size * args.num_batches_per_iter / run_batches(args.num_batches_per_iter)
        log(f"Iter #{i}: {img_sec:.1f} img/sec per rank")
        img_secs.append(img_sec)
    median = statistics.median(img_secs)
    total = float(hvd.allreduce(tf.constant(median, tf.float64), op=hvd.Sum, name="median_img_sec"))
    log(f"Median img/sec per rank: {median:.1f} (min {min(img_secs):.1f}, max {max(img_secs):.1f})")
    log(f"Total img/sec on {hvd.size()} rank(s): {total:.1f}")
    if args.json and hvd.rank() == 0:
        record = {"bench": "tf_synthetic", "library": args.library, "ranks": hvd.size(), "model": args.model,
                  "batch_size": args.batch_size, "image_size": args.image_size, "fp16": args.fp16_allreduce,
                  "img_sec_per_rank": img_secs, "median_per_rank": median, "total": total,
                  "tag": args.tag}
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")
    hvd.shutdown()


def summarize(path):
    """Median over runs of each (library, ranks) configuration's total img/s; scaling against 1 rank."""
    runs = defaultdict(list)
    for line in open(path):
        r = json.loads(line) if line.strip() else {}
        if r.get("bench") == "tf_synthetic":
            runs[(r["library"], r["ranks"], r.get("fp16", False), r.get("tag"))].append(r)
    if not runs:
        return
    single = [r["median_per_rank"] for (lib, n, *_), rs in runs.items() if n == 1 for r in rs]
    one = statistics.median(single) if single else None
    print("\n| library | ranks | runs | median img/s per rank | median total img/s | x ideal (ranks x 1 rank) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (lib, n, fp16, tag), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        per_rank = statistics.median(r["median_per_rank"] for r in rs)
        total = statistics.median(r["total"] for r in rs)
        eff = f"{total / (n * one):.2f}" if one else ""
        name = lib + (" fp16" if fp16 else "") + (f" ({tag})" if tag else "")
        print(f"| {name} | {n} | {len(rs)} | {per_rank:.1f} | {total:.1f} | {eff} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--num-warmup-batches", type=int, default=3)
    ap.add_argument("--num-batches-per-iter", type=int, default=5)
    ap.add_argument("--num-iters", type=int, default=5)
    ap.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16")
    ap.add_argument("--library", default="perseus", choices=["perseus", "horovod"])
    ap.add_argument("--threads", type=int, default=1, help="TensorFlow intra-op threads per rank")
    ap.add_argument("--json", help="append the figures to this JSON-lines file (rank 0)")
    ap.add_argument("--tag", help="a label stored with the --json record")
    ap.add_argument("--summarize", metavar="FILE", help="print a table of the tf_synthetic records of FILE")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
