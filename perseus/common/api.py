"""The framework-neutral half of every framework module's API, bound once to the process's runtime.

Framework modules (``perseus.torch.mpi_ops``, ``perseus.tensorflow.mpi_ops``) import these names instead of
binding them again, so the list lives in one place.
"""

from perseus.common.basics import state
from perseus.transport.mpi import require_mpi

require_mpi()  # a framework module without an MPI fails at import, saying how to get one

__all__ = [
    "_basics", "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "wire_bytes",
]

_basics = state()


def init(comm=None, process_sets=None):
    """Start perseus on this process. On a running perseus (e.g. started by another framework module) it
    starts nothing; given ``process_sets`` it then assigns them the ids of the registered sets with their
    ranks. See :meth:`perseus.common.basics.PerseusBasics.init` for the arguments.

    Collective: every rank of ``comm`` (default: every rank of the job) must call it. Start-up is all or
    nothing: a failure on one rank raises on every rank, or, inside MPI's collective calls, aborts the job.

    Raises:
        ValueError: bad arguments, duplicate process sets, or MPI cannot run perseus (the message says what
            to do). Any other start-up failure on some rank is raised on every rank, naming the rank.
    """
    _basics.init(comm, process_sets)


def shutdown():
    """Stop perseus on this rank: pending requests fail, and per-job state (handles, the numbering of unnamed
    requests) is forgotten, so that a later ``init()`` starts afresh. Safe to call more than once."""
    _basics.shutdown()


is_initialized = _basics.is_initialized
start_timeline = _basics.start_timeline
stop_timeline = _basics.stop_timeline
size = _basics.size
local_size = _basics.local_size
cross_size = _basics.cross_size
rank = _basics.rank
local_rank = _basics.local_rank
cross_rank = _basics.cross_rank
is_homogeneous = _basics.is_homogeneous
mpi_threads_supported = _basics.mpi_threads_supported
mpi_enabled = _basics.mpi_enabled
mpi_built = _basics.mpi_built
gloo_enabled = _basics.gloo_enabled
gloo_built = _basics.gloo_built
nccl_built = _basics.nccl_built
ddl_built = _basics.ddl_built
ccl_built = _basics.ccl_built
cuda_built = _basics.cuda_built
rocm_built = _basics.rocm_built
wire_bytes = _basics.wire_bytes
