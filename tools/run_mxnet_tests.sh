#!/usr/bin/env bash
# Set up .venv-mxnet (MXNet 1.9.1, NumPy < 1.24) and run the perseus.mxnet tests under mpirun at 2 and 3
# ranks ($RANKS, default "2 3"), then the Gluon digits example on 2 ranks, then the perseus-convert MXNet rules
# and the MXNet corpus script. Every test has a timeout; a failing rank aborts its MPI job; every mpirun is bounded by `timeout`.
# Exits non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="$(bash tools/setup_mxnet_env.sh)"
export PATH="$BIN:$PATH"
# One OpenMP thread per rank: the ranks share the machine's cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
MPIRUN=(timeout 600 "$BIN/mpirun" --oversubscribe --bind-to none -x OMP_NUM_THREADS)
if [ "$(id -u)" = "0" ]; then MPIRUN+=(--allow-run-as-root); fi
# -X faulthandler: a crash (even at interpreter exit) prints every thread's Python stack.
PYTEST=("$BIN/python" -X faulthandler -m pytest -p no:cacheprovider --color=no)
status=0
for np in ${RANKS:-2 3}; do
  echo "== perseus.mxnet tests on $np ranks"
  # Every rank runs every test and prints its own summary line.
  "${MPIRUN[@]}" -np "$np" "${PYTEST[@]}" -q tests/mpi_mxnet || status=1
done
echo "== examples/mxnet_gluon_digits.py on 2 ranks"
log="$(mktemp)"
if "${MPIRUN[@]}" -np 2 "$BIN/python" examples/mxnet_gluon_digits.py --epochs 6 >"$log" 2>&1; then
  cat "$log"
  # It must learn (final accuracy above 0.8, loss down by half) and end with identical parameters.
  "$BIN/python" - "$log" <<'EOF' || status=1
import re, sys
out = open(sys.argv[1]).read()
losses = [float(x) for x in re.findall(r"train loss ([0-9.]+)", out)]
accuracy = [float(x) for x in re.findall(r"test accuracy ([0-9.]+)", out)]
ok = (len(losses) == 6 and losses[-1] < 0.5 * losses[0] and accuracy[-1] > 0.8
      and "parameters identical on all 2 ranks: True" in out)
print("example: 1 passed, 0 failed" if ok else "example: 0 passed, 1 failed")
sys.exit(0 if ok else 1)
EOF
else
  cat "$log"
  echo "example: 0 passed, 1 failed"
  status=1
fi
rm -f "$log"
echo "== perseus-convert: the MXNet Gluon corpus scripts, converted and run on 2 ranks"
# The converter (libcst) runs in .venv-mxnet too; the test compares 2 ranks with the unconverted script run
# alone on the global batch, and needs identical parameters on both ranks.
timeout 300 "${PYTEST[@]}" -q tests/unit/test_convert_mxnet_rules.py \
  "tests/integration/test_convert_corpus.py::test_converted_script_trains_on_two_ranks[mxnet_gluon.py]" \
  "tests/integration/test_convert_corpus.py::test_converted_script_trains_on_two_ranks[mxnet_gluon_best.py]" \
  || status=1
exit $status
