import os
import sys
from pathlib import Path

# Pin BLAS/OpenMP threads for the whole test session, before NumPy (or torch, or SciPy) is imported:
# on a loaded machine, libraries that start one spinning thread per core can turn a one-second BLAS call
# into minutes (Opacus's noise search did). Set in os.environ, so every subprocess a test starts (Flower's
# SuperLink and app processes, Ray workers, `python -c` helpers) inherits the same limits.
# FLWR_INCA_TEST_THREADS overrides the count (default 1).
TEST_THREADS = os.environ.get("FLWR_INCA_TEST_THREADS", "1")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "BLIS_NUM_THREADS")
for _name in THREAD_VARIABLES:
    os.environ[_name] = TEST_THREADS

import numpy as np  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


# the deadline of tests that start Ray or Flower's simulation engine, unless they set their own: process
# starts dominate them, and they slow down most on a loaded machine (the default, for every other test, is
# pyproject.toml's `timeout`)
RAY_TEST_DEADLINE_S = 300


# the suite runs on two pytest-xdist workers (pyproject.toml: -n 2 --dist loadgroup); the tests that start
# Ray, Flower's engines or a deployment (several processes each) all go to one worker, one after another,
# as in a serial run, and the other worker takes the rest: two engines never compete for the two cores,
# and no test meets another's Ray cluster
ENGINE_GROUP = "engines"


# tryfirst: the marker must be on the item before pytest-xdist's worker turns xdist_group markers into the
# nodeid's "@group" suffix (its own pytest_collection_modifyitems), which is what groups tests;
# test_session_setup.py checks that the grouping holds
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        starts_ray = item.get_closest_marker("flower") is not None or "local_ray" in fixtures
        if starts_ray and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(RAY_TEST_DEADLINE_S))
        if starts_ray or "ray_cluster" in fixtures or item.get_closest_marker("deployment") is not None:
            item.add_marker(pytest.mark.xdist_group(ENGINE_GROUP))


@pytest.fixture(autouse=True, scope="session")
def _blas_threads_pinned():
    """The same limit through threadpoolctl, for thread pools already started (a library imported before
    this file), and torch's intra-op threads (torch reads OMP_NUM_THREADS only when it starts them)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=int(TEST_THREADS)):
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(TEST_THREADS))
        yield


@pytest.fixture(autouse=True)
def _pythonpath_restored():
    """Flower's simulation engine, run in this process, sets PYTHONPATH to this process's sys.path (for
    its Ray workers) and leaves it: later tests' subprocesses would import from there (the checkout
    instead of an installed wheel, say). Each test gets the session's PYTHONPATH back."""
    before = os.environ.get("PYTHONPATH")
    yield
    if before is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = before


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture(autouse=True, scope="session")
def _node_state_under_the_sessions_tmp(tmp_path_factory):
    """Node data of every run the tests start (in process, Flower's engine, Ray workers: they inherit the
    environment) goes under this session's temporary directory, never the user's default root; tests
    that need another root set it themselves and restore this one."""
    if "FLWR_INCA_STATE_DIR" in os.environ:
        yield
        return
    os.environ["FLWR_INCA_STATE_DIR"] = str(tmp_path_factory.mktemp("node-state"))
    try:
        yield
    finally:
        os.environ.pop("FLWR_INCA_STATE_DIR", None)


@pytest.fixture
def task_identity(monkeypatch):
    """Flower sets these in a running app; messages cannot be created without them."""
    flwr = pytest.importorskip("flwr.supercore.task_identity")
    for name, value in (("_run_id", 1), ("_node_id", 5), ("_task_id", 1)):
        monkeypatch.setattr(flwr.TaskIdentity, name, value)
