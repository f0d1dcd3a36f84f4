# hpcdist: `make train` and `make test` each bootstrap .venv first (idempotent).
#
#   make venv        create/refresh .venv (reinstalls only when pyproject.toml changed)
#   make train       train the default task on 8 MPI ranks (NP=4 make train; ARGS="--steps 100")
#   make test        every test: unit tests, the MPI tests at 1, 2, 3, 4, 5 and 8 ranks, the
#                    fault matrix (test-faults), then the job templates on a real local SLURM
#                    (test-slurm; skips without root)
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
# (hpcdist/threads.py), so `make train` and `mpirun -n 8 python -m hpcdist.train` run alike.

.PHONY: venv train test test-unit test-mpi test-faults test-slurm soak slurm-up slurm-down bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@extras=test,bf16,bench; \
	if ! command -v mpiexec >/dev/null 2>&1; then \
	  echo "no system mpiexec found: installing the MPICH wheel into $(VENV)"; extras=$$extras,mpich; \
	fi; \
	$(BIN)/python -m pip install -q -e ".[$$extras]"
	@touch $@

# The main job: data-parallel training of the default task on NP ranks (8 share 2 cores
# fine here: one BLAS thread each, chosen by hpcdist/threads.py).
NP ?= 8
MPIEXEC = $$(test -x $(BIN)/mpiexec && echo $(BIN)/mpiexec || echo mpiexec)

train: venv
	$(MPIEXEC) -n $(NP) $(BIN)/python -m hpcdist.train $(ARGS)

# The MPI tests run at every world size below, each under a hard timeout; a failure on any
# rank aborts the whole job with that rank's traceback (tests/mpi/conftest.py).
MPI_SIZES ?= 1 2 3 4 5 8
MPI_TIMEOUT ?= 600

test: test-unit test-mpi test-faults test-slurm

test-unit: venv
	$(BIN)/python -m pytest -q tests --ignore=tests/mpi --ignore=tests/slurm --ignore=tests/faults

test-mpi: venv
	@for n in $(MPI_SIZES); do \
	  echo "== mpiexec -n $$n pytest --with-mpi tests/mpi"; \
	  timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(BIN)/python -m pytest --with-mpi -q \
	    -p no:cacheprovider tests/mpi || exit 1; \
	done

# The fault matrix: faults injected into real mpiexec jobs (stalls, kills, mismatches, full
# disks, damaged checkpoints, bad settings), each under a hard timeout; and a bounded soak.
FAULTS_TIMEOUT ?= 600

test-faults: venv
	timeout -k 10 $(FAULTS_TIMEOUT) $(BIN)/python -m pytest -q -p no:cacheprovider tests/faults

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
	rm -rf $(VENV) runs .pytest_cache *.egg-info
