#!/usr/bin/env bash
# Run Horovod's Spark estimator examples, unchanged, on perseus through the import alias, on a local[2] Spark
# (never commit Horovod's files). MNIST is replaced by a stand-in of the same format in --data-dir
# (tools/mnist_libsvm.py: scikit-learn's digits as LIBSVM's mnist.bz2), which the scripts read when present.
# Each script must end and print a test accuracy above 0.5 (chance is 0.1).
#
#   bash tools/run_horovod_spark_examples.sh /path/to/horovod-checkout [script under examples/spark ...]
#
# Prints one PASS/FAIL line per script with its accuracy; exits 1 if any failed. Results go to docs/spark.md.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
HVD="${1:?usage: $0 /path/to/horovod-checkout [scripts]}"
shift
SCRIPTS=("${@:-pytorch/pytorch_spark_mnist.py keras/keras_spark_mnist.py pytorch/pytorch_lightning_spark_mnist.py}")
read -r -a SCRIPTS <<<"${SCRIPTS[*]}"
BIN="$(bash tools/setup_env.sh torch,tensorflow-cpu,test,spark,lightning)" || exit 1
WORK="$(mktemp -d "${TMPDIR:-/tmp}/perseus-spark-examples.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/site" "$WORK/data"
echo "import perseus.compat.horovod_alias  # noqa: F401 - horovod.* is perseus.*" >"$WORK/site/sitecustomize.py"
"$BIN/python" tools/mnist_libsvm.py "$WORK/data" >/dev/null || exit 1
status=0
for script in "${SCRIPTS[@]}"; do
  log="$WORK/$(basename "$script").log"
  (cd "$WORK" && PATH="$BIN:$PATH" PYSPARK_PYTHON="$BIN/python" PYTHONPATH="$WORK/site:$ROOT" OMP_NUM_THREADS=1 \
     timeout 1800 "$BIN/python" "$HVD/examples/spark/$script" --num-proc 2 --batch-size 32 \
     --data-dir "$WORK/data" --work-dir "$WORK/work-$(basename "$script" .py)") >"$log" 2>&1
  code=$?
  accuracy="$(grep -o "Test accuracy: [0-9.]*" "$log" | tail -1 | awk '{print $3}')"
  if [ "$code" = 0 ] && [ -n "$accuracy" ] && awk "BEGIN {exit !($accuracy > 0.5)}"; then
    echo "PASS $script: test accuracy $accuracy"
  else
    echo "FAIL $script (exit $code, accuracy ${accuracy:-none})"
    grep -v "^\s*at \|^[0-9][0-9]/[0-9][0-9]/[0-9][0-9] " "$log" | tail -25
    status=1
  fi
done
exit "$status"
