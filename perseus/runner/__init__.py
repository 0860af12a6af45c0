"""Horovod-compat path: keep names and signatures identical to horovod.runner.

The launcher package. It runs before any MPI library exists, so nothing under
``perseus.runner`` imports mpi4py or the perseus engine. Scripts are launched with the
``perseusrun`` command (:mod:`perseus.runner.launch`).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["run"]


def run(func: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, num_proc: int | None = 1,
        min_num_proc: int | None = None, max_num_proc: int | None = None, slots: int | None = None,
        reset_limit: int | None = None, cooldown_range: tuple[int, int] | None = None,
        hosts: str | None = None, hostfile: str | None = None, host_discovery_script: str | None = None,
        start_timeout: int | None = None, ssh_port: int | None = None, ssh_identity_file: str | None = None,
        disable_cache: bool | None = None, output_filename: str | None = None, verbose: int | None = None,
        use_gloo: bool | None = None, use_mpi: bool | None = None, mpi_args: str | None = None,
        network_interface: str | None = None, network_interfaces: list[str] | None = None,
        executable: str | None = None, np: int | None = None, min_np: int | None = None,
        max_np: int | None = None) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on every process of a new job and return the results by rank.

    Not implemented yet: always raise ``NotImplementedError``. Launch a script with ``perseusrun``.
    """
    raise NotImplementedError(
        "perseus.run(): programmatic launch is not implemented yet; launch a script with perseusrun"
    )
