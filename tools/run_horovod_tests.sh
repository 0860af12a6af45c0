#!/usr/bin/env bash
# Run Horovod's own test files against perseus through the import alias (never commit Horovod's tests).
#
#   bash tools/run_horovod_tests.sh /path/to/horovod-checkout [test_torch.py ...]
#
# A checkout comes from `git clone https://github.com/horovod/horovod` (tests in test/parallel, helpers in
# test/utils). Each file runs under mpirun with 2 ranks; results go to docs/compatibility.md by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
HVD="${1:?usage: $0 /path/to/horovod-checkout [test files]}"
shift
FILES=("$@")
[ ${#FILES[@]} -gt 0 ] || FILES=(test_torch.py)
BIN="$(bash tools/setup_env.sh)"
"$BIN/python" -m pip install -q mock
MPIRUN=("$BIN/mpirun" --oversubscribe --bind-to none -np 2)
if [ "$(id -u)" = "0" ]; then MPIRUN+=(--allow-run-as-root); fi
cd "$HVD/test/parallel"
for f in "${FILES[@]}"; do
  echo "== $f"
  PYTHONPATH="$HVD/test/utils:$ROOT" "${MPIRUN[@]}" -x PYTHONPATH "$BIN/python" -m pytest \
    -p perseus.compat.horovod_alias -p no:cacheprovider --color=no -q -rs --timeout 120 "$f" || true
done
