#!/usr/bin/env bash
# perseus on MPICH from PyPI, in its own environment (.venv-mpich, made or reused by tools/setup_mpich_env.sh:
# MPICH and mpi4py first, then a wheel of perseus built against MPICH), from a directory without perseus
# sources: the collectives, error and process-set tests under MPICH's mpiexec on 2 ranks, then
# examples/pytorch_digits.py through perseusrun on 2 ranks.
# Every run is bounded by `timeout`. Exits non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
BIN="$(bash tools/setup_mpich_env.sh)"

RUN="$(mktemp -d "${TMPDIR:-/tmp}/perseus-mpich.XXXXXX")"
trap 'rm -rf "$RUN"' EXIT
cp tests/mpi/conftest.py tests/mpi/job_env.py tests/mpi/test_collectives.py tests/mpi/test_errors.py \
   tests/mpi/test_process_sets.py examples/pytorch_digits.py "$RUN/"
cp "$ROOT/pyproject.toml" "$RUN/"  # the tests' default timeout
cd "$RUN"
"$BIN/python" -c "import perseus, sys; assert perseus.__file__.startswith(sys.prefix), perseus.__file__"
status=0
echo "== collectives, errors and process sets under MPICH's mpiexec on 2 ranks"
timeout 900 "$BIN/mpiexec" -n 2 "$BIN/python" -X faulthandler -m pytest -q -p no:cacheprovider --color=no \
  test_collectives.py test_errors.py test_process_sets.py || status=1
echo "== examples/pytorch_digits.py through perseusrun (MPICH) on 2 ranks"
log="$(mktemp)"
if timeout 600 "$BIN/perseusrun" -np 2 "$BIN/python" pytorch_digits.py --epochs 3 >"$log" 2>&1; then
  cat "$log"
  grep -q "parameters identical on all 2 ranks: True" "$log" || { echo "ranks ended with different parameters"; status=1; }
else
  cat "$log"
  status=1
fi
exit $status
