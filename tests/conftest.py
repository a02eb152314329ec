import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
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

# With PYTHONDONTWRITEBYTECODE set (as on machines that keep checkouts free of bytecode), every process the
# suite starts (the xdist workers, CLI and crash-test subprocesses, Ray workers, Flower's app processes)
# would compile flwr_inca's sources, the tests' helpers and the example app again. They are compiled once
# here instead, into the __pycache__ folders Python itself writes without that setting (git ignores them).
# Installed packages are left alone: pip compiled them.
if sys.flags.dont_write_bytecode:
    import compileall

    _ROOT = Path(__file__).resolve().parent.parent
    for _folder in (_ROOT / "flwr_inca", _ROOT / "tests", _ROOT / "examples"):
        if _folder.is_dir():
            compileall.compile_dir(_folder, quiet=2)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


# the deadline of tests that start Ray or Flower's simulation engine, unless they set their own: process
# starts dominate them, and they slow down most on a loaded machine (the default, for every other test, is
# pyproject.toml's `timeout`)
RAY_TEST_DEADLINE_S = 300


# the suite runs on two pytest-xdist workers (pyproject.toml: -n 2 --dist loadgroup); the tests that run
# Ray, Flower's engines or a deployment (several processes each) all go to one worker, one after another,
# as in a serial run, and the other worker takes the rest: two engines never compete for the two cores,
# and the session's one Ray cluster (``ray_cluster``) is started once and used by one test at a time
ENGINE_GROUP = "engines"


# tryfirst: the marker must be on the item before pytest-xdist's worker turns xdist_group markers into the
# nodeid's "@group" suffix (its own pytest_collection_modifyitems), which is what groups tests;
# test_session_setup.py checks that the grouping holds
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        starts_ray = item.get_closest_marker("flower") is not None or "ray_cluster" in fixtures
        if starts_ray and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(RAY_TEST_DEADLINE_S))
        if starts_ray or item.get_closest_marker("deployment") is not None:
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


# ------------------------------------------------------------------------------ one Ray cluster
def _free_port_block(size: int) -> int:
    """A base port with ``size`` free ports above it (checked by binding each)."""
    rng = np.random.default_rng()
    for _ in range(50):
        base = int(rng.integers(20_000, 60_000 - size))
        try:
            for p in range(base, base + size):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free block of ports")


def _wait_for_head(port: int, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    """Until the head's GCS accepts connections (the event), or ``ray start`` exits; ``timeout`` is only
    a generous deadline for a machine under load."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"the Ray head did not come up in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real Ray cluster, ``ray start --head --num-cpus 2`` as a separate process (non-default ports, its own
    temp dir), shared by every test that runs Ray: the simulator's Ray backend and Flower's simulation engine
    join it (``address``) instead of each starting and stopping a local Ray (about 10 s each on these
    machines, joining about 1 s); a run's actors and workers end when its driver disconnects. Yields
    ``("127.0.0.1:<port>", temp_dir)``. Stopped through its process group (all of its processes were
    started by it), also when a test fails. The tests that use it all run on one pytest-xdist worker
    (``ENGINE_GROUP``), so one session starts one cluster."""
    pytest.importorskip("ray")
    base = _free_port_block(80)
    temp = tempfile.mkdtemp(prefix="rw10-", dir="/tmp")  # short: Ray's socket paths have a length limit
    ports = ("--port", "--node-manager-port", "--object-manager-port", "--ray-client-server-port",
             "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
             "--metrics-export-port", "--dashboard-port")
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--num-cpus", "2",
           "--node-ip-address", "127.0.0.1", *[a for i, flag in enumerate(ports) for a in (flag, str(base + i))],
           "--min-worker-port", str(base + 20), "--max-worker-port", str(base + 79),
           "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp]
    log_path = Path(temp) / "ray-start.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_head(base, proc, log_path)
        yield f"127.0.0.1:{base}", temp
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the session ray start leads: only its processes
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
