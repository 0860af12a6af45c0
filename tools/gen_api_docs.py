"""Write docs/api_torch.md, docs/api_tensorflow.md and docs/api_keras.md from the signatures and docstrings of
perseus.torch, perseus.tensorflow and perseus.tensorflow.keras (run after API changes)."""

import importlib
import inspect
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

TORCH_SECTIONS = [
    ("Setup and topology", ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
                            "cross_size", "cross_rank", "is_homogeneous", "start_timeline", "stop_timeline"]),
    ("Build information", ["mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
                           "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built"]),
    ("Allreduce", ["allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
                   "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_",
                   "sparse_allreduce_async"]),
    ("Allgather, broadcast, alltoall, reducescatter",
     ["allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
      "broadcast_async", "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
      "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async"]),
    ("Synchronisation", ["poll", "synchronize", "join", "barrier"]),
    ("Training", ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
                  "broadcast_object", "allgather_object", "SyncBatchNorm", "Compression"]),
    ("Sharded embeddings (EmbRace)", ["DistributedEmbedding", "DistributedEmbedding.prefetch",
                                      "DistributedEmbedding.flush", "DistributedEmbedding.full_weight",
                                      "DistributedEmbedding.load_full_weight", "embedding.full_state_dict"]),
    ("Process sets", ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]),
    ("Bytes on the wire", ["wire_bytes"]),
    ("GPU launches", ["device_stats"]),
]


TF_SECTIONS = [
    ("Setup and topology", ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
                            "cross_size", "cross_rank", "is_homogeneous", "size_op", "rank_op", "local_size_op",
                            "local_rank_op", "process_set_included_op", "start_timeline", "stop_timeline"]),
    ("Collectives", ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
                     "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier"]),
    ("Training", ["DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer",
                  "broadcast_variables", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
                  "allgather_object", "SyncBatchNormalization", "Compression"]),
    ("Process sets", ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]),
    ("Bytes on the wire", ["wire_bytes"]),
]

KERAS_SECTIONS = [
    ("Optimizer and model", ["DistributedOptimizer", "PartialDistributedOptimizer", "load_model",
                             "broadcast_global_variables"]),
    ("Sharded embeddings (EmbRace)", ["DistributedEmbedding", "DistributedEmbedding.full_weights",
                                      "DistributedEmbedding.set_full_weights"]),
    ("Values (eager, NumPy results)", ["allreduce", "allgather", "broadcast", "reducescatter"]),
    ("Callbacks (`callbacks.`)", ["callbacks.BroadcastGlobalVariablesCallback", "callbacks.MetricAverageCallback",
                                  "callbacks.LearningRateScheduleCallback", "callbacks.LearningRateWarmupCallback",
                                  "callbacks.BestModelCheckpoint"]),
    ("Elastic (`elastic.`)", ["elastic.KerasState", "elastic.CommitStateCallback",
                              "elastic.UpdateBatchStateCallback", "elastic.UpdateEpochStateCallback",
                              "elastic.run"]),
]

DOCS = [
    ("perseus.torch", "api_torch.md", "horovod.torch", TORCH_SECTIONS, [
        "Reduction ops: `Average` (default), `Sum`, `Min`, `Max`, `Product` (and `Adasum`, which raises",
        "`NotImplementedError`). Unless stated otherwise every collective must be called by every rank of",
        "its process set with the same name, dtype and shape."]),
    ("perseus.tensorflow", "api_tensorflow.md", "horovod.tensorflow", TF_SECTIONS, [
        "Every collective works eagerly and inside `tf.function` (not under XLA `jit_compile=True`) and is",
        "differentiable. Reduction ops as in perseus.torch. A cross-rank mismatch raises",
        "`tf.errors.FailedPreconditionError` on every rank. Keras: see [api_keras.md](api_keras.md)."]),
    ("perseus.tensorflow.keras", "api_keras.md", "horovod.tensorflow.keras", KERAS_SECTIONS, [
        "`perseus.keras` (the stand-alone `keras` package) has the same functions; its `allreduce` averages",
        "by default and its module also exports `Adasum`, as Horovod's does (`DistributedOptimizer(op=Adasum)`",
        "combines each rank's update: [adasum.md](adasum.md)).",
        "Works with Keras 3 (TensorFlow backend) and with tf-keras 2 (`TF_USE_LEGACY_KERAS=1` plus the",
        "`tf-keras` package). Setup, topology and process-set functions are those of perseus.tensorflow."]),
]


def lookup(hvd, name: str):
    obj = hvd
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def entry(hvd, name: str) -> list[str]:
    obj = lookup(hvd, name)
    if obj is None:
        return [f"### `{name}`", "", "*Not available yet.*", ""]
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        sig = ""
    if not callable(obj) or inspect.isclass(obj) and name in ("Compression",):
        sig = "" if name != "ProcessSet" else sig
    doc = inspect.getdoc(obj) or ""
    if name == "global_process_set":
        doc = "The process set of all ranks (id 0)."
    return [f"### `{name}{sig}`", "", doc, ""]


def main() -> None:
    for module, filename, horovod_name, sections, intro in DOCS:
        hvd = importlib.import_module(module)
        lines = [
            f"# `{module}` API reference",
            "",
            "Generated from the docstrings by `tools/gen_api_docs.py`. Names, argument order and defaults are",
            f"Horovod 0.28.1's (`{horovod_name}`); see [compatibility.md](compatibility.md) for the differences.",
            *intro,
            "",
        ]
        for title, names in sections:
            lines += [f"## {title}", ""]
            for name in names:
                lines += entry(hvd, name)
        path = os.path.join(os.path.dirname(__file__), "..", "docs", filename)
        with open(path, "w") as f:
            f.write("\n".join(lines))
        print(f"wrote {os.path.normpath(path)}")


if __name__ == "__main__":
    main()
