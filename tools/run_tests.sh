#!/usr/bin/env bash
# The test command: set up every environment the tests need, then run them in stages.
#
#   bash tools/run_tests.sh          every test once, at the rank counts that matter (the quick mode)
#   bash tools/run_tests.sh --full   what CI runs (.ci/run): also the 3-rank repeat of the MPI suite, the tests
#                                    marked "full" (the soak runs, the rest of the fault and conversion
#                                    matrices), tensors above 2 GiB, and the sanitizer builds
#   options: --jobs N   pytest-xdist workers for the unit and integration tests (default: cores + 2, at most 8)
#
# Stages, in order (quick / --full where they differ):
#   unit and integration tests  in parallel (pytest-xdist); tests marked "full" only with --full
#   MPI tests on 2 ranks        tests/mpi under mpirun, every rank running every test
#   MPI tests on 3 ranks        the modules marked "rank_count" / all of tests/mpi
#   large tensors               - / above 2 GiB and 2^31 elements, every collective (2 ranks, ~10 GiB)
#   8 and 16 ranks              - / the collective and optimizer suites, oversubscribed
#   GPU paths without a GPU     host staging and the NCCL launcher on Gloo: 2 ranks / 2 and 3 ranks
#   sanitizers                  - / the native core under ASan+UBSan with the engine's MPI tests
#   native tests                kernels, codec, MPI transport
#   loopback tests              the plain build / ASan, TSan and plain builds
#   wheel check                 a wheel of this checkout installed in its own environment (tools/check_wheel.sh)
#   lower bounds                Python 3.10 and the oldest admitted dependencies (tools/check_lower_bounds.sh)
#   mxnet                       perseus.mxnet in .venv-mxnet: 2 ranks / 2 and 3 ranks
#   mpich                       perseus built against MPICH from PyPI, in .venv-mpich
#
# Every environment is made once per machine and reused while what it is made from is unchanged
# (tools/env_inputs.sh); the ones only the last stages need are made in the background while the unit and
# integration tests run. Every test has a timeout, and every stage a limit, for hangs only; a failing rank
# aborts its MPI job. Every stage says how many tests it skipped and why; under CI=true a skip that does not
# depend on the number of ranks fails (tests/conftest.py). The summary at the end lists each stage's time,
# the failures, and the slowest tests.
set -euo pipefail
# Everything runs inside main(): bash reads the whole function before running it, so editing this file while a
# run goes on cannot change what the run does.
main() {
  cd "$(dirname "$0")/.."
  FULL=0
  JOBS=$(($(nproc) + 2))  # the stage is mostly busy CPU, with some waiting: a few more workers than cores
  [ "$JOBS" -le 8 ] || JOBS=8
  while [ $# -gt 0 ]; do
    case "$1" in
      --full) FULL=1 ;;
      --jobs) JOBS="${2:?--jobs needs a number}"; shift ;;
      -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
      *) echo "run_tests.sh: unknown argument '$1' (--full, --jobs N, --help)" >&2; exit 2 ;;
    esac
    shift
  done
  STARTED=$SECONDS
  clock() { printf '%02d:%02d' $(((SECONDS - STARTED) / 60)) $(((SECONDS - STARTED) % 60)); }
  LOG_DIR="$(mktemp -d)"
  trap 'rm -rf "$LOG_DIR"' EXIT

  echo "== [$(clock)] setting up .venv$( [ $FULL = 1 ] && echo " (full run)")"
  # perseus.spark's tests run a local Spark, which needs a Java runtime (Debian's openjdk-17-jre-headless).
  JAVA_PID=""
  if ! command -v java > /dev/null && [ "$(id -u)" = "0" ] && command -v apt-get > /dev/null; then
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openjdk-17-jre-headless) \
      >"$LOG_DIR/java.log" 2>&1 &
    JAVA_PID=$!
  fi
  BIN="$(bash tools/setup_env.sh torch,tensorflow-cpu,test,ray,spark,lightning)"
  export PATH="$BIN:$PATH"
  # The ranks of a job share this machine's cores with the other jobs of the run: one compute thread each.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  # Hosts of the emulated cluster the tests share: 3 for each worker, so that no test waits for a lease.
  export PERSEUS_TEST_CLUSTER_HOSTS="${PERSEUS_TEST_CLUSTER_HOSTS:-$((3 * JOBS))}"
  if [ -n "$JAVA_PID" ] && ! wait "$JAVA_PID"; then
    tail -5 "$LOG_DIR/java.log"
    echo "could not install openjdk-17-jre-headless: the Spark tests will fail" >&2
  fi
  # The environments of the last stages, made while the tests run; each of those stages makes its own again (at
  # no cost once it is made), so a failure here shows in that stage, with its cause.
  (
    for step in "tools/setup_mxnet_env.sh" "tools/setup_mpich_env.sh" "tools/check_wheel.sh --prepare" \
                "tools/check_lower_bounds.sh --prepare"; do
      began=$SECONDS
      # shellcheck disable=SC2086 - the step's words
      if bash $step >/dev/null; then echo "$step: made in $((SECONDS - began)) s"; else echo "$step: FAILED"; fi
    done
  ) >"$LOG_DIR/prepare.log" 2>&1 &
  PREPARE_PID=$!
  prepared() {  # wait for the background set-up, once
    [ -n "$PREPARE_PID" ] || return 0
    wait "$PREPARE_PID" || true
    PREPARE_PID=""
    echo "   (the background set-up: $(grep -a -E ': (made|FAILED)' "$LOG_DIR/prepare.log" | paste -sd';' -))"
  }

  MPIRUN=("$BIN/mpirun" --oversubscribe --bind-to none)
  if [ "$(id -u)" = "0" ]; then MPIRUN+=(--allow-run-as-root); fi
  # -X faulthandler: a crash (even at interpreter exit) prints every thread's Python stack.
  # -rfEs: each failing test's name in a summary line ("FAILED tests/..."), collected again at the very end, and
  # each skipped test with its reason. --continue-on-collection-errors runs the other modules when one cannot load.
  PYTEST=("$BIN/python" -X faulthandler -m pytest -p no:cacheprovider --color=no -rfEs --continue-on-collection-errors)
  QUICK_ONLY=()
  [ $FULL = 1 ] || QUICK_ONLY=(-m "not full")
  STAGE_LIMIT=2400  # seconds: a stage still running after this is a hang
  status=0
  FAILED_STAGES=()
  TIMES=()
  SKIPS=()
  cpu_jiffies() {  # "busy total": the machine's CPU time so far (/proc/stat), to tell waiting stages from busy ones
    awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9; exit}' /proc/stat
  }
  stage() {  # stage NAME CMD...: run CMD (its output shown and kept); a failure is remembered by NAME
    local name="$1"; shift
    local log="$LOG_DIR/$(echo "$name" | tr -c 'A-Za-z0-9\n' '_').log" began=$SECONDS cpu0 cpu1 busy
    cpu0="$(cpu_jiffies)"
    echo "== [$(clock)] $name"
    # Open MPI session directories of killed mpirun processes (an earlier stage's fault tests kill some) would
    # make an mpirun that gets the same process id fail at start-up (perseus/runner/session_dirs.py).
    "$BIN/python" -m perseus.runner.session_dirs
    if ! timeout --kill-after=30 "$STAGE_LIMIT" "$@" 2>&1 | tee "$log"; then
      status=1
      FAILED_STAGES+=("$name")
    fi
    # What did not run: pytest's "N skipped" (summed over the ranks of an MPI job) and scripts' "NOT RUN:" lines.
    local skipped notrun
    skipped=$( (grep -a -o -E "[0-9]+ skipped" "$log" || true) | awk '{n += $1} END {print n + 0}')
    notrun=$(grep -a -c "NOT RUN:" "$log" || true)
    cpu1="$(cpu_jiffies)"
    busy=$(echo "$cpu0 $cpu1" | awk '{t = $4 - $2; print (t > 0 ? int(100 * ($3 - $1) / t + 0.5) : 0)}')
    echo "-- $name: $((SECONDS - began)) s (CPU $busy% busy), $skipped skipped, $notrun not run (reasons: the SKIPPED /" \
         "NOT RUN lines above)"
    TIMES+=("$(printf '%5d s  CPU %3d%% busy  %s' $((SECONDS - began)) "$busy" "$name")")
    SKIPS+=("$name: $skipped skipped, $notrun not run")
  }
  summary() {  # the last lines CI shows: each stage's time, what did not run, which stages failed and why
    echo "== [$(clock)] summary ($( [ $FULL = 1 ] && echo full || echo quick) run)"
    printf '%s\n' "${TIMES[@]}"
    printf '%s\n' "${SKIPS[@]}"
    grep -a -h -E "^SKIPPED |NOT RUN:" "$LOG_DIR"/*.log 2>/dev/null | sed -E 's/^\[rank [0-9]+\] //' | sort | uniq -c | sort -rn | head -40 || true
    if [ "$status" -eq 0 ]; then echo "every stage passed in $(clock)"; return; fi
    printf 'FAILED stage: %s\n' "${FAILED_STAGES[@]}"
    grep -a -h -E "^(\[rank [0-9]+\] )?(FAILED|ERROR) |Timeout|[1-9][0-9]* failed|exited on signal" "$LOG_DIR"/*.log 2>/dev/null \
      | sort | uniq -c | sort -rn | head -40 || true
  }

  # (The MXNet corpus scripts need .venv-mxnet: tools/run_mxnet_tests.sh runs those two cases, in that environment.)
  # The integration tests first: the long ones start early and the many short unit tests fill the workers at the end.
  stage "unit and integration tests" "${PYTEST[@]}" -q -n "$JOBS" --dist loadgroup --durations=15 "${QUICK_ONLY[@]}" \
    tests/integration tests/unit \
    --deselect "tests/integration/test_convert_corpus.py::test_converted_script_trains_on_two_ranks[mxnet_gluon.py]" \
    --deselect "tests/integration/test_convert_corpus.py::test_converted_script_trains_on_two_ranks[mxnet_gluon_best.py]"
  # Every rank runs every test and prints its own summary line. A process that dies on a signal, even after every
  # test passed, fails the stage: there is no second attempt.
  stage "MPI tests on 2 ranks" "${MPIRUN[@]}" -np 2 "${PYTEST[@]}" -q tests/mpi --ignore tests/mpi/test_large_tensors.py
  if [ $FULL = 1 ]; then
    stage "MPI tests on 3 ranks" "${MPIRUN[@]}" -np 3 "${PYTEST[@]}" -q tests/mpi --ignore tests/mpi/test_large_tensors.py
    stage "large tensors on 2 ranks (~10 GiB of memory)" "${MPIRUN[@]}" -np 2 "${PYTEST[@]}" -q tests/mpi/test_large_tensors.py
    # Past 3 ranks: the collective and optimizer suites on 8 and 16 ranks, oversubscribed (docs/scaling.md).
    for np in 8 16; do
      stage "collectives and optimizer on $np ranks (oversubscribed)" "${MPIRUN[@]}" -np $np "${PYTEST[@]}" -q \
        tests/mpi/test_collectives.py tests/mpi/test_optimizer.py
    done
  else
    stage "MPI tests on 3 ranks (the rank_count modules)" "${MPIRUN[@]}" -np 3 "${PYTEST[@]}" -q -m rank_count tests/mpi \
      --ignore tests/mpi/test_large_tensors.py
  fi
  # The GPU paths without a GPU: host staging (PERSEUS_STAGE_CPU_TENSORS=1) and the NCCL launcher on Gloo
  # (PERSEUS_DEVICE_BACKEND=gloo), each under the collective and optimizer MPI tests.
  DEVICE_TESTS=(tests/mpi/test_collectives.py tests/mpi/test_optimizer.py tests/mpi/test_sync_batch_norm.py
                tests/mpi/test_process_sets.py tests/mpi/test_errors.py tests/mpi/test_compression.py
                tests/mpi/test_join_timeline.py tests/mpi/test_dear.py)
  for np in 2 $( [ $FULL = 1 ] && echo 3 ); do
    stage "staged CPU tensors on $np ranks" env PERSEUS_STAGE_CPU_TENSORS=1 \
      "${MPIRUN[@]}" -np "$np" "${PYTEST[@]}" -q "${DEVICE_TESTS[@]}"
    # (wire_bytes counts perseus's own channels, which the launcher's all-reduces do not use)
    stage "launcher on Gloo on $np ranks" env PERSEUS_DEVICE_BACKEND=gloo \
      "${MPIRUN[@]}" -np "$np" "${PYTEST[@]}" -q "${DEVICE_TESTS[@]}" -k "not wire_bytes"
  done
  if [ $FULL = 1 ]; then
    stage "sanitizers (the engine's MPI tests under ASan+UBSan)" bash tools/sanitize.sh
  fi
  stage "native tests (kernels, codec, MPI transport)" bash native/tests/run_native_tests.sh $( [ $FULL = 1 ] || echo quick )
  stage "loopback tests" bash native/tests/run_loopback_tests.sh $( [ $FULL = 1 ] || echo plain )
  prepared
  stage "wheel check" bash tools/check_wheel.sh
  stage "lower bounds (Python 3.10, the oldest dependencies)" bash tools/check_lower_bounds.sh
  stage "mxnet" env RANKS="2 $( [ $FULL = 1 ] && echo 3 )" bash tools/run_mxnet_tests.sh
  stage "mpich" bash tools/run_mpich_tests.sh
  summary
  exit $status
}
main "$@"; exit $?
