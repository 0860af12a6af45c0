#!/usr/bin/env bash
# Run every benchmark side by side on 2 ranks and print the figures that go into docs/benchmarks.md.
#
#   bash benchmarks/run_benchmarks.sh [HOROVOD_VENV [HOROVOD_TF_VENV]]
#
# Uses the project's .venv (tools/setup_env.sh). With HOROVOD_VENV (see tools/install_horovod_baseline.sh),
# Horovod 0.28.1 is measured too, in separate jobs (it cannot share a process with perseus). The TensorFlow
# section compares against Horovod from HOROVOD_TF_VENV (tools/install_horovod_tf_baseline.sh; default:
# HOROVOD_VENV) when horovod.tensorflow imports there, and measures perseus alone otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="$(bash tools/setup_env.sh torch,tensorflow-cpu,test)"
HVD="${1:-}"
HVD_TF="${2:-$HVD}"
OUT=benchmarks/results
mkdir -p "$OUT"
STAMP=$(date +%Y%m%d-%H%M%S)
J="$OUT/$STAMP.jsonl"
run() {  # run VENV_BIN ARGS...: a 2-rank job
  local bin="$1"; shift
  local m=("$bin/mpirun" --bind-to none -np 2)
  if [ "$(id -u)" = "0" ]; then m+=(--allow-run-as-root); fi
  "${m[@]}" "$bin/python" "$@"
}
echo "== gradient sets: perseus vs chunked MPI vs torch.distributed gloo"
run "$BIN" benchmarks/gradient_sets.py --only perseus,mpi,gloo --steps 10 --json "$J"
for ch in 2 4; do
  echo "== gradient sets with PERSEUS_NUM_CHANNELS=$ch"
  PERSEUS_NUM_CHANNELS=$ch run "$BIN" benchmarks/gradient_sets.py --only perseus,mpi --steps 10 --json "$J" \
    --tag "channels=$ch"
done
if [ -n "$HVD" ]; then
  echo "== gradient sets: Horovod 0.28.1 (alone, then with the chunked-MPI bound in the same job)"
  run "$HVD/bin" benchmarks/gradient_sets.py --only horovod,mpi --steps 10 --json "$J"
fi
echo "== small tensors: 1000 x 1 KB async, and a 1-float synchronous round trip"
run "$BIN" benchmarks/small_tensors.py --json "$J"
if [ -n "$HVD" ]; then
  run "$HVD/bin" benchmarks/small_tensors.py --only horovod,mpi --json "$J"
fi
echo "== synthetic ResNet-18 training throughput (examples/pytorch_synthetic_benchmark.py)"
"$BIN/python" examples/pytorch_synthetic_benchmark.py | grep -E "Model|Total"   # 1 rank, no communication
for round in 1 2 3 4 5; do  # alternating jobs: perseus, then Horovod
  run "$BIN" examples/pytorch_synthetic_benchmark.py | grep -E "Model|Total"
  if [ -n "$HVD" ]; then
    run "$HVD/bin" examples/pytorch_synthetic_benchmark.py --library horovod | grep -E "Model|Total"
  fi
done
echo "== TensorFlow 2 synthetic ResNet-18 training throughput (benchmarks/tensorflow2_synthetic_benchmark.py)"
TFB=(benchmarks/tensorflow2_synthetic_benchmark.py --num-iters 3 --num-batches-per-iter 4 --num-warmup-batches 2)
tf_libs=(perseus)
if [ -n "$HVD_TF" ] && "$HVD_TF/bin/python" -c "import horovod.tensorflow" 2>/dev/null; then
  tf_libs+=(horovod)
else
  echo "(no Horovod with TensorFlow: perseus only; see tools/install_horovod_tf_baseline.sh)"
fi
tf_run() {  # tf_run LIBRARY: one 2-rank job
  local bin="$BIN"; [ "$1" = horovod ] && bin="$HVD_TF/bin"
  run "$bin" "${TFB[@]}" --library "$1" --json "$J" | grep -E "Model|Total"
}
for round in 1 2 3 4 5; do  # 1 rank (no communication) for scale, then the libraries, order alternating
  "$BIN/python" "${TFB[@]}" --json "$J" | grep -E "Model|Total"
  order=("${tf_libs[@]}")
  if [ $((round % 2)) = 0 ] && [ ${#tf_libs[@]} = 2 ]; then order=(horovod perseus); fi
  for lib in "${order[@]}"; do tf_run "$lib"; done
done
"$BIN/python" "${TFB[0]}" --summarize "$J"
echo "== idle engine: compute loop slowdown (5 alternating trials per library)"
libs=(none perseus)
[ -n "$HVD" ] && libs+=(horovod)
for trial in 1 2 3 4 5; do
  for lib in "${libs[@]}"; do
    bin="$BIN"; [ "$lib" = horovod ] && bin="$HVD/bin"
    run "$bin" benchmarks/idle_overhead.py --lib "$lib" --json "$J"
  done
done
"$BIN/python" benchmarks/summarize.py "$J"
