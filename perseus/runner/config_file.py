"""horovodrun's ``--config-file``: a YAML file of run-time settings, turned into perseusrun's own options.

The file has horovodrun's sections and keys (see ``docs/compatibility.md``)::

    params:
      fusion_threshold_mb: 32
      cycle_time_ms: 5
    autotune:
      enabled: true
    timeline:
      filename: /tmp/timeline.json

:func:`config_argv` returns the equivalent command-line options; perseusrun parses them *before* the real
command line, so an option given on the command line wins over the file, as with horovodrun. A key
horovodrun does not know is an error naming the key.
"""

from __future__ import annotations

from typing import Any

__all__ = ["config_argv", "SECTIONS"]

# section -> key -> (option for a value, or (option when true, option when false) for a switch)
SECTIONS: dict[str, dict[str, Any]] = {
    "params": {
        "fusion_threshold_mb": "--fusion-threshold-mb",
        "cycle_time_ms": "--cycle-time-ms",
        "cache_capacity": "--cache-capacity",
        "hierarchical_allreduce": ("--hierarchical-allreduce", "--no-hierarchical-allreduce"),
        "hierarchical_allgather": ("--hierarchical-allgather", "--no-hierarchical-allgather"),
        "torus_allreduce": ("--torus-allreduce", "--no-torus-allreduce"),
    },
    "autotune": {
        "enabled": ("--autotune", "--no-autotune"),
        "log_file": "--autotune-log-file",
        "warmup_samples": "--autotune-warmup-samples",
        "steps_per_sample": "--autotune-steps-per-sample",
        "bayes_opt_max_samples": "--autotune-bayes-opt-max-samples",
        "gaussian_process_noise": "--autotune-gaussian-process-noise",
    },
    "timeline": {
        "filename": "--timeline-filename",
        "mark_cycles": ("--timeline-mark-cycles", "--no-timeline-mark-cycles"),
    },
    "stall_check": {
        "enabled": ("--stall-check", "--no-stall-check"),
        "warning_time_seconds": "--stall-check-warning-time-seconds",
        "shutdown_time_seconds": "--stall-check-shutdown-time-seconds",
    },
    "library_options": {
        "mpi_threads_disable": ("--mpi-threads-disable", "--no-mpi-threads-disable"),
        "num_nccl_streams": "--num-nccl-streams",
        "thread_affinity": "--thread-affinity",
        "gloo_timeout_seconds": "--gloo-timeout-seconds",
    },
    "logging": {
        "level": "--log-level",
        "with_timestamp": ("--log-with-timestamp", "--log-without-timestamp"),
    },
}


def _switch(path: str, where: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"--config-file {path}: {where} must be true or false, got {value!r}")


def config_argv(path: str) -> list[str]:
    """The perseusrun options equivalent to the YAML file at ``path``.

    Raises:
        ValueError: the file cannot be read or parsed, a section or key is unknown (named), a value has the
            wrong kind, or ``controller`` is not ``mpi``.
    """
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"--config-file {path}: cannot read it: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config-file {path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ValueError(f"--config-file {path}: expected sections (params, autotune, timeline, stall_check, "
                         f"library_options, logging), got {type(config).__name__}")
    argv: list[str] = []
    for section, body in config.items():
        if section == "controller":
            if str(body).lower() != "mpi":
                raise ValueError(f"--config-file {path}: controller {body!r}: perseus runs on MPI only; use "
                                 "'mpi' or leave it out")
            continue
        keys = SECTIONS.get(section)
        if keys is None:
            raise ValueError(f"--config-file {path}: unknown section {section!r}; horovodrun's sections are "
                             f"controller, {', '.join(SECTIONS)}")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ValueError(f"--config-file {path}: section {section!r} must hold keys, got {body!r}")
        for key, value in body.items():
            option = keys.get(key)
            if option is None:
                raise ValueError(f"--config-file {path}: unknown key {section}.{key}; {section} takes "
                                 f"{', '.join(keys)}")
            if value is None:
                continue
            if isinstance(option, tuple):
                argv.append(option[0] if _switch(path, f"{section}.{key}", value) else option[1])
            else:
                argv += [option, str(value)]
    return argv
