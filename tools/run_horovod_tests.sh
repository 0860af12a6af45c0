#!/usr/bin/env bash
# Run Horovod's own test files against perseus through the import alias (never commit Horovod's tests).
#
#   bash tools/run_horovod_tests.sh /path/to/horovod-checkout [test_torch.py ...]
#   TF_USE_LEGACY_KERAS=1 bash tools/run_horovod_tests.sh /path/to/horovod-checkout test_tensorflow2_keras.py
#   NP=3 bash tools/run_horovod_tests.sh /path/to/horovod-checkout test_process_sets_multi_comm.py
#
# A checkout comes from `git clone https://github.com/horovod/horovod` (tests in test/parallel, helpers in
# test/utils). Without file names it runs every file of test/parallel for an API perseus mirrors (the
# DEFAULT_FILES below; test_xla*.py are out of scope: XLA's jit_compile raises NotImplementedError here).
# Each file runs under mpirun with $NP ranks (default 2); test_mxnet*.py files run from .venv-mxnet. With
# TF_USE_LEGACY_KERAS=1, tf-keras 2 is installed and used as tf.keras. Each file's pytest summary line is
# printed after its name; the counts go to docs/compatibility.md, and at 2 ranks the run ends by comparing them
# with that table (tools/check_horovod_counts.py): a file worse than recorded makes the script exit 1.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
HVD="${1:?usage: $0 /path/to/horovod-checkout [test files]}"
shift
FILES=("$@")
DEFAULT_FILES=(test_torch.py test_tensorflow.py test_tensorflow2_keras.py test_tensorflow_keras.py test_keras.py
               test_mxnet1.py test_mxnet2.py test_process_sets_static.py test_process_sets_multi_comm.py
               test_tensorflow_process_sets.py test_tensorflow_process_sets_dynamic.py
               test_tensorflow2_keras_process_sets.py test_timeline.py test_adasum_pytorch.py
               test_adasum_tensorflow.py test_common.py)
[ ${#FILES[@]} -gt 0 ] || FILES=("${DEFAULT_FILES[@]}")
NP="${NP:-2}"
MAIN_BIN="$(bash tools/setup_env.sh torch,tensorflow-cpu,test)"
"$MAIN_BIN/python" -m pip install -q mock parameterized
if [ "${TF_USE_LEGACY_KERAS:-0}" = "1" ]; then
  TF_MINOR="$("$MAIN_BIN/python" -c 'import tensorflow as tf; print(".".join(tf.__version__.split(".")[:2]))')"
  "$MAIN_BIN/python" -m pip install -q --no-deps "tf-keras==${TF_MINOR}.*"
fi
LOG="$(mktemp "${TMPDIR:-/tmp}/perseus-horovod-tests.XXXXXX")"
cd "$HVD/test/parallel"
for f in "${FILES[@]}"; do
  BIN="$MAIN_BIN"
  if [[ "$f" == test_mxnet* ]]; then
    BIN="$(cd "$ROOT" && bash tools/setup_mxnet_env.sh)"
    "$BIN/python" -m pip install -q mock parameterized
  fi
  MPIRUN=("$BIN/mpirun" --oversubscribe --bind-to none -np "$NP" -x PYTHONPATH -x TF_USE_LEGACY_KERAS
          -x PERSEUS_STALL_SHUTDOWN_TIME_SECONDS)
  if [ "$(id -u)" = "0" ]; then MPIRUN+=(--allow-run-as-root); fi
  echo "== $f"
  # A short stall shutdown: a test that leaves ranks diverged fails in 30 s instead of holding the file.
  TF_USE_LEGACY_KERAS="${TF_USE_LEGACY_KERAS:-0}" PERSEUS_STALL_SHUTDOWN_TIME_SECONDS=30 \
    PYTHONPATH="$HVD/test/utils:$ROOT" timeout 3600 "${MPIRUN[@]}" "$BIN/python" -m pytest \
    -p perseus.compat.horovod_alias -p no:cacheprovider --color=no -q -rs --timeout 120 "$f" 2>&1 | tee -a "$LOG" || true
done
# The counts against docs/compatibility.md's table: a file that passes fewer or fails more tests than recorded
# makes this script exit 1 (at NP=2, where the table's counts were taken).
if [ "$NP" = 2 ]; then
  KERAS=3; [ "${TF_USE_LEGACY_KERAS:-0}" = "1" ] && KERAS=tf-keras
  "$MAIN_BIN/python" "$ROOT/tools/check_horovod_counts.py" "$LOG" --keras "$KERAS"
fi
