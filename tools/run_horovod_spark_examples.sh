#!/usr/bin/env bash
# Run Horovod's Spark estimator examples, unchanged, on perseus through the import alias, on a local[2] Spark
# (never commit Horovod's files). MNIST is replaced by a stand-in of the same format in --data-dir
# (tools/mnist_libsvm.py: scikit-learn's digits as LIBSVM's mnist.bz2), which the scripts read when present.
# Each script must end and print a test accuracy above 0.5 (chance is 0.1).
# With --cluster the scripts run on a Spark standalone cluster started here from pyspark's own jars (a master
# and one worker of 2 cores on 127.0.0.1, passed to each script as --master spark://...), so the ranks run in
# an executor of their own rather than in the driver's JVM.
#
#   bash tools/run_horovod_spark_examples.sh [--cluster] /path/to/horovod-checkout [script under examples/spark ...]
#
# Prints one PASS/FAIL line per script with its accuracy; exits 1 if any failed. Results go to docs/spark.md.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
CLUSTER=0
if [ "${1:-}" = "--cluster" ]; then CLUSTER=1; shift; fi
HVD="${1:?usage: $0 [--cluster] /path/to/horovod-checkout [scripts]}"
shift
SCRIPTS=("${@:-pytorch/pytorch_spark_mnist.py keras/keras_spark_mnist.py pytorch/pytorch_lightning_spark_mnist.py}")
read -r -a SCRIPTS <<<"${SCRIPTS[*]}"
BIN="$(bash tools/setup_env.sh torch,tensorflow-cpu,test,spark,lightning)" || exit 1
WORK="$(mktemp -d "${TMPDIR:-/tmp}/perseus-spark-examples.XXXXXX")"
SPARK_PIDS=()
stop_cluster() {
  local pid
  for pid in "${SPARK_PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
  sleep 2
  for pid in "${SPARK_PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
}
trap 'stop_cluster; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/site" "$WORK/data"
echo "import perseus.compat.horovod_alias  # noqa: F401 - horovod.* is perseus.*" >"$WORK/site/sitecustomize.py"
"$BIN/python" tools/mnist_libsvm.py "$WORK/data" >/dev/null || exit 1
export PYSPARK_PYTHON="$BIN/python" PYTHONPATH="$WORK/site:$ROOT" OMP_NUM_THREADS=1

free_port() { "$BIN/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_for() {  # log text what: until the log shows text (the daemon is ready), at most 180 s
  local i
  for i in $(seq 900); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.2
  done
  echo "the Spark $3 did not start within 180 s:" >&2
  tail -20 "$1" >&2
  return 1
}
MASTER_ARGS=()
if [ "$CLUSTER" = 1 ]; then
  SPARK_CLASS="$("$BIN/python" -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class"))')"
  export SPARK_HOME="$(dirname "$(dirname "$SPARK_CLASS")")" SPARK_LOCAL_IP=127.0.0.1 SPARK_WORKER_DIR="$WORK/spark"
  mkdir -p "$WORK/spark"
  port="$(free_port)"
  setsid "$SPARK_CLASS" org.apache.spark.deploy.master.Master --host 127.0.0.1 --port "$port" \
    --webui-port "$(free_port)" </dev/null >"$WORK/spark/master.log" 2>&1 &
  SPARK_PIDS+=("$!")
  wait_for "$WORK/spark/master.log" "New state: ALIVE" master || exit 1
  setsid "$SPARK_CLASS" org.apache.spark.deploy.worker.Worker --host 127.0.0.1 --cores 2 --memory 4g \
    --webui-port "$(free_port)" --work-dir "$WORK/spark" "spark://127.0.0.1:$port" </dev/null \
    >"$WORK/spark/worker.log" 2>&1 &
  SPARK_PIDS+=("$!")
  wait_for "$WORK/spark/worker.log" "Successfully registered with master" worker || exit 1
  MASTER_ARGS=(--master "spark://127.0.0.1:$port")
  echo "a standalone Spark cluster at spark://127.0.0.1:$port (one worker of 2 cores)"
fi
status=0
for script in "${SCRIPTS[@]}"; do
  log="$WORK/$(basename "$script").log"
  (cd "$WORK" && PATH="$BIN:$PATH" timeout 1800 "$BIN/python" "$HVD/examples/spark/$script" "${MASTER_ARGS[@]}" \
     --num-proc 2 --batch-size 32 \
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
