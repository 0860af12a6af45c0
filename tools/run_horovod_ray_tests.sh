#!/usr/bin/env bash
# Run Horovod's own Ray test files (test/single/test_ray.py by default) against perseus (never commit Horovod's
# tests):
#
#   bash tools/run_horovod_ray_tests.sh /path/to/horovod-checkout [test_ray.py test_ray_elastic.py ...]
#
# Every Python process of the run (pytest, Ray's workers, the ranks they start) loads
# tools/horovod_test_ray_stubs.py through a sitecustomize module: the horovod alias, and stand-ins for the two
# internal classes the file imports (its two Coordinator tests then fail). The counts go to docs/compatibility.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
HVD="${1:?usage: $0 /path/to/horovod-checkout [test files under test/single]}"
shift
FILES=("${@:-test_ray.py}")
BIN="$(bash tools/setup_env.sh torch,ray,test)"
SITE="$(mktemp -d "${TMPDIR:-/tmp}/perseus-ray-site.XXXXXX")"
trap 'rm -rf "$SITE"; "$BIN/ray" stop --force >/dev/null 2>&1 || true' EXIT
echo "import horovod_test_ray_stubs  # noqa: F401" > "$SITE/sitecustomize.py"
"$BIN/ray" stop --force >/dev/null 2>&1 || true  # a Ray left running would be joined instead of started
cd "$HVD/test/single"
PYTHONPATH="$SITE:$ROOT/tools:$ROOT:$HVD/test/utils" OMP_NUM_THREADS=1 timeout 1800 "$BIN/python" -m pytest \
  -p no:cacheprovider --color=no -q -rs --timeout 300 "${FILES[@]}"
