"""Write docs/api_torch.md from the signatures and docstrings of perseus.torch (run after API changes)."""

import inspect
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import perseus.torch as hvd  # noqa: E402

SECTIONS = [
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
    ("Process sets", ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]),
]


def entry(name: str) -> list[str]:
    obj = getattr(hvd, name, None)
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
    lines = [
        "# `perseus.torch` API reference",
        "",
        "Generated from the docstrings by `tools/gen_api_docs.py`. Names, argument order and defaults are",
        "Horovod 0.28.1's (`horovod.torch`); see [compatibility.md](compatibility.md) for the differences.",
        "Reduction ops: `Average` (default), `Sum`, `Min`, `Max`, `Product` (and `Adasum`, which raises",
        "`NotImplementedError`). Unless stated otherwise every collective must be called by every rank of",
        "its process set with the same name, dtype and shape.",
        "",
    ]
    for title, names in SECTIONS:
        lines += [f"## {title}", ""]
        for name in names:
            lines += entry(name)
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "api_torch.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {os.path.normpath(path)}")


if __name__ == "__main__":
    main()
