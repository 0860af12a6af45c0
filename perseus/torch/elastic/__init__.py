"""Elastic training for PyTorch (Horovod's ``horovod.torch.elastic``).

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...            # train, calling state.commit() every few batches

    train(state)

In a static job (``mpirun``, or ``perseusrun`` without ``--host-discovery-script``), ``run`` recovers from a
collective that failed on every rank: each rank restores its last commit, perseus restarts, state is synced from
rank 0 and ``train`` is called again, at most ``PERSEUS_ELASTIC_RESET_LIMIT`` times (default 3); a rank that died
cannot be replaced there. Under the elastic launcher (``perseusrun --host-discovery-script``) the job also
survives dead ranks and host changes (docs/elastic.md). See :mod:`perseus.elastic.state`.
"""

from perseus.elastic.state import ObjectState, run_fn  # noqa: F401 - ObjectState: convenience attribute
from perseus.runtime.state import runtime as _runtime
from perseus.torch.elastic.sampler import ElasticSampler
from perseus.torch.elastic.state import TorchState
from perseus.torch.mpi_ops import init, shutdown

__all__ = [
    "TorchState",
    "ElasticSampler",
    "run",
]


def run(func):
    """Decorator running ``func(state, *args, **kwargs)`` in the elastic retry loop.

    Before each attempt the state is synced from rank 0. When ``func`` raises ``HorovodInternalError`` the state
    goes back to its last commit; on ``HostsUpdatedInterrupt`` it is kept. Either way perseus is restarted
    (``shutdown(); init()``), ``state.on_reset()`` runs the reset callbacks, and ``func`` is called again. Other
    exceptions propagate at once.

    ``func`` must not be a single collective, and must not run collectives before it first touches the state:
    every rank has to reach the sync at the start of each attempt.

    Process sets other than the global one do not survive a reset; re-create them in a reset callback.
    """
    return run_fn(func, _reset, _init_on)


def _reset():
    """Restart perseus over the same ranks as before.

    This is the seam for an elastic launcher: with one, the reset re-forms the job from the hosts the launcher
    discovered; without one the ranks cannot change, so ``init`` gets the communicator the job already used.
    """
    comm = _runtime().world_comm()
    shutdown()
    init(comm=comm)


def _init_on(comm):
    """Start perseus on ``comm`` (the survivors' communicator after a rank failed in an elastic job)."""
    init(comm=comm)
