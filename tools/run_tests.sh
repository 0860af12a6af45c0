#!/usr/bin/env bash
# Set everything up and run every test: unit and integration tests in one process, then the MPI suite
# under mpirun at 2 and 3 ranks, then the wheel as a user installs it (tools/check_wheel.sh), then the MXNet
# suite in its own environment (tools/run_mxnet_tests.sh).
# Every test has a timeout; a failing rank aborts its MPI job.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="$(bash tools/setup_env.sh torch,tensorflow-cpu,test)"
export PATH="$BIN:$PATH"
# tf-keras 2 (for the TF_USE_LEGACY_KERAS=1 tests) matching the installed TensorFlow; --no-deps because its
# metadata asks for the full "tensorflow" wheel while tensorflow-cpu provides the same module.
TF_MINOR="$("$BIN/python" -c 'import tensorflow as tf; print(".".join(tf.__version__.split(".")[:2]))' 2>/dev/null)"
"$BIN/python" -m pip install -q --no-deps "tf-keras==${TF_MINOR}.*" -c tools/constraints.txt
MPIRUN=("$BIN/mpirun" --oversubscribe --bind-to none)
if [ "$(id -u)" = "0" ]; then MPIRUN+=(--allow-run-as-root); fi
# -X faulthandler: a crash (even at interpreter exit) prints every thread's Python stack.
PYTEST=("$BIN/python" -X faulthandler -m pytest -p no:cacheprovider --color=no)
status=0
echo "== unit and integration tests (no mpirun)"
"${PYTEST[@]}" -q tests/unit tests/integration || status=1
mpi_suite() {  # mpi_suite NP LOG: the MPI suite on NP ranks, output also in LOG; returns mpirun's status
  "${MPIRUN[@]}" -np "$1" "${PYTEST[@]}" -q tests/mpi 2>&1 | tee "$2"
  return "${PIPESTATUS[0]}"
}
MPI_LOG="$(mktemp)"
for np in 2 3; do
  echo "== MPI tests on $np ranks"
  # Every rank runs every test and prints its own summary line.
  if ! mpi_suite "$np" "$MPI_LOG"; then
    # A known intermittent crash (a few runs in a hundred): a process dies with SIGSEGV after Python has
    # finalised, once every rank has passed every test. Such a run is repeated once, and says so; a test
    # failure, or a crash at any other moment, fails at once.
    passed=$(grep -a -c -E "^[0-9]+ passed" "$MPI_LOG" || true)
    if [ "$passed" -eq "$np" ] && ! grep -a -q -E "[0-9]+ failed|[0-9]+ errors?\b" "$MPI_LOG" \
        && grep -a -q -E "process rank [0-9]+ .* exited on" "$MPI_LOG"; then
      echo "!! every rank passed, then a process crashed at exit (see docs/troubleshooting.md); running once more"
      mpi_suite "$np" "$MPI_LOG" || status=1
    else
      status=1
    fi
  fi
done
rm -f "$MPI_LOG"
echo "== the native core under AddressSanitizer + UndefinedBehaviorSanitizer (the engine's MPI tests)"
bash tools/sanitize.sh || status=1
echo "== the native core's own tests (kernels, MPI transport, loopback transport)"
bash native/tests/run_native_tests.sh || status=1
bash native/tests/run_loopback_tests.sh || status=1
echo "== the wheel, installed into a new environment outside the source tree"
bash tools/check_wheel.sh || status=1
echo "== the oldest versions setup.py admits for the base install (Python 3.10, numpy 1.21, ...)"
bash tools/check_lower_bounds.sh || status=1
echo "== perseus.mxnet (MXNet 1.9.1 in its own environment, .venv-mxnet)"
bash tools/run_mxnet_tests.sh || status=1
exit $status
