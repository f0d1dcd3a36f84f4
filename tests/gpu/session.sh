#!/usr/bin/env bash
# One lease on a lent GPU machine, batched: `bash tests/gpu/session.sh [SECONDS]` runs every
# check of docs/gpu.md's table inside SECONDS (default 520) and leaves its logs in $OUT (or
# runs/gpu): the correctness checks side by side first (kernel self-checks, the GPU unit
# suite, the fp64 layout matrix at 2 ranks over MPI and 1 rank over NCCL, short training runs),
# then the timings alone on the GPU (bench gpu at batch 16 and 64, a profiled step, the step
# with the fused kernels off). Each step is cut at its own limit and at the deadline.
# The machine has CuPy and PyTorch but no MPI and no registry: wheels of mpich, mpi4py and
# pytest-mpi travel in .whl/ (ignored: echo /.whl/ >> .git/info/exclude), fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 -d .whl mpich mpi4py pytest-mpi
# and go beside the image's Python, which holds CuPy and torch.
set -u
budget=${1:-520}
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=2
PY=python3; [ -x /opt/torch/.venv/bin/python3 ] && PY=/opt/torch/.venv/bin/python3
if [ ! -d /tmp/site/mpi4py ]; then          # MPICH from its wheel's files (pip --target drops
  $PY -m zipfile -e .whl/mpich-*.whl /tmp/mpich && chmod +x /tmp/mpich/*.data/data/bin/* \
    && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
         --target /tmp/site .whl/mpi4py-*.whl .whl/pytest_mpi-*.whl || exit 1
fi                                          # its lib/), and mpi4py told to load it, not the
M=$(echo /tmp/mpich/*.data/data)            # image's Open MPI
mkdir -p /tmp/bin; printf '#!/bin/sh\nexec %s "$@"\n' "$PY" > /tmp/bin/python; chmod +x /tmp/bin/python
export PYTHONPATH=$PYTHONPATH:/tmp/site PATH=/tmp/bin:$M/bin:$PATH MPI4PY_LIBMPI=$M/lib/libmpi.so.12 \
       LD_LIBRARY_PATH=$M/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-100
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python -c "import cupy, numpy, torch, mpi4py.MPI as M; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__, 'gpus', cupy.cuda.runtime.getDeviceCount()); print(M.Get_library_version()[:50])"
nproc

left() { echo $((budget - SECONDS)); }
step() {  # step NAME SECONDS COMMAND: at most SECONDS and never past the deadline
  local name=$1 secs=$2; shift 2
  local l; l=$(left); [ "$secs" -gt "$l" ] && secs=$l
  if [ "$secs" -lt 10 ]; then echo "== $name: not run (deadline)"; return; fi
  local t0=$SECONDS
  echo "== $name (<= ${secs}s) started at ${t0}s" >> "$OUT/$name.log"
  timeout -k 5 "$secs" bash -c "$*" >> "$OUT/$name.log" 2>&1
  echo "== $name rc=$? in $((SECONDS - t0))s (at ${SECONDS}s)" | tee -a "$OUT/$name.log"
}
PYT="python -m pytest -v -p no:cacheprovider --tb=short"

# 1. correctness, side by side
step selfcheck 60 "python tests/gpu/selfcheck.py" &
step tests 120 "HPCDIST_DEVICE=gpu $PYT tests/test_gpu.py tests/test_ops_gradcheck.py tests/test_torch_oracle.py" &
step mpi2 120 "HPCDIST_DEVICE=gpu mpiexec -n 2 $PYT --with-mpi tests/mpi/test_device.py" &
step nccl1 120 "HPCDIST_DEVICE=gpu mpiexec -n 1 $PYT --with-mpi tests/mpi/test_nccl.py tests/mpi/test_device.py" &
step train 120 "python -m hpcdist.train --device gpu --steps 30 --log-every 10 --save-dir /tmp/r1 && mpiexec -n 1 python -m hpcdist.train --device gpu --backend nccl --precision bf16 --experts 4 --steps 30 --log-every 10 --save-dir /tmp/r2" &
wait
for f in selfcheck tests mpi2 nccl1 train; do echo "---- $f"; grep -a -E "passed|failed|error|Error|refus|REFUSED|FAILED|step +30|loss" "$OUT/$f.log" | tail -n 12; done

# 2. timings, alone on the GPU
step bench 110 "python -m hpcdist.bench gpu --batch 16 --steps 10"
step bench 110 "python -m hpcdist.bench gpu --batch 64 --steps 4"
step profile 30 "python tests/gpu/profile_step.py"
step bench 40 "HPCDIST_FUSED=0 python -m hpcdist.bench gpu --batch 16 --steps 10 --modes fp32 --no-torch"
grep -E "ms/step|rc=" "$OUT/bench.log"
