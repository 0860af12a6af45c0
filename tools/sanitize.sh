#!/usr/bin/env bash
# Build the native core with AddressSanitizer + UndefinedBehaviorSanitizer and run the engine's MPI tests on
# 2 ranks with it. Any sanitizer report fails the run. The build and a copy of the package and tests live in
# a temporary directory; the repository's own build is not touched.
# Usage: bash tools/sanitize.sh [pytest args...]   (default: the engine's MPI test files)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
BIN="${PERSEUS_VENV:-$ROOT/.venv}/bin"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/perseus-sanitize.XXXXXX")"
trap '[ -n "${KEEP:-}" ] || rm -rf "$WORK"' EXIT
cp -r setup.py pyproject.toml README.md native perseus tests "$WORK/"
find "$WORK" -name '*.so' -delete
cd "$WORK"
# setup.py build_ext runs without build isolation here: pybind11 must be in the environment.
"$BIN/python" -c "import pybind11" 2>/dev/null || "$BIN/python" -m pip install -q "pybind11>=2.12"
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
echo "== building perseus._core with $SAN"
CXXFLAGS="$SAN -O1 -g" LDFLAGS="$SAN" PERSEUS_BUILD_JOBS=2 \
  "$BIN/python" setup.py -q build_ext --inplace --build-temp "$WORK/build" >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log"; exit 1; }
# ASan must be loaded first; libstdc++ right after it, or ASan's C++ exception interceptor finds no
# __cxa_throw (python itself does not link libstdc++) and aborts on the first exception.
export LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)"
# Python and the frameworks are not instrumented: leak checking would report their intentional leaks.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:handle_abort=1:handle_segv=1:allocator_may_return_null=1:detect_odr_violation=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export PYTHONPATH="$WORK"
TESTS=("$@")
if [ ${#TESTS[@]} -eq 0 ]; then
  TESTS=(tests/mpi/test_collectives.py tests/mpi/test_errors.py tests/mpi/test_join_timeline.py
         tests/mpi/test_process_sets.py tests/mpi/test_transport.py tests/mpi/test_elastic.py
         tests/mpi/test_adasum.py tests/mpi/test_device_buckets.py
         --deselect tests/mpi/test_adasum.py::test_tensorflow_allreduce)
fi
MPIRUN=("$BIN/mpirun" --oversubscribe --bind-to none -x LD_PRELOAD -x ASAN_OPTIONS -x UBSAN_OPTIONS -x PYTHONPATH)
if [ "$(id -u)" = "0" ]; then MPIRUN+=(--allow-run-as-root); fi
echo "== ${TESTS[*]} on 2 ranks, under ASan + UBSan"
status=0
timeout 1500 "${MPIRUN[@]}" -np 2 "$BIN/python" -m pytest -q -p no:cacheprovider -p no:faulthandler --color=no "${TESTS[@]}" \
  2>&1 | tee "$WORK/run.log" || status=1
if [ $# -eq 0 ]; then
  # The channels' TCP links and the hierarchical algorithms run only across hosts: the loopback tests give
  # ranks different host keys in one process.
  echo "== tests/unit/test_engine_loopback.py (ranks on several hosts), under ASan + UBSan"
  timeout 900 "$BIN/python" -m pytest -q -p no:cacheprovider -p no:faulthandler --color=no \
    tests/unit/test_engine_loopback.py -k "across_hosts or links" 2>&1 | tee -a "$WORK/run.log" || status=1
fi
if grep -a -q -E "ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer" "$WORK/run.log"; then
  echo "sanitize: REPORTS FOUND (above)"
  exit 1
fi
[ "$status" = 0 ] && echo "sanitize: passed, no reports" || echo "sanitize: tests failed"
exit $status
