"""The test session's own setup (tests/conftest.py): BLAS/OpenMP threads pinned, in this process and in
every process a test starts; every test has a deadline."""

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import TEST_THREADS, THREAD_VARIABLES


def test_blas_and_openmp_threads_are_pinned_here_and_in_subprocesses():
    from threadpoolctl import threadpool_info

    pools = threadpool_info()
    assert pools, "NumPy's BLAS should be loaded"
    assert {p["internal_api"]: p["num_threads"] for p in pools} == {p["internal_api"]: int(TEST_THREADS)
                                                                     for p in pools}
    code = ("import os, numpy, threadpoolctl; print(sorted({p['num_threads'] for p in "
            "threadpoolctl.threadpool_info()}), [os.environ.get(v) for v in %r])" % (THREAD_VARIABLES,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == f"[{int(TEST_THREADS)}] {[TEST_THREADS] * len(THREAD_VARIABLES)}"
    assert np.ones((64, 64)) @ np.ones(64) is not None


def test_every_test_has_a_deadline(request):
    marker = request.node.get_closest_marker("timeout")
    deadline = marker.args[0] if marker else request.config.getini("timeout")
    assert deadline and float(deadline) > 0
    assert request.config.getini("timeout_method") == "signal"  # fixtures' cleanup still runs
    assert os.environ["OMP_NUM_THREADS"] == TEST_THREADS
