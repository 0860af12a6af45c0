"""``ElasticRayExecutor``: an elastic perseus job on a Ray cluster (Horovod's ``horovod.ray.ElasticRayExecutor``).

The job follows the cluster: discovery (:class:`RayHostDiscovery` by default) lists Ray's live nodes and the
slots each offers (its CPUs / ``cpus_per_slot``, with ``use_gpu`` also its GPUs / ``gpus_per_slot``; nodes that
share a machine count as one). One agent actor per machine (no resources of its own) runs the service through
which ``mpirun`` starts the daemon there (:mod:`perseus.runner.remote`). perseusrun's elastic driver runs here:
a rank, actor or node that dies is left out and the job re-forms on what is left, restoring the last commit
from the checkpoint keepers; nodes that join are used at the next commit.
"""

from __future__ import annotations

import math
import random
import secrets
import threading
import warnings
import time
from typing import Any, Callable, Dict, List, Optional

from perseus.ray.settings import Settings, connect, make_settings
from perseus.runner.remote import job as remote_job
from perseus.runner.remote.elastic_job import HostedNode, run_elastic
from perseus.runner.remote.service import NodeService

__all__ = ["ElasticRayExecutor", "RayHostDiscovery", "TestDiscovery"]


class RayHostDiscovery:
    """Ray's live nodes and their slots: ``find_available_hosts_and_slots() -> {node address: slots}`` (nodes on
    one address are added up)."""

    def __init__(self, use_gpu: bool = False, cpus_per_slot: float = 1, gpus_per_slot: float = 1):
        self.use_gpu, self.cpus_per_slot, self.gpus_per_slot = use_gpu, cpus_per_slot, gpus_per_slot or 1

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        import ray

        cpus: Dict[str, float] = {}
        gpus: Dict[str, float] = {}
        for node in ray.nodes():
            if not node.get("Alive", node.get("alive")):
                continue
            address, res = node["NodeManagerAddress"], node.get("Resources", {})
            cpus[address] = cpus.get(address, 0) + res.get("CPU", 0)
            gpus[address] = gpus.get(address, 0) + res.get("GPU", 0)
        out = {}
        for address, c in cpus.items():
            slots = math.floor(c / self.cpus_per_slot) if self.cpus_per_slot else 0
            if self.use_gpu:
                slots = min(slots, math.floor(gpus[address] / self.gpus_per_slot))
            if slots > 0:
                out[address] = int(slots)
        return out


class TestDiscovery(RayHostDiscovery):
    """Ray's nodes, with one added or left out at random every ``change_frequency_s`` seconds, keeping between
    ``min_hosts`` and ``max_hosts`` (to exercise a job's re-forms; Horovod's test discovery). Left-out nodes
    are only hidden from the job (``_graceful``), never stopped."""

    __test__ = False  # not a pytest test class

    def __init__(self, min_hosts: int, max_hosts: int, change_frequency_s: float, use_gpu: bool = False,
                 cpus_per_slot: float = 1, gpus_per_slot: float = 1, verbose: bool = True, _graceful: bool = True):
        super().__init__(use_gpu, cpus_per_slot, gpus_per_slot)
        self.min_hosts, self.max_hosts, self.change_frequency_s = min_hosts, max_hosts, change_frequency_s
        self.verbose, self._removed, self._last = verbose, set(), None

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        hosts = super().find_available_hosts_and_slots()
        self._removed &= set(hosts)
        now = time.monotonic()
        if self._last is None:
            self._last = now
        elif now - self._last >= self.change_frequency_s:
            self._last = now
            shown = [h for h in hosts if h not in self._removed]
            grow = len(shown) <= self.min_hosts or (len(shown) < self.max_hosts and random.random() < 0.5)
            if grow and self._removed:
                self._removed.discard(random.choice(sorted(self._removed)))
            elif not grow and len(shown) > 1:
                self._removed.add(random.choice(sorted(shown)))
            if self.verbose:
                print(f"perseus.ray TestDiscovery: hosts now {sorted(set(hosts) - self._removed)}", flush=True)
        return {h: s for h, s in hosts.items() if h not in self._removed}


class _NodeAgent:
    """The actor on one machine whose service starts that machine's daemon, keeper and strays' kills."""

    def __init__(self, token: str, env: dict):
        import ray

        self.ip = ray.util.get_node_ip_address()
        self.service = NodeService(token, self.ip, env={str(k): str(v) for k, v in env.items()})

    def address(self) -> tuple:
        return self.ip, f"{self.ip}:{self.service.port}"

    def close(self) -> None:
        self.service.close()


class ElasticRayExecutor:
    """An elastic perseus job on Ray (see the module doc), with Horovod's API.

    Args:
        settings: from :meth:`create_settings` (``min_num_proc``, ``max_num_proc``, ``reset_limit``,
            ``elastic_timeout``, ...).
        use_gpu, cpus_per_slot, gpus_per_slot: what one slot (one rank) takes.
        env_vars: variables for every rank.
        override_discovery: use :class:`RayHostDiscovery` even when ``settings.discovery`` is set (Horovod's
            default); False keeps the settings' discovery (e.g. :class:`TestDiscovery`).
    """

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: Optional[int] = None, reset_limit: Optional[int] = None,
                        elastic_timeout: float = 600, timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                        nics=None, min_np: Optional[int] = None, max_np: Optional[int] = None, *,
                        cooldown_range=None, verbose: int = 0, **kwargs) -> Settings:
        """Settings for an elastic job, with Horovod's arguments in Horovod's order: at least ``min_num_proc``
        and at most ``max_num_proc`` ranks (``min_np``/``max_np``: Horovod's older names, deprecated there too),
        ``reset_limit``, ``elastic_timeout``, ``timeout_s``, ``nics``, and of Horovod's settings passed on by
        keyword, ``cooldown_range`` and ``verbose``. ``ssh_identity_file`` and ``ssh_port`` are accepted; no ssh
        is used.

        Raises:
            TypeError: another keyword of Horovod's settings, which perseus's Ray executor cannot honour (named).
            ValueError: ``min_num_proc`` below 1, or ``max_num_proc`` below it.
        """
        if min_np is not None:
            warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, stacklevel=2)
            min_num_proc = min_np
        if max_np is not None:
            warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, stacklevel=2)
            max_num_proc = max_np
        kwargs.pop("ssh_port", None)  # (no ssh)
        if kwargs:
            raise TypeError(f"ElasticRayExecutor.create_settings: perseus's Ray executor cannot honour "
                            f"{', '.join(sorted(kwargs))}; leave {'them' if len(kwargs) > 1 else 'it'} out")
        if min_num_proc is None or int(min_num_proc) < 1:
            raise ValueError(f"ElasticRayExecutor.create_settings: min_num_proc must be at least 1, not "
                             f"{min_num_proc!r}")
        if max_num_proc is not None and int(max_num_proc) < int(min_num_proc):
            raise ValueError(f"ElasticRayExecutor.create_settings: max_num_proc ({max_num_proc}) is below "
                             f"min_num_proc ({min_num_proc})")
        return make_settings(ssh_identity_file, None, timeout_s=timeout_s, nics=nics, verbose=verbose, elastic=True,
                             min_np=int(min_num_proc), max_np=None if max_num_proc is None else int(max_num_proc),
                             reset_limit=reset_limit, cooldown_range=cooldown_range, elastic_timeout=elastic_timeout)

    def __init__(self, settings: Settings, use_gpu: bool = False, cpus_per_slot: float = 1,
                 gpus_per_slot: Optional[float] = None, env_vars: Optional[dict] = None,
                 override_discovery: bool = True):
        self.settings = settings if settings is not None else self.create_settings()
        if override_discovery or self.settings.discovery is None:
            self.settings.discovery = RayHostDiscovery(use_gpu, cpus_per_slot, gpus_per_slot or 1)
        self.env_vars = dict(env_vars or {})
        self._token = secrets.token_hex(16)
        self._agents: Dict[str, tuple] = {}   # node address -> (actor, name, service)
        self._lock = threading.Lock()
        self._started = False

    def start(self, envs: Optional[dict] = None, **_ignored) -> None:
        """Connect to Ray (``ray.init()`` when not initialized); the job itself starts in :meth:`run`.

        Raises:
            ImportError: Ray is not installed.
        """
        connect()
        self.env_vars.update(envs or {})
        self._started = True

    def _agent_for(self, address: str) -> Optional[tuple]:
        """The live agent on the machine at ``address`` (started there when missing); None while it cannot be."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self._lock:
            known = self._agents.get(address)
        if known is not None:
            ready, _ = ray.wait([known[0].address.remote()], timeout=5.0)
            try:
                if ready and ray.get(ready[0]):
                    return known
            except Exception:  # noqa: BLE001 - the agent (or its node) died: start another
                pass
        node_id = next((n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeManagerAddress"] == address),
                       None)
        if node_id is None:
            return None
        actor = ray.remote(_NodeAgent).options(
            num_cpus=0, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(self._token, self.env_vars)
        try:
            ip, service = ray.get(actor.address.remote(), timeout=60.0)
        except Exception:  # noqa: BLE001 - not placed (node gone): try again at the next poll
            ray.kill(actor)
            return None
        with self._lock:
            name = known[1] if known else remote_job.node_name(len(self._agents))
            self._agents[address] = (actor, name, service)
        return self._agents[address]

    def _check_hosts(self) -> None:
        """Every host the discovery names now must be a Ray node's address (a node the job could never use would
        otherwise be left out without a word).

        Raises:
            ValueError: naming the hosts that match no node, and Ray's nodes.
        """
        import ray

        known = {n["NodeManagerAddress"] for n in ray.nodes()}
        unknown = sorted(h for h in self.settings.discovery.find_available_hosts_and_slots() if h not in known)
        if unknown:
            raise ValueError(f"ElasticRayExecutor: the discovery names {', '.join(unknown)}, which "
                             f"{'is' if len(unknown) == 1 else 'are'} not the address of any Ray node (Ray's nodes: "
                             f"{', '.join(sorted(known))}); a discovery for Ray names nodes by their address "
                             "(ray.nodes()' NodeManagerAddress)")

    def _nodes(self) -> List[HostedNode]:
        out = []
        for address, slots in self.settings.discovery.find_available_hosts_and_slots().items():
            agent = self._agent_for(address)
            if agent is not None:
                out.append(HostedNode(agent[1], agent[2], address, int(slots)))
        return out

    def run(self, worker_fn: Callable[..., Any], callbacks: Optional[List[Callable]] = None,
            args: Optional[List] = None, kwargs: Optional[Dict] = None) -> List[Any]:
        """Run ``worker_fn(*args, **kwargs)`` elastically (it uses ``hvd.elastic.run``); returns the values of the
        final generation's ranks in rank order. ``callbacks`` get each value any rank logs
        (``perseus.ray.ray_logger.log``), as Horovod's elastic executor forwards every worker's.

        Raises:
            perseus.runner.run_func.RunError: the job failed (a rank raised; too few slots for ``elastic_timeout``;
                the reset limit was reached): the message says which and why.
            ValueError: the settings' discovery names a host that is not the address of any Ray node.
        """
        import ray

        if not self._started:
            self.start()
        s = self.settings
        self._check_hosts()

        def on_log(info):
            for cb in callbacks or ():
                cb(info)

        return run_elastic(worker_fn, tuple(args or ()), dict(kwargs or {}), self._nodes, service_token=self._token,
                           driver_address=ray.util.get_node_ip_address(), min_np=s.min_np or 1, max_np=s.max_np,
                           reset_limit=s.reset_limit, cooldown_range=s.cooldown_range,
                           elastic_timeout=s.elastic_timeout, env=self.env_vars, nics=s.nic_list(),
                           verbose=bool(s.verbose), on_log=on_log, what="perseus.ray")

    def shutdown(self) -> None:
        """Stop the agents (and whatever they still run). Idempotent."""
        import ray

        with self._lock:
            agents, self._agents = list(self._agents.values()), {}
        for actor, _, _ in agents:
            try:
                ray.get(actor.close.remote(), timeout=15)
            except Exception:  # noqa: BLE001 - already dead
                pass
            ray.kill(actor)
        self._started = False
