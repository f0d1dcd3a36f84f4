"""Run under mpiexec: ``mpiexec -n N python -m pytest --with-mpi tests/mpi`` (make test does).

Only rank 0 reports. A failure on any rank prints that rank's traceback to stderr and aborts
the whole job, so a rank that fails can never leave the others waiting in a collective.
"""
import os
import sys
import tempfile

import pytest
from mpi4py import MPI

WORLD = MPI.COMM_WORLD

# Each rank's temporary folders under a root of its own (PYTEST_DEBUG_TEMPROOT, read at the
# first tmp_path). By default the job's N pytest processes share /tmp/pytest-of-USER: each
# prunes the others' numbered folders and moves one `pytest-current` link, and a rank's
# cleanup at exit once met the link another had just removed (FileNotFoundError: the job
# aborted after every test had passed; make test, 2026-11-26).
if WORLD.Get_size() > 1 and "PYTEST_DEBUG_TEMPROOT" not in os.environ:
    _root = os.path.join(tempfile.gettempdir(), f"pytest-mpi-rank{WORLD.Get_rank()}")
    os.makedirs(_root, exist_ok=True)
    os.environ["PYTEST_DEBUG_TEMPROOT"] = _root


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if WORLD.Get_rank() != 0:             # one report per run, from rank 0
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and WORLD.Get_size() > 1:
        sys.__stderr__.write(f"\n[rank {WORLD.Get_rank()} of {WORLD.Get_size()}] "
                             f"{item.nodeid} failed:\n{report.longreprtext}\n")
        sys.__stderr__.flush()
        WORLD.Abort(1)


@pytest.fixture(scope="session")
def comm():
    from hpcdist.comm import Communicator
    return Communicator()


@pytest.fixture
def shared_dir(comm, tmp_path):
    """A folder every rank sees (rank 0's tmp_path)."""
    return comm.mpi.bcast(str(tmp_path), root=0)
