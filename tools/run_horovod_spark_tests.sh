#!/usr/bin/env bash
# Run Horovod's Spark estimator test files against perseus (never commit Horovod's tests):
#
#   bash tools/run_horovod_spark_tests.sh /path/to/horovod-checkout [test_spark_torch.py test_spark_keras.py ...]
#
# Every Python process of the run (pytest, Spark's Python workers, the ranks they start) loads
# tools/horovod_test_spark_stubs.py through a sitecustomize module: the horovod alias, and stand-ins for the
# Horovod internals the files' helper module imports. Tests of Horovod's internal helpers (its remote module's
# private functions, its Petastorm and NVTabular readers) fail or skip; the counts and reasons go to
# docs/compatibility.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
HVD="${1:?usage: $0 /path/to/horovod-checkout [test files under test/integration]}"
shift
FILES=("${@:-test_spark_torch.py}")
BIN="$(bash tools/setup_env.sh torch,tensorflow-cpu,test,spark,lightning)"
SITE="$(mktemp -d "${TMPDIR:-/tmp}/perseus-spark-site.XXXXXX")"
trap 'rm -rf "$SITE"' EXIT
echo "import horovod_test_spark_stubs  # noqa: F401" > "$SITE/sitecustomize.py"
cd "$HVD/test/integration"
PATH="$BIN:$PATH" PYSPARK_PYTHON="$BIN/python" PYTHONPATH="$SITE:$ROOT/tools:$ROOT:$HVD/test/utils" \
  OMP_NUM_THREADS=1 timeout 3600 "$BIN/python" -m pytest -p no:cacheprovider --color=no -q -rs --timeout 600 \
  "${FILES[@]}"
