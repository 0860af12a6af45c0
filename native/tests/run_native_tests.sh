#!/usr/bin/env bash
# Build and run the native core's C++ tests: the kernels and repr helpers (against double references and
# against NumPy/Python via gen_reference.py), then the MPI transport under mpirun on 2 and 3 ranks.
# Exits non-zero on the first failure. Usage: bash native/tests/run_native_tests.sh
# Environment: PYTHON (default .venv/bin/python), MPICXX / MPIRUN (default .venv/bin/mpicxx / mpirun).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$(pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
MPICXX="${MPICXX:-$ROOT/.venv/bin/mpicxx}"
MPIRUN="${MPIRUN:-$ROOT/.venv/bin/mpirun}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/perseus-native-tests.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
FLAGS=(-std=c++17 -O1 -g -Wall -Wextra -Werror)

echo "-- building"
"$MPICXX" "${FLAGS[@]}" -o "$WORK/test_kernels" native/tests/test_kernels.cc native/kernels.cc native/common.cc &
"$MPICXX" "${FLAGS[@]}" -o "$WORK/test_transport_mpi" native/tests/test_transport_mpi.cc \
  native/transport_mpi.cc native/kernels.cc native/common.cc -lpthread &
wait -n && wait -n  # two compilers at most; either failing stops the script

echo "-- kernels and repr helpers"
"$PY" native/tests/gen_reference.py "$WORK/reference.bin"
timeout 120 "$WORK/test_kernels" "$WORK/reference.bin"

for NP in 2 3; do
  echo "-- MPI transport on $NP ranks"
  timeout 120 "$MPIRUN" --oversubscribe --bind-to none --allow-run-as-root -np "$NP" "$WORK/test_transport_mpi"
done
echo "native tests: passed"
