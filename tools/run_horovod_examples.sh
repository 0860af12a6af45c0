#!/usr/bin/env bash
# Run Horovod's own TensorFlow 2 / Keras example scripts, unchanged, on perseus through the import alias
# (never commit Horovod's files). Each script runs on 2 ranks under mpirun, with Keras 3 (TensorFlow's
# default) and with tf-keras 2 (TF_USE_LEGACY_KERAS=1), with and without --fp16-allreduce. The scripts'
# own options shrink the work (a small model, small batches, few iterations) so that a 2-core machine
# finishes in minutes; the code paths are the scripts' own.
#
#   bash tools/run_horovod_examples.sh /path/to/horovod-checkout
#
# A checkout comes from `git clone https://github.com/horovod/horovod` (the scripts are in examples/;
# Horovod's PyPI sdist does not ship them). Prints one PASS/FAIL line per run and exits 1 if any failed;
# results go to docs/compatibility.md. Only examples that need no download are run by default: the MNIST
# examples fetch their data set from the internet. With MNIST=1 they run too, unchanged, on a local stand-in
# for the data set (tools/mnist_stand_in.py: scikit-learn's digits scaled to 28x28); they train for their
# full 24 epochs, about 12 minutes each here.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
HVD="${1:?usage: $0 /path/to/horovod-checkout}"
BIN="$(bash tools/setup_env.sh torch,tensorflow-cpu,test)" || exit 1
TF_MINOR="$("$BIN/python" -c 'import tensorflow as tf; print(".".join(tf.__version__.split(".")[:2]))')"
"$BIN/python" -m pip install -q --no-deps "tf-keras==${TF_MINOR}.*" || exit 1
MPIRUN=("$BIN/mpirun" --oversubscribe --bind-to none -np 2 -x TF_USE_LEGACY_KERAS -x PYTHONPATH
        -x PERSEUS_STALL_SHUTDOWN_TIME_SECONDS -x TF_CPP_MIN_LOG_LEVEL)
if [ "$(id -u)" = "0" ]; then MPIRUN+=(--allow-run-as-root); fi
SMALL=(--model MobileNetV2 --batch-size 4 --num-batches-per-iter 2 --num-iters 3)
WARM=(--num-warmup-batches 2)
# script (relative to examples/) | its arguments
RUNS=(
  "tensorflow2/tensorflow2_synthetic_benchmark.py|${SMALL[*]} ${WARM[*]}"
  "tensorflow2/tensorflow2_synthetic_benchmark.py|${SMALL[*]} ${WARM[*]} --fp16-allreduce"
  "tensorflow2/tensorflow2_keras_synthetic_benchmark.py|${SMALL[*]}"
  "tensorflow2/tensorflow2_keras_synthetic_benchmark.py|${SMALL[*]} --fp16-allreduce"
  "elastic/tensorflow2/tensorflow2_synthetic_benchmark_elastic.py|${SMALL[*]} ${WARM[*]}"
  "elastic/tensorflow2/tensorflow2_synthetic_benchmark_elastic.py|${SMALL[*]} ${WARM[*]} --fp16-allreduce"
)
if [ "${MNIST:-0}" = "1" ]; then
  RUNS+=("tensorflow2/tensorflow2_mnist.py|" "tensorflow2/tensorflow2_keras_mnist.py|"
         "elastic/tensorflow2/tensorflow2_mnist_elastic.py|" "elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py|")
fi
LOGS="$(mktemp -d)"
failed=0
for keras in 0 1; do
  for run in "${RUNS[@]}"; do
    script="${run%%|*}"
    read -r -a args <<< "${run#*|}"
    log="$LOGS/$(basename "$script" .py).keras$keras.$RANDOM.log"
    runner=(-m perseus.compat.horovod_alias)
    [[ "$script" == *mnist* ]] && runner=("$ROOT/tools/mnist_stand_in.py")
    start=$(date +%s)
    # A short stall shutdown: a diverged run fails in 60 s instead of hanging.
    (cd "$HVD/examples/$(dirname "$script")" && TF_USE_LEGACY_KERAS=$keras PYTHONPATH="$ROOT" \
      PERSEUS_STALL_SHUTDOWN_TIME_SECONDS=60 TF_CPP_MIN_LOG_LEVEL=2 timeout 900 "${MPIRUN[@]}" \
      "$BIN/python" "${runner[@]}" "$(basename "$script")" "${args[@]}") > "$log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    what="$script ${args[*]} (keras $([ $keras = 1 ] && echo 'tf-keras 2' || echo 3))"
    if [ $rc -eq 0 ]; then
      echo "PASS ${took}s $what: $(grep -a -E 'Total img/sec|Img/sec per|accuracy|Step #' "$log" | tail -1 | tail -c 160)"
    else
      echo "FAIL ${took}s $what (exit $rc; log $log):"
      grep -a -v -E 'Warning|WARNING|oneDNN|cpu_feature_guard|rebuild TensorFlow' "$log" | tail -15 | sed 's/^/    /'
      failed=1
    fi
  done
done
exit $failed
