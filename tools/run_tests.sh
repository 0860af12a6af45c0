#!/usr/bin/env bash
# Set everything up and run every test: unit and integration tests in one process, then the MPI suite
# under mpirun at 2 and 3 ranks and its large-tensor tests at 2 ranks, then the GPU paths' CPU stand-ins
# (staging, the launcher on Gloo), then the wheel as a user installs it (tools/check_wheel.sh), then the MXNet
# suite in its own environment (tools/run_mxnet_tests.sh), then perseus on MPICH (tools/run_mpich_tests.sh).
# Every test has a timeout; a failing rank aborts its MPI job. Every stage says how many tests it skipped and
# why; under CI=true a skip that does not depend on the number of ranks fails (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="$(bash tools/setup_env.sh torch,tensorflow-cpu,test,ray,spark)"
# perseus.spark's tests run a local Spark, which needs a Java runtime (Debian's openjdk-17-jre-headless).
if ! command -v java > /dev/null && [ "$(id -u)" = "0" ] && command -v apt-get > /dev/null; then
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openjdk-17-jre-headless) > /dev/null \
    || echo "could not install openjdk-17-jre-headless: the Spark tests will fail" >&2
fi
export PATH="$BIN:$PATH"
# tf-keras 2 (for the TF_USE_LEGACY_KERAS=1 tests) matching the installed TensorFlow; --no-deps because its
# metadata asks for the full "tensorflow" wheel while tensorflow-cpu provides the same module.
TF_MINOR="$("$BIN/python" -c 'import tensorflow as tf; print(".".join(tf.__version__.split(".")[:2]))' 2>/dev/null)"
"$BIN/python" -m pip install -q --no-deps "tf-keras==${TF_MINOR}.*" -c tools/constraints.txt
MPIRUN=("$BIN/mpirun" --oversubscribe --bind-to none)
if [ "$(id -u)" = "0" ]; then MPIRUN+=(--allow-run-as-root); fi
# -X faulthandler: a crash (even at interpreter exit) prints every thread's Python stack.
# -rfEs: each failing test's name in a summary line ("FAILED tests/..."), collected again at the very end, and
# each skipped test with its reason. Under CI=true a skip is a failure unless it only depends on the number
# of ranks (tests/conftest.py); --continue-on-collection-errors runs the other modules when one cannot load.
PYTEST=("$BIN/python" -X faulthandler -m pytest -p no:cacheprovider --color=no -rfEs --continue-on-collection-errors)
status=0
FAILED_STAGES=()
LOG_DIR="$(mktemp -d)"
trap 'rm -rf "$LOG_DIR"' EXIT
SKIPS=()
stage() {  # stage NAME CMD...: run CMD, its output also kept in a log; a failure is remembered by NAME
  local name="$1"; shift
  local log="$LOG_DIR/$(echo "$name" | tr -c 'A-Za-z0-9\n' '_').log"
  # Open MPI session directories of killed mpirun processes (an earlier stage's fault tests kill some) would
  # make an mpirun that gets the same process id fail at start-up (perseus/runner/session_dirs.py).
  "$BIN/python" -m perseus.runner.session_dirs
  if ! "$@" 2>&1 | tee "$log"; then
    status=1
    FAILED_STAGES+=("$name")
  fi
  # What did not run: pytest's "N skipped" (summed over the ranks of an MPI job) and scripts' "NOT RUN:" lines.
  local skipped notrun
  skipped=$( (grep -a -o -E "[0-9]+ skipped" "$log" || true) | awk '{n += $1} END {print n + 0}')
  notrun=$(grep -a -c "NOT RUN:" "$log" || true)
  echo "-- $name: $skipped skipped, $notrun not run (reasons: the SKIPPED / NOT RUN lines above)"
  SKIPS+=("$name: $skipped skipped, $notrun not run")
}
summary() {  # the last lines CI shows: which stages failed, and the failing tests' names
  echo "== summary"
  printf '%s\n' "${SKIPS[@]}"
  grep -a -h -E "^SKIPPED |NOT RUN:" "$LOG_DIR"/*.log 2>/dev/null | sed -E 's/^\[rank [0-9]+\] //' | sort | uniq -c | sort -rn | head -40 || true
  if [ "$status" -eq 0 ]; then echo "every stage passed"; return; fi
  printf 'FAILED stage: %s\n' "${FAILED_STAGES[@]}"
  grep -a -h -E "^(\[rank [0-9]+\] )?(FAILED|ERROR) |Timeout|[1-9][0-9]* failed|exited on signal" "$LOG_DIR"/*.log 2>/dev/null \
    | sort | uniq -c | sort -rn | head -40 || true
}
echo "== unit and integration tests (no mpirun)"
# (The MXNet corpus scripts need .venv-mxnet: tools/run_mxnet_tests.sh runs those two cases, in that environment.)
stage "unit and integration tests" "${PYTEST[@]}" -q --durations=15 tests/unit tests/integration \
  --deselect "tests/integration/test_convert_corpus.py::test_converted_script_trains_on_two_ranks[mxnet_gluon.py]" \
  --deselect "tests/integration/test_convert_corpus.py::test_converted_script_trains_on_two_ranks[mxnet_gluon_best.py]"
for np in 2 3; do
  echo "== MPI tests on $np ranks"
  # Every rank runs every test and prints its own summary line. A process that dies on a signal, even after
  # every test passed, fails the stage: there is no second attempt.
  stage "MPI tests on $np ranks" "${MPIRUN[@]}" -np "$np" "${PYTEST[@]}" -q tests/mpi \
    --ignore tests/mpi/test_large_tensors.py
done
echo "== tensors above 2 GiB and above 2^31 elements, every collective (2 ranks; ~10 GiB of memory)"
stage "large tensors on 2 ranks" "${MPIRUN[@]}" -np 2 "${PYTEST[@]}" -q tests/mpi/test_large_tensors.py
echo "== the GPU paths without a GPU: host staging (PERSEUS_STAGE_CPU_TENSORS=1) and the NCCL launcher on Gloo"
echo "   (PERSEUS_DEVICE_BACKEND=gloo), each under the collective and optimizer MPI tests on 2 and 3 ranks"
DEVICE_TESTS=(tests/mpi/test_collectives.py tests/mpi/test_optimizer.py tests/mpi/test_sync_batch_norm.py
              tests/mpi/test_process_sets.py tests/mpi/test_errors.py tests/mpi/test_compression.py
              tests/mpi/test_join_timeline.py)
for np in 2 3; do
  stage "staged CPU tensors on $np ranks" env PERSEUS_STAGE_CPU_TENSORS=1 \
    "${MPIRUN[@]}" -np "$np" "${PYTEST[@]}" -q "${DEVICE_TESTS[@]}"
  # (wire_bytes counts perseus's own channels, which the launcher's all-reduces do not use)
  stage "launcher on Gloo on $np ranks" env PERSEUS_DEVICE_BACKEND=gloo \
    "${MPIRUN[@]}" -np "$np" "${PYTEST[@]}" -q "${DEVICE_TESTS[@]}" -k "not wire_bytes"
done
echo "== the native core under AddressSanitizer + UndefinedBehaviorSanitizer (the engine's MPI tests)"
stage "sanitizers" bash tools/sanitize.sh
echo "== the native core's own tests (kernels, MPI transport, loopback transport)"
stage "native tests" bash native/tests/run_native_tests.sh
stage "loopback tests" bash native/tests/run_loopback_tests.sh
echo "== the wheel, installed into a new environment outside the source tree"
stage "wheel check" bash tools/check_wheel.sh
echo "== the oldest versions setup.py admits for the base install (Python 3.10, numpy 1.21, ...)"
stage "lower bounds" bash tools/check_lower_bounds.sh
echo "== perseus.mxnet (MXNet 1.9.1 in its own environment, .venv-mxnet)"
stage "mxnet" bash tools/run_mxnet_tests.sh
echo "== perseus on MPICH from PyPI (its own environment, .venv-mpich): mpiexec and perseusrun"
stage "mpich" bash tools/run_mpich_tests.sh
summary
exit $status
