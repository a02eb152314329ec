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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == f"[{int(TEST_THREADS)}] {[TEST_THREADS] * len(THREAD_VARIABLES)}"
    assert np.ones((64, 64)) @ np.ones(64) is not None


def test_every_test_has_a_deadline(request):
    marker = request.node.get_closest_marker("timeout")
    deadline = marker.args[0] if marker else request.config.getini("timeout")
    assert deadline and float(deadline) > 0
    assert request.config.getini("timeout_method") == "signal"  # fixtures' cleanup still runs
    assert os.environ["OMP_NUM_THREADS"] == TEST_THREADS


def test_a_hang_fails_with_its_stack_and_the_fixtures_clean_up(tmp_path):
    """With the project's settings, a test past its deadline fails (not the session), its stack is shown,
    and its fixtures' cleanup runs (what stops SuperLinks and Ray clusters)."""
    (tmp_path / "test_hang.py").write_text(
        "import threading, pytest\n"
        "@pytest.fixture\n"
        "def resource(tmp_path_factory):\n"
        "    yield\n"
        f"    open({str(tmp_path / 'cleaned')!r}, 'w').close()\n"
        "@pytest.mark.timeout(1)\n"
        "def test_hangs(resource):\n"
        "    threading.Event().wait()  # a wait that never ends\n"
        "def test_after():\n"
        "    pass\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "pytest", "-c", os.path.join(root, "pyproject.toml"),
                          "--rootdir", str(tmp_path), "-p", "no:cacheprovider",
                          str(tmp_path / "test_hang.py")],
                         capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-3000:]
    assert "Timeout (>1.0s)" in out.stdout and "threading.Event().wait()" in out.stdout, out.stdout[-3000:]
    assert "1 failed, 1 passed" in out.stdout and (tmp_path / "cleaned").exists()


@pytest.mark.flower
def test_tests_that_start_ray_get_the_longer_deadline(request):
    from conftest import ENGINE_GROUP, RAY_TEST_DEADLINE_S

    assert request.node.get_closest_marker("timeout").args[0] == RAY_TEST_DEADLINE_S
    # and run on the engines' worker, one after another (never two Ray clusters competing for the cores)
    assert request.node.get_closest_marker("xdist_group").args[0] == ENGINE_GROUP


def test_the_engine_tests_are_grouped_on_one_worker(request):
    """Under pytest-xdist's loadgroup (the default run) the group is the nodeid's "@group" suffix that xdist
    writes from the marker: a marker it did not turn into a suffix (added too late, or a pytest whose
    nodeids xdist cannot rewrite) leaves the engine tests spread over both workers, two engines at once."""
    from conftest import ENGINE_GROUP

    if not getattr(request.config.option, "loadgroup", False):  # set on xdist's workers
        pytest.skip("not run by pytest-xdist's loadgroup (-n 2 --dist loadgroup, the default)")
    grouped = [item for item in request.session.items if item.get_closest_marker("xdist_group")]
    if not grouped:
        pytest.skip("no engine test is selected")
    ungrouped = [item.nodeid for item in grouped if not item.nodeid.endswith(f"@{ENGINE_GROUP}")]
    assert not ungrouped, f"{len(ungrouped)} engine tests are not grouped, e.g. {ungrouped[0]}"
