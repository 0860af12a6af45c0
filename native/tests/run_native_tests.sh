#!/usr/bin/env bash
# Build and run the native core's C++ tests: the kernels and repr helpers (against double references and
# against NumPy/Python via gen_reference.py), the engine's message codec (control messages, negotiation
# payloads), the device buckets' planning, the reused memory of a steady step, then the MPI transport under
# mpirun on 2 and 3 ranks.
# The kernels are tested as debug code (-O1) and as shipped (-O3, which vectorises them): with the
# per-CPU variants this CPU picks, with the plain baseline x86-64 loops, and with AVX2 code generation.
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
KERNELS=(native/tests/test_kernels.cc native/kernels.cc native/common.cc)

# Two compilers at a time. `wait PID` returns that build's status; a bare `wait -n && wait -n` would not stop
# the script under `set -e` when the first of the pair fails (a failure inside && lists is ignored).
both() {  # both PID PID: wait for the two builds; exit at once if either failed
  local failed=0
  wait "$1" || failed=1
  wait "$2" || failed=1
  if [ "$failed" -ne 0 ]; then echo "native tests: a build failed (its compiler output is above)" >&2; exit 1; fi
}

echo "-- building"
"$MPICXX" "${FLAGS[@]}" -o "$WORK/test_kernels" "${KERNELS[@]}" &
first=$!
"$MPICXX" "${FLAGS[@]}" -o "$WORK/test_transport_mpi" native/tests/test_transport_mpi.cc \
  native/transport_mpi.cc native/transport_mpi_p2p.cc native/transport_mpi_collectives.cc \
  native/transport_mpi_types.cc native/kernels.cc native/common.cc -lpthread &
both "$first" $!
VARIANTS=(shipped baseline)
"$MPICXX" "${FLAGS[@]}" -O3 -o "$WORK/test_kernels_shipped" "${KERNELS[@]}" &
first=$!
"$MPICXX" "${FLAGS[@]}" -O3 -DPERSEUS_NO_TARGET_CLONES -o "$WORK/test_kernels_baseline" "${KERNELS[@]}" &
both "$first" $!
if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
  VARIANTS+=(avx2)
  "$MPICXX" "${FLAGS[@]}" -O3 -mavx2 -DPERSEUS_NO_TARGET_CLONES -o "$WORK/test_kernels_avx2" "${KERNELS[@]}"
fi
"$MPICXX" "${FLAGS[@]}" -o "$WORK/test_codec" native/tests/test_codec.cc native/control.cc native/negotiation.cc \
  native/common.cc &
first=$!
"$MPICXX" "${FLAGS[@]}" -o "$WORK/test_device_buckets" native/tests/test_device_buckets.cc native/device_buckets.cc \
  native/common.cc &
both "$first" $!
"$MPICXX" "${FLAGS[@]}" -o "$WORK/test_reuse" native/tests/test_reuse.cc native/alloc_count.cc -ldl

echo "-- kernels and repr helpers"
"$PY" native/tests/gen_reference.py "$WORK/reference.bin"
timeout 120 "$WORK/test_kernels" "$WORK/reference.bin"
for VARIANT in "${VARIANTS[@]}"; do
  echo "   -O3, $VARIANT:"
  timeout 120 "$WORK/test_kernels_$VARIANT" "$WORK/reference.bin"
done

echo "-- message codec"
timeout 60 "$WORK/test_codec"

echo "-- device buckets"
timeout 60 "$WORK/test_device_buckets"

echo "-- reused memory (queues, map nodes, recycled objects, the allocation counter)"
timeout 60 "$WORK/test_reuse"

for NP in 2 3; do
  echo "-- MPI transport on $NP ranks"
  timeout 120 "$MPIRUN" --oversubscribe --bind-to none --allow-run-as-root -np "$NP" "$WORK/test_transport_mpi"
done
echo "native tests: passed"
