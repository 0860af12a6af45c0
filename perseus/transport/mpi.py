"""MPI from Python: initialising it through mpi4py with perseus's runtime options.

The MPI transport itself is native (``native/transport_mpi.cc``): it receives the communicators that mpi4py
creates (by handle) and moves buffers, negotiation words and control messages on duplicates of them.
"""

from __future__ import annotations


from perseus.common.knobs import set_external_default

__all__ = ["load_mpi", "mpi_flavour"]

_MPI = None


def load_mpi(thread_multiple: bool = True):
    """Import ``mpi4py.MPI`` (which initialises MPI) with perseus's preferred runtime options.

    Sets ``OMPI_MCA_mpi_yield_when_idle=1`` unless the user chose a value: ranks that wait inside an Open MPI
    collective then yield the core instead of spinning on it, which matters whenever ranks share cores.
    """
    global _MPI
    if _MPI is not None:
        return _MPI
    set_external_default("OMPI_MCA_mpi_yield_when_idle", "1")
    import mpi4py

    if not thread_multiple:
        mpi4py.rc.thread_level = "serialized"
    from mpi4py import MPI

    _MPI = MPI
    return MPI


def mpi_flavour() -> str:
    """'openmpi', 'mpich' or 'other', from the library version string."""
    text = load_mpi().Get_library_version()
    if "Open MPI" in text:
        return "openmpi"
    if "MPICH" in text or "Intel" in text:
        return "mpich"
    return "other"
