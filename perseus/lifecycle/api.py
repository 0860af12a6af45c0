"""The framework-neutral half of every framework module's API, bound once to the process's runtime.

Framework modules (``perseus.torch.mpi_ops``, ``perseus.tensorflow.mpi_ops``) import these names instead of
binding them again, so the list lives in one place. It sits above the runtime, with :mod:`perseus.lifecycle`.
"""

from perseus.runtime.state import runtime
from perseus.lifecycle import add_process_set, init, remove_process_set, shutdown
from perseus.transport.mpi import require_mpi

require_mpi()  # a framework module without an MPI fails at import, saying how to get one

__all__ = [
    "_basics", "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size", "local_size",
    "cross_size", "rank", "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "wire_bytes", "add_process_set", "remove_process_set",
]

#: the runtime, under the name Horovod's framework modules give it (``hvd.mpi_ops._basics``)
_basics = runtime()

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
