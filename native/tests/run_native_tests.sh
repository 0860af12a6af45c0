#!/usr/bin/env bash
# Build and run the native core's C++ tests: the kernels and repr helpers (against double references and
# against NumPy/Python via gen_reference.py), the engine's message codec (control messages, negotiation
# payloads), the device buckets' planning, the reused memory of a steady step, then the MPI transport under
# mpirun on 2 and 3 ranks. The kernels and the MPI transport have a test program per area (KERNEL_TESTS,
# MPI_TESTS), each linked against the code under test compiled once.
# The kernels are tested as debug code (-O1) and as shipped (-O3, which vectorises them): with the
# per-CPU variants this CPU picks, with the plain baseline x86-64 loops, and with AVX2 code generation.
# Exits non-zero on the first failure. Usage: bash native/tests/run_native_tests.sh [quick]
# (quick: the kernels as debug code and as shipped only, not with the baseline and AVX2 code generation; the
# test command's quick mode uses it, its full mode runs every variant.)
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
KERNEL_TESTS=(test_kernels_conversions test_kernels_elementwise test_kernels_repr test_kernels_numpy)
KERNEL_SOURCES=(native/kernels.cc native/common.cc)
MPI_TESTS=(test_mpi_collectives test_mpi_16bit test_mpi_p2p test_mpi_nonblocking test_mpi_comms)
MPI_SOURCES=(native/transport_mpi.cc native/transport_mpi_p2p.cc native/transport_mpi_collectives.cc
             native/transport_mpi_types.cc native/kernels.cc native/common.cc)

# Two compilers at a time. `wait PID` returns that build's status; a bare `wait -n && wait -n` would not stop
# the script under `set -e` when the first of the pair fails (a failure inside && lists is ignored).
both() {  # both PID PID: wait for the two builds; exit at once if either failed
  local failed=0
  wait "$1" || failed=1
  wait "$2" || failed=1
  if [ "$failed" -ne 0 ]; then echo "native tests: a build failed (its compiler output is above)" >&2; exit 1; fi
}

# programs DIR SOURCES TESTS [FLAGS...]: the files listed in the array named SOURCES compiled once into DIR, then
# each program listed in the array named TESTS (native/tests/<name>.cc) linked against them as DIR/<name>; all
# with FLAGS after the common ones. Returns non-zero on the first failed build.
programs() {
  local dir="$1" src program objects=()
  local -n sources_="$2" tests_="$3"
  shift 3
  mkdir -p "$dir"
  for src in "${sources_[@]}"; do
    objects+=("$dir/$(basename "${src%.cc}").o")
    "$MPICXX" "${FLAGS[@]}" "$@" -c "$src" -o "${objects[-1]}" || return 1
  done
  for program in "${tests_[@]}"; do
    "$MPICXX" "${FLAGS[@]}" "$@" -o "$dir/$program" "native/tests/$program.cc" "${objects[@]}" -lpthread || return 1
  done
}

echo "-- building"
programs "$WORK/kernels" KERNEL_SOURCES KERNEL_TESTS &
first=$!
programs "$WORK/mpi" MPI_SOURCES MPI_TESTS &
both "$first" $!
VARIANTS=(shipped)
if [ "${1:-}" = quick ]; then
  programs "$WORK/kernels_shipped" KERNEL_SOURCES KERNEL_TESTS -O3 &
  first=$!
  "$MPICXX" "${FLAGS[@]}" -o "$WORK/test_reuse" native/tests/test_reuse.cc native/alloc_count.cc -ldl &
  both "$first" $!
else
  VARIANTS+=(baseline)
  programs "$WORK/kernels_shipped" KERNEL_SOURCES KERNEL_TESTS -O3 &
  first=$!
  programs "$WORK/kernels_baseline" KERNEL_SOURCES KERNEL_TESTS -O3 -DPERSEUS_NO_TARGET_CLONES &
  both "$first" $!
  if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
    VARIANTS+=(avx2)
    programs "$WORK/kernels_avx2" KERNEL_SOURCES KERNEL_TESTS -O3 -mavx2 -DPERSEUS_NO_TARGET_CLONES
  fi
fi
"$MPICXX" "${FLAGS[@]}" -o "$WORK/test_codec" native/tests/test_codec.cc native/control.cc native/negotiation.cc \
  native/common.cc &
first=$!
"$MPICXX" "${FLAGS[@]}" -o "$WORK/test_device_buckets" native/tests/test_device_buckets.cc native/device_buckets.cc \
  native/common.cc &
both "$first" $!
[ -x "$WORK/test_reuse" ] || "$MPICXX" "${FLAGS[@]}" -o "$WORK/test_reuse" native/tests/test_reuse.cc native/alloc_count.cc -ldl

echo "-- kernels and repr helpers"
"$PY" native/tests/gen_reference.py "$WORK/reference.bin"
kernel_tests() {  # kernel_tests DIR: the kernel test programs built in DIR (test_kernels_numpy reads the references)
  local program
  for program in "${KERNEL_TESTS[@]}"; do
    timeout 120 "$1/$program" "$WORK/reference.bin"
  done
}
kernel_tests "$WORK/kernels"
for VARIANT in "${VARIANTS[@]}"; do
  echo "   -O3, $VARIANT:"
  kernel_tests "$WORK/kernels_$VARIANT"
done

echo "-- message codec"
timeout 60 "$WORK/test_codec"

echo "-- device buckets"
timeout 60 "$WORK/test_device_buckets"

echo "-- reused memory (queues, map nodes, recycled objects, the allocation counter)"
timeout 60 "$WORK/test_reuse"

for NP in 2 3; do
  echo "-- MPI transport on $NP ranks"
  for PROGRAM in "${MPI_TESTS[@]}"; do
    timeout 120 "$MPIRUN" --oversubscribe --bind-to none --allow-run-as-root -np "$NP" "$WORK/mpi/$PROGRAM"
  done
done
echo "native tests: passed"
