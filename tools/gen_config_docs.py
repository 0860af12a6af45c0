"""Write docs/configuration.md from perseus.base.knobs.KNOBS (run after changing a knob)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from perseus.base.knobs import KNOBS, parse_reset_limit  # noqa: E402


def main() -> None:
    lines = [
        "# Configuration",
        "",
        "Every setting is read once, at `init()`, from the environment. Each has a `PERSEUS_*` name; most also",
        "accept Horovod's `HOROVOD_*` name, and the `PERSEUS_*` name wins when both are set. `perseusrun` flags",
        "set the same variables for the job it launches (for example `--fusion-threshold-mb 8` sets",
        "`PERSEUS_FUSION_THRESHOLD=8388608`). A value that does not parse fails `init()` with a message naming",
        "the variable.",
        "",
        "This file is generated from `perseus/base/knobs.py` by `tools/gen_config_docs.py`.",
        "",
        "| Setting | Environment variables | `perseusrun` flag | Type | Default | Unit | Meaning |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in KNOBS:
        env = "<br>".join(f"`{e}`" for e in k.env)
        default = repr(k.default) if k.default != "" else "unset"
        kind = {parse_reset_limit: "int or none"}.get(k.type) or k.type.__name__
        if k.choices:
            kind += " (" + ", ".join(k.choices) + ")"
        flag = ""
        if k.flag is not None:
            flag = f"`{k.flag.name}`" + (f"<br>`{k.flag.negation}`" if k.flag.negation else "")
            if k.flag.scale == 1 << 20:
                flag += " (MB)"
        lines.append(f"| `{k.name}` | {env} | {flag} | {kind} | {default} | {k.unit} | {k.doc} |")
    lines += [
        "",
        "## Differences from Horovod",
        "",
        "- `HOROVOD_FUSION_THRESHOLD` defaults to 4 MiB, not 128 MiB: perseus splits large tensors into units",
        "  of this size and reduces them where they lie, and 1-6 MiB units measured fastest.",
        "- `HOROVOD_CYCLE_TIME` means how long the engine gathers requests before negotiating (default 0.5 ms);",
        "  an idle engine does not cycle at all.",
        "- `HOROVOD_STALL_SHUTDOWN_TIME_SECONDS` defaults to 300 s: a stalled job fails instead of hanging.",
        "- `HOROVOD_CACHE_CAPACITY` defaults to 4096 (Horovod: 1024), so models with more gradient tensors",
        "  than Horovod's default still negotiate with one bit-vector all-reduce per step.",
        "- `HOROVOD_MPI_THREADS_DISABLE` (`--mpi-threads-disable`) is accepted and ignored with a warning at",
        "  `init()`: perseus needs `MPI_THREAD_MULTIPLE`.",
        "- `HOROVOD_AUTOTUNE*` (`--autotune*`) are accepted and ignored, with a warning at `init()` when",
        "  `HOROVOD_AUTOTUNE` is set: perseus has no run-time tuner yet.",
        "- `HOROVOD_TIMELINE=DYNAMIC` is not needed: `start_timeline()` works whenever perseus is initialized.",
        "",
    ]
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "configuration.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {os.path.normpath(path)}")


if __name__ == "__main__":
    main()
