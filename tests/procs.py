"""Helpers shared by the tests that run whole jobs (tests/faults, tests/cluster)."""
import subprocess
import time

import pytest


def finish(proc, limit=90):
    """Wait for ``proc``: (exit code, stdout, stderr, seconds waited); a job still running
    after ``limit`` seconds is killed and fails the test as hung."""
    t0 = time.time()
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"no exit within {limit} s (hung):\n{err[-3000:]}")
    return proc.returncode, out, err, time.time() - t0
