#!/usr/bin/env bash
# Run the MPI test suite N times in a row (default 50, 2 ranks) and count the runs in which a process ended on
# a signal, at exit or before. Core dumps are enabled (ulimit -c); where they go is the kernel's
# /proc/sys/kernel/core_pattern (e.g. echo '/tmp/cores/core.%p' > /proc/sys/kernel/core_pattern, then
# gdb .venv/bin/python /tmp/cores/core.PID). Exits 1 if any run failed or crashed. Not part of CI (about 30 s
# a run here). Usage: bash tools/exit_soak.sh [RUNS] [NP] [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-50}"
NP="${2:-2}"
OUT="${3:-$(mktemp -d "${TMPDIR:-/tmp}/perseus-exit-soak.XXXXXX")}"
mkdir -p "$OUT"
BIN="$(pwd)/.venv/bin"
MPIRUN=("$BIN/mpirun" --oversubscribe --bind-to none)
if [ "$(id -u)" = "0" ]; then MPIRUN+=(--allow-run-as-root); fi
ulimit -c unlimited 2>/dev/null || true
crashed=0
failed=0
for i in $(seq 1 "$RUNS"); do
  "$BIN/python" -m perseus.runner.session_dirs >/dev/null
  log="$OUT/run_$i.log"
  "${MPIRUN[@]}" -np "$NP" "$BIN/python" -X faulthandler -m pytest -p no:cacheprovider --color=no -q tests/mpi \
    --ignore tests/mpi/test_large_tensors.py >"$log" 2>&1
  code=$?
  passed=$(grep -a -c -E "^[0-9]+ passed" "$log" || true)
  if grep -a -q -E "exited on signal|signal [0-9]+ \(|Segmentation fault|Aborted" "$log"; then
    crashed=$((crashed + 1)); verdict="CRASHED"
  elif [ "$code" -ne 0 ] || [ "$passed" -ne "$NP" ]; then
    failed=$((failed + 1)); verdict="FAILED"
  else
    verdict="ok"
  fi
  echo "run $i/$RUNS: $verdict (mpirun status $code, $passed of $NP ranks passed) $log"
done
echo "exit soak: $RUNS runs at $NP ranks: $crashed crashed on a signal, $failed failed otherwise (logs in $OUT)"
[ "$crashed" -eq 0 ] && [ "$failed" -eq 0 ]
