import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))


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
