"""``RayExecutor``: run a perseus job on the actors of a Ray cluster (Horovod's ``horovod.ray.RayExecutor``).

``start()`` places one actor per worker (:mod:`perseus.ray.worker`) with a placement group, groups the actors by
machine (one MPI node per machine, named ``perseus-node-<i>``; ranks are numbered node by node, rank 0 on the
first worker's machine), and starts one ``mpirun`` from rank 0's actor whose daemons the actors start
(:mod:`perseus.runner.remote`). Each rank is a long-lived process that runs what ``run``/``execute`` send;
the job lives until ``shutdown()``. A rank that raises ends the job (the others may be waiting for it in a
collective): the call raises :class:`~perseus.ray.worker.WorkerError` naming the rank and node, and
``start()`` must be called again.
"""

from __future__ import annotations

import secrets
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from perseus.base import horovod_alias
from perseus.ray.elastic import ElasticRayExecutor
from perseus.ray.settings import Settings, connect, make_settings, place
from perseus.ray.worker import BaseHorovodWorker, WorkerError
from perseus.runner.remote import job as remote_job
from perseus.runner.remote.rank import LINKS_ENV, dumps

__all__ = ["RayExecutor", "gather"]

_RANK_MODULE = "perseus.runner.remote.rank"


def _pack(message: tuple) -> bytes:
    """``message`` cloudpickled here, once for every rank.

    Raises:
        TypeError: the function or its arguments cannot be pickled.
    """
    try:
        return dumps(message)
    except Exception as exc:  # noqa: BLE001 - anything cloudpickle raises
        raise TypeError(f"perseus.ray: the function or its arguments cannot be pickled: {exc}") from exc


def _unwrap(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)  # RayTaskError carries the actor's own exception
    return cause if isinstance(cause, BaseException) else exc


def gather(refs: list, callbacks: Optional[List[Callable]] = None, queue=None, where: Optional[List[str]] = None) -> list:
    """Wait for every ref (one per rank, in rank order), calling ``callbacks`` on each value the ranks log
    meanwhile; return the values.

    Raises:
        WorkerError: some rank failed; a rank that raised is named before ranks that merely ended (those were
            ended by the job because of it), and the message lists every failed rank.
    """
    import ray

    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1)
        _drain(queue, callbacks)
    _drain(queue, callbacks)
    values, failures = [], []
    for rank, ref in enumerate(refs):
        try:
            values.append(ray.get(ref))
        except Exception as exc:  # noqa: BLE001 - a rank's error, or Ray's error about its actor
            failures.append((rank, _unwrap(exc)))
    if not failures:
        return values
    raised = [(r, e) for r, e in failures if isinstance(e, WorkerError) and not e.gone]
    died = [(r, e) for r, e in failures if not isinstance(e, WorkerError)]
    first_rank, first = (raised or died or failures)[0]
    node = where[first_rank] if where else ""
    summary = ", ".join(str(r) for r, _ in failures)
    text = str(first).strip().splitlines()[0] if str(first).strip() else ""
    if isinstance(first, WorkerError):
        message = str(first)
    elif isinstance(first, ray.exceptions.RayActorError):
        message = f"the actor of rank {first_rank}{f' on {node}' if node else ''} died ({type(first).__name__}: {text})"
    else:
        message = f"the call to rank {first_rank}{f' on {node}' if node else ''} failed in Ray ({type(first).__name__}: {text})"
    raise WorkerError(f"perseus.ray: {message}\n(ranks that failed: {summary}; the job has ended: call start() "
                      f"again to run more)", first_rank, node, gone=not raised,
                      traceback_text=getattr(first, "traceback_text", "")) from first


def _drain(queue, callbacks) -> None:
    if queue is None:
        return
    while True:
        try:
            item = queue.get_nowait()
        except Exception:  # noqa: BLE001 - ray.util.queue.Empty, or the queue is gone
            return
        for cb in callbacks or ():
            cb(item)


class RayExecutor:
    """A perseus job on Ray actors, with Horovod's ``RayExecutor`` API.

    Args:
        settings: from :meth:`create_settings`.
        num_workers: ranks (packed onto as few nodes as possible); or ``num_hosts`` nodes with
            ``num_workers_per_host`` each (one node each, on different nodes).
        cpus_per_worker, use_gpu, gpus_per_worker: each worker's Ray resources (``gpus_per_worker`` defaults to 1
            with ``use_gpu``). The ranks of a node see the GPUs of all that node's workers
            (``CUDA_VISIBLE_DEVICES``), so ``hvd.local_rank()`` picks a GPU as under perseusrun.
        min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout, override_discovery: an elastic
            job (see :class:`~perseus.ray.ElasticRayExecutor`); ``min_workers`` and ``num_workers`` exclude each other.
        num_slots, cpus_per_slot, gpus_per_slot: older names of num_workers_per_host, cpus_per_worker, gpus_per_worker.

    Raises:
        ValueError: contradicting or missing sizes.
    """

    @classmethod
    def create_settings(cls, timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: float = 100, nics=None,
                        verbose: int = 0) -> Settings:
        """Settings for the executor: ``timeout_s`` for the ranks to start, ``placement_group_timeout_s`` for Ray
        to place the workers, ``nics`` the interfaces to use; no ssh is used (the ssh arguments are accepted)."""
        return make_settings(ssh_identity_file, ssh_str, timeout_s=timeout_s,
                             placement_group_timeout_s=placement_group_timeout_s, nics=nics, verbose=verbose)

    def __init__(self, settings: Settings, num_workers: Optional[int] = None, num_hosts: Optional[int] = None,
                 num_workers_per_host: int = 1, cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None, use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, cooldown_range=None, elastic_timeout: float = 600,
                 override_discovery: bool = True, *, num_slots: Optional[int] = None,
                 cpus_per_slot: Optional[float] = None, gpus_per_slot: Optional[float] = None):
        num_workers_per_host = num_slots or num_workers_per_host or 1  # Horovod's tests pass None
        cpus_per_worker = cpus_per_slot if cpus_per_slot is not None else cpus_per_worker
        gpus_per_worker = gpus_per_slot if gpus_per_slot is not None else gpus_per_worker
        if max_workers and not min_workers:
            raise ValueError("perseus.ray: max_workers needs a positive min_workers (an elastic job)")
        if min_workers and (num_workers or num_hosts):
            raise ValueError("perseus.ray: min_workers (elastic) and num_workers/num_hosts (fixed size) exclude "
                             "each other; give one of them")
        self.settings = settings if settings is not None else self.create_settings()
        self.cpus_per_worker, self.use_gpu = cpus_per_worker, use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else (gpus_per_worker or 0)
        self._elastic = None
        if min_workers:
            s = self.settings
            s.min_np, s.max_np, s.reset_limit = min_workers, max_workers, reset_limit
            s.cooldown_range, s.elastic_timeout = cooldown_range, elastic_timeout
            self._elastic = ElasticRayExecutor(s, use_gpu=use_gpu, cpus_per_slot=cpus_per_worker,
                                               gpus_per_slot=self.gpus_per_worker or None,
                                               override_discovery=override_discovery)
            return
        if not num_workers and not num_hosts:
            raise ValueError("perseus.ray: give num_workers, or num_hosts and num_workers_per_host")
        if num_workers and num_hosts:
            raise ValueError("perseus.ray: num_workers and num_hosts exclude each other; give one of them")
        self.num_hosts, self.num_workers_per_host = num_hosts, int(num_workers_per_host)
        self.num_workers = int(num_workers or num_hosts * self.num_workers_per_host)
        self.workers: list = []
        self._where: list[str] = []
        self._pg = None
        self._own_pg = True  # the executor made self._pg (and removes it); False: the caller's current group
        self.use_current_placement_group = use_current_placement_group
        self._queue = None
        self._alive = False

    # -- start -------------------------------------------------------------------------------------------------

    def start(self, executable_cls: Optional[type] = None, executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None, extra_env_vars: Optional[Dict] = None) -> None:
        """Place the workers, start the job and create ``executable_cls(*args, **kwargs)`` on every rank.

        Every rank gets ``extra_env_vars`` in its environment. Calls ``ray.init()`` when Ray is not initialized.

        Raises:
            TimeoutError: the workers could not be placed (``placement_group_timeout_s``), or the ranks did not
                connect within ``timeout_s`` (the message names the ranks missing and their nodes).
            RuntimeError: ``mpirun`` ended before every rank connected (its output is above).
            WorkerError: ``executable_cls`` raised on some rank.
        """
        if self._elastic is not None:
            return self._elastic.start()
        connect()
        if self.workers:
            self.shutdown()
        token = secrets.token_hex(16)
        current = self._current_group()
        if current is not None:  # the caller's group (e.g. a Ray Tune trial's): its bundles, in order
            self._pg, self._own_pg, bundles = current, False, list(range(self.num_workers))
        else:
            self._pg, bundles = place(self.num_workers, self.num_hosts, self.num_workers_per_host,
                                      self.cpus_per_worker, self.gpus_per_worker,
                                      self.settings.placement_group_timeout_s)
            self._own_pg = True
        self.workers = self._create_actors(token, bundles, extra_env_vars or {})
        try:
            self._launch(token, extra_env_vars or {})
            self._alive = True
            init = _pack(("init", executable_cls, tuple(executable_args or ()), dict(executable_kwargs or {})))
            gather([w.call.remote(init) for w in self.workers], where=self._where)
        except BaseException:
            self.shutdown()
            raise

    def _current_group(self):
        """The placement group this code runs in, when ``use_current_placement_group`` and it has a bundle per
        worker (a fixed-size job by ``num_workers``); else None (the executor makes its own)."""
        import ray

        if not self.use_current_placement_group or self.num_hosts:
            return None
        current = ray.util.get_current_placement_group()
        if current is None or len(current.bundle_specs) < self.num_workers:
            return None
        return current

    def _create_actors(self, token: str, bundles: list, env: dict) -> list:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote_cls = ray.remote(BaseHorovodWorker)
        return [remote_cls.options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, max_concurrency=8,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=b),
        ).remote(token, env) for b in bundles]

    def _launch(self, token: str, env: dict) -> None:
        import ray
        from ray.util.queue import Queue

        infos = ray.get([w.info.remote() for w in self.workers], timeout=max(60.0, self.settings.timeout_s))
        order, nodes, node_envs = _ranks_by_machine(infos, self.use_gpu)
        self.workers = [self.workers[i] for i in order]
        infos = [infos[i] for i in order]
        self._where = [f"{n.name} ({infos[r]['hostname']}, {infos[r]['ip']})" for r, n in _node_of_rank(nodes)]
        self._queue = Queue(actor_options={"num_cpus": 0})
        ray.get([w.assign.remote(r, self._where[r], node_envs[n.name], self._queue)
                 for r, (w, (_, n)) in enumerate(zip(self.workers, _node_of_rank(nodes)))])
        rank_env = {**{str(k): str(v) for k, v in env.items()}, LINKS_ENV: ",".join(i["link"] for i in infos),
                    **horovod_alias.env()}  # the ranks resolve horovod.* as this process does
        nics = self.settings.nic_list()
        if nics:
            rank_env["PERSEUS_NETWORK_INTERFACE"] = ",".join(nics)
        command = [sys.executable, "-m", _RANK_MODULE]
        ray.get(self.workers[0].launch.remote([(n.name, n.service, n.slots) for n in nodes], command, rank_env, nics,
                                              bool(self.settings.verbose)))
        self._wait_for_ranks()

    def _wait_for_ranks(self) -> None:
        import ray

        deadline = time.monotonic() + float(self.settings.timeout_s)
        connected = [False] * len(self.workers)
        while not all(connected):
            status = ray.get(self.workers[0].mpirun_status.remote())
            if status is not None:
                raise RuntimeError(f"perseus.ray: mpirun ended with status {status} before every rank started "
                                   f"(see its output above, printed by rank 0's actor)")
            waiting = [r for r, c in enumerate(connected) if not c]
            answers = ray.get([self.workers[r].wait_connected.remote(0.5) for r in waiting])
            for r, ok in zip(waiting, answers):
                connected[r] = ok
            if not all(connected) and time.monotonic() > deadline:
                missing = [r for r, c in enumerate(connected) if not c]
                raise TimeoutError(
                    f"perseus.ray: rank(s) {', '.join(map(str, missing))} "
                    f"({'; '.join(self._where[r] for r in missing[:4])}) did not start within timeout_s="
                    f"{self.settings.timeout_s:g} s; check that perseus and Open MPI are installed on those nodes, "
                    f"or raise timeout_s in create_settings()")

    # -- calls -------------------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._elastic is None and not self._alive:
            raise RuntimeError("perseus.ray: the executor's job is not running; call start() first (again after a "
                               "failure or shutdown())")

    def _all(self, message: tuple, callbacks=None) -> list:
        self._check_alive()
        try:
            payload = _pack(message)
            return gather([w.call.remote(payload) for w in self.workers], callbacks, self._queue, self._where)
        except WorkerError:
            self._alive = False
            raise

    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """Run ``fn(executable)`` on every rank; returns the values in rank order.

        ``callbacks`` are called (here) on each value rank 0 logs with ``perseus.ray.ray_logger.log``.

        Raises:
            WorkerError: ``fn`` raised on some rank, or a rank or its actor died (the job then ends).
        """
        if self._elastic is not None:
            raise NotImplementedError("execute() with an elastic executor: use run(fn)")
        return self._all(("call", fn, (), {}, True), callbacks)

    def run(self, fn: Callable[..., Any], args: Optional[List] = None, kwargs: Optional[Dict] = None,
            callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; returns the values in rank order (see :meth:`execute`).

        Raises:
            WorkerError: ``fn`` raised on some rank, or a rank or its actor died (the job then ends).
        """
        if self._elastic is not None:
            return self._elastic.run(fn, args=args, kwargs=kwargs, callbacks=callbacks)
        return self._all(("call", fn, tuple(args or ()), dict(kwargs or {}), False), callbacks)

    def run_remote(self, fn: Callable[..., Any], args: Optional[List] = None,
                   kwargs: Optional[Dict] = None) -> List[Any]:
        """Start ``fn(*args, **kwargs)`` on every rank; returns one Ray ObjectRef per rank (``ray.get`` them)."""
        if self._elastic is not None:
            raise NotImplementedError("run_remote() with an elastic executor: use run(fn)")
        self._check_alive()
        payload = _pack(("call", fn, tuple(args or ()), dict(kwargs or {}), False))
        return [w.call.remote(payload) for w in self.workers]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(executable)`` on rank 0 only and return its value (``fn`` must not use collectives)."""
        if self._elastic is not None:
            raise NotImplementedError("execute_single() with an elastic executor")
        self._check_alive()
        return gather([self.workers[0].call.remote(_pack(("call", fn, (), {}, True)))], where=self._where[:1])[0]

    def shutdown(self) -> None:
        """End the job (every rank leaves), remove the actors and the placement group. Idempotent."""
        if self._elastic is not None:
            return self._elastic.shutdown()
        import ray
        from ray.util.placement_group import remove_placement_group

        self._alive = False
        workers, self.workers = self.workers, []
        if workers:
            try:
                ray.get([w.stop.remote() for w in workers], timeout=30)
                ray.get([w.close.remote() for w in workers], timeout=30)
            except Exception:  # noqa: BLE001 - a dead actor: killed below anyway
                pass
            for w in workers:
                ray.kill(w)
        if self._queue is not None:
            try:
                self._queue.shutdown()
            except Exception:  # noqa: BLE001 - the queue's actor already gone
                pass
            self._queue = None
        if self._pg is not None:
            if self._own_pg:
                remove_placement_group(self._pg)
            self._pg = None


def _ranks_by_machine(infos: list, use_gpu: bool):
    """Group the actors by machine (host name and address). Returns ``(order, nodes, node_envs)``: the actors'
    indexes in rank order, the MPI nodes (the first actor's machine first), and each node's daemon variables
    (every GPU of the node's actors, so that ranks choose theirs by local rank)."""
    machines: dict[tuple, list[int]] = {}
    for i, info in enumerate(infos):
        machines.setdefault((info["hostname"], info["ip"]), []).append(i)
    order, nodes, node_envs = [], [], {}
    for index, members in enumerate(machines.values()):
        name = remote_job.node_name(index)
        order += members
        nodes.append(remote_job.Node(name, infos[members[0]]["service"], len(members)))
        env = {}
        gpus = sorted({g for m in members for g in infos[m]["gpu_ids"]}, key=lambda g: (len(g), g))
        if use_gpu and gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        node_envs[name] = env
    return order, nodes, node_envs


def _node_of_rank(nodes: list) -> list:
    """``(rank, node)`` for every rank, ranks numbered node by node."""
    out = []
    for n in nodes:
        out += [(len(out) + j, n) for j in range(n.slots)]
    return out
