"""Horovod-compat path: keep names and signatures identical to horovod.runner.

The launcher package. It runs before any MPI library exists, so nothing under
``perseus.runner`` imports mpi4py or the perseus engine. Scripts are launched with the
``perseusrun`` command (:mod:`perseus.runner.launch`), functions with :func:`run`
(:mod:`perseus.runner.run_func`); elastic jobs are run by :mod:`perseus.runner.elastic`.
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
    """Run ``func(*args, **kwargs)`` on ``np`` (``num_proc``) processes of a new job, as perseusrun would run
    a script, and return the list of their return values in rank order (Horovod's ``horovod.run``).

    The function, its arguments and its results travel with cloudpickle between this process and the
    ranks (over TCP; remote ranks connect back to this machine); the function calls ``hvd.init()`` itself.
    ``hosts``/``hostfile``, ``ssh_port``, ``ssh_identity_file``, ``start_timeout``, ``output_filename``,
    ``verbose``, ``mpi_args``, ``network_interface(s)`` and ``executable`` (the Python the ranks run) mean
    what the matching perseusrun flags mean. ``use_mpi`` is accepted (MPI is what perseus launches with);
    ``disable_cache`` is accepted and has no effect (there is no launch cache).

    **Elastic jobs**, as in Horovod: ``min_np``/``min_num_proc``, ``max_np``/``max_num_proc``,
    ``host_discovery_script`` (or a fixed ``hosts``/``hostfile`` list), ``slots``, ``reset_limit`` and
    ``cooldown_range`` run the function as ``perseusrun --host-discovery-script`` runs a script: each generation's
    ranks run ``func`` (which uses ``hvd.elastic.run`` to resume from the last commit), and the values returned
    are those of the generation that finished, the first ``min_np`` of them (Horovod's contract).

    Collective in effect: every rank runs ``func``; a rank that waits in a collective for a rank that
    failed is ended by the launcher.

    Raises:
        perseus.runner.run_func.RunError: a rank raised (the message names every failed rank and has the
            first one's traceback; its exception is chained when it could be transported) or ended without a
            result (crash, kill, launch error; an elastic job that could not go on: the reason is printed).
        NotImplementedError: ``use_gloo=True``: perseus launches with MPI only.
        ValueError: ``np`` and ``num_proc`` disagree, fewer than 1 process, ``hosts``/``hostfile`` is
            malformed, unreadable or both are given, elastic arguments with neither a discovery script nor
            hosts, or a malformed ``cooldown_range``.
    """
    # Imported on call, not with the package: run_func imports launch, and `python -m perseus.runner.launch`
    # imports this package before it runs launch as __main__; launch loaded here would then load twice.
    from perseus.runner import run_func

    if np is not None and num_proc not in (None, 1) and int(np) != int(num_proc):
        raise ValueError(f"perseus.run: np={np} and num_proc={num_proc} disagree; give one of them")
    count = int(np if np is not None else (num_proc if num_proc is not None else 1))
    if count < 1:
        raise ValueError(f"perseus.run: at least 1 process is needed, got {count}")
    if use_gloo:
        raise NotImplementedError("perseus.run: use_gloo=True: perseus launches with MPI only; leave use_gloo unset")
    elastic = run_func.Elastic(min_np=min_np if min_np is not None else min_num_proc,
                               max_np=max_np if max_np is not None else max_num_proc,
                               host_discovery_script=host_discovery_script, slots=slots, reset_limit=reset_limit,
                               cooldown_range=cooldown_range)
    nics = list(network_interfaces or [])
    if network_interface:
        nics += [n for n in str(network_interface).split(",") if n]
    return run_func.run(func, args, kwargs, count, hosts=hosts, hostfile=hostfile, start_timeout=start_timeout,
                        ssh_port=ssh_port, ssh_identity_file=ssh_identity_file, output_filename=output_filename,
                        verbose=verbose, mpi_args=mpi_args, network_interfaces=nics, executable=executable,
                        elastic=elastic if elastic.given() else None)
