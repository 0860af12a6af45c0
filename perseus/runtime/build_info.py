"""What this build of perseus supports, answered as Horovod's ``*_built()`` and ``*_enabled()`` queries.

:class:`BuildInfo` is a base class of :class:`perseus.runtime.state.Runtime`. Its answers are fixed (perseus
always runs over MPI; the framework-neutral runtime has no Gloo, NCCL, DDL, CCL, CUDA or ROCm), except
:meth:`BuildInfo.mpi_threads_supported`, which asks MPI (loading it where nothing has yet). Local: no rank
needs the others to answer; nothing here raises of its own.
"""

from __future__ import annotations

from perseus.transport.mpi import load_mpi

__all__ = ["BuildInfo"]


class BuildInfo:
    """Horovod's queries of what the build supports (a base class of :class:`perseus.runtime.state.Runtime`)."""

    def mpi_threads_supported(self) -> bool:
        """True when MPI runs with MPI_THREAD_MULTIPLE (perseus requires it)."""
        MPI = load_mpi()
        return MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def mpi_enabled(self) -> bool:
        """True: perseus always uses MPI."""
        return True

    def mpi_built(self) -> bool:
        """True: perseus always uses MPI."""
        return True

    def gloo_enabled(self) -> bool:
        """False: perseus does not use Gloo."""
        return False

    def gloo_built(self) -> bool:
        """False: perseus does not use Gloo."""
        return False

    def nccl_built(self) -> int:
        """0: the framework-neutral runtime uses no NCCL (``perseus.torch`` reports the NCCL its torch has)."""
        return 0

    def ddl_built(self) -> bool:
        """False."""
        return False

    def ccl_built(self) -> bool:
        """False."""
        return False

    def cuda_built(self) -> bool:
        """False: GPU tensors are supported by ``perseus.torch`` only, which reports its own answer."""
        return False

    def rocm_built(self) -> bool:
        """False."""
        return False
