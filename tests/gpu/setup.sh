# The lent GPU machine made ready to run hpcdist over MPI, sourced by session.sh (and by a
# one-off probe: `source tests/gpu/setup.sh && python tests/gpu/cudnn_probe.py`): MPICH and
# mpi4py from the wheels in .whl/ beside the image's Python (CuPy, torch, cuDNN's library).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=2
PY=python3; [ -x /opt/torch/.venv/bin/python3 ] && PY=/opt/torch/.venv/bin/python3
if [ ! -d /tmp/site/mpi4py ]; then          # MPICH from its wheel's files (pip --target drops
  $PY -m zipfile -e .whl/mpich-*.whl /tmp/mpich && chmod +x /tmp/mpich/*.data/data/bin/* \
    && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
         --target /tmp/site .whl/mpi4py-*.whl .whl/pytest_mpi-*.whl \
         $(ls .whl/nvidia_cudnn_frontend-*.whl 2>/dev/null) || exit 1
fi                                          # its lib/), and mpi4py told to load it, not the
M=$(echo /tmp/mpich/*.data/data)            # image's Open MPI
mkdir -p /tmp/bin; printf '#!/bin/sh\nexec %s "$@"\n' "$PY" > /tmp/bin/python; chmod +x /tmp/bin/python
export PYTHONPATH=$PYTHONPATH:/tmp/site PATH=/tmp/bin:$M/bin:$PATH MPI4PY_LIBMPI=$M/lib/libmpi.so.12 \
       LD_LIBRARY_PATH=$M/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
