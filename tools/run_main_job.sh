#!/usr/bin/env bash
# Set everything up and run the main job: data-parallel training on 2 ranks (loss, accuracy, throughput).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="$(bash tools/setup_env.sh torch,examples)"
export PATH="$BIN:$PATH"
exec "$BIN/perseusrun" -np 2 "$BIN/python" examples/pytorch_digits.py "$@"
