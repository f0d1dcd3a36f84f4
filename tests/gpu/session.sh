#!/usr/bin/env bash
# One lease on a lent GPU machine, batched: `bash tests/gpu/session.sh STEP...` runs the named
# steps in order, each under its own timeout, with its log in $OUT (or runs/gpu) as STEP.log.
# The machine has CuPy and PyTorch but no MPI and no registry: wheels of mpich, mpi4py and
# pytest-mpi travel in .whl/ (ignored: echo /.whl/ >> .git/info/exclude), fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl mpich mpi4py pytest-mpi
# and go into a venv that sees the system's site-packages. A step that fails does not stop
# the next one. Not run yet: no GPU was lent to the session that wrote it.
#   smoke    tests/test_gpu.py on the GPU
#   unit     the op gradchecks and the PyTorch oracles on the GPU
#   bench16  python -m hpcdist.bench gpu, GPT 12x768, T 256, batch 16 (JSON in bench16.json)
#   bench64  the same at batch 64
#   mpi      the layout matrix on the GPU at 2 ranks (host staging) and NCCL's suite at 1
#   profile  one GPT 12x768 batch-16 step under torch.profiler (kernel table)
set -u
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ ! -x /tmp/v/bin/python ]; then
  python3 -m venv --system-site-packages /tmp/v
  /tmp/v/bin/python -m pip install -q --no-index --no-deps .whl/*.whl || exit 1
fi
export PATH=/tmp/v/bin:$PATH
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/machine.txt" 2>&1
python -c "import cupy, mpi4py.MPI as M; print('cupy', cupy.__version__, 'gpus', cupy.cuda.runtime.getDeviceCount()); print(M.Get_library_version()[:60])" >> "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

step() {  # step NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  echo "== $name (<= ${secs}s): $*"
  local t0=$SECONDS
  timeout -k 5 "$secs" bash -c "$*" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc in $((SECONDS - t0))s"; tail -n 25 "$OUT/$name.log"
}

for s in "$@"; do case $s in
  smoke)   step smoke 120 "HPCDIST_DEVICE=gpu python -m pytest -x -q -p no:cacheprovider tests/test_gpu.py" ;;
  unit)    step unit 200 "HPCDIST_DEVICE=gpu python -m pytest -q -p no:cacheprovider tests/test_ops_gradcheck.py tests/test_torch_oracle.py" ;;
  bench16) step bench16 240 "python -m hpcdist.bench gpu --batch 16 --steps 10 --out $OUT/bench16.json" ;;
  bench64) step bench64 300 "python -m hpcdist.bench gpu --batch 64 --steps 5 --out $OUT/bench64.json" ;;
  mpi)     step mpi 240 "HPCDIST_DEVICE=gpu mpiexec -n 2 python -m pytest --with-mpi -q -p no:cacheprovider tests/mpi/test_device.py && HPCDIST_DEVICE=gpu mpiexec -n 1 python -m pytest --with-mpi -q -p no:cacheprovider tests/mpi/test_nccl.py tests/mpi/test_device.py" ;;
  profile) step profile 200 "python tests/gpu/profile_step.py" ;;
  *) echo "unknown step $s" ;;
esac; done
