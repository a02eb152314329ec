"""A user's own Flower app, run as the README's "Use IncA in your Flower project" section says, the way a
user runs it: the app's files are the section's (``# <path>`` on their first line), the command is the
section's ``flwr run`` line, run by ``bash`` in the app's folder with a fresh shell's environment (its own
HOME, so its own ~/.flwr; the virtual environment's bin first on PATH, as after ``activate``). ``flwr run``
then starts Flower's local SuperLink in the background, as on a user's machine; it listens on a free port
(``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``, not the default one another session may use) and is stopped by its
process group id afterwards, found by the HOME it was started with.

Also what the section says of Flower's own dependency installation: when it fails, ``flwr run`` still
exits with status 0, and the run's status says ``finished:failed`` (the section's status check exits 1);
the variable is read only by a new local SuperLink, and the section's command stops the running one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

pytestmark = [pytest.mark.deployment, pytest.mark.flower, pytest.mark.timeout(300)]

README = Path(__file__).parent.parent / "README.md"
BIN = Path(sys.executable).parent
VARIABLE = "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 "


def _section() -> str:
    text = README.read_text()
    start = text.index("## Use IncA in your Flower project")
    return text[start:text.index("\n## ", start + 1)]


def _app_files(section: str) -> dict[str, str]:
    """The section's code blocks that name a file on their first line (``# my_app/server_app.py``)."""
    files = {}
    for block in re.findall(r"```(?:toml|python)\n(.*?)```", section, flags=re.DOTALL):
        first, _, rest = block.partition("\n")
        name = first.removeprefix("# ").strip()
        if first.startswith("# ") and name.endswith((".toml", ".py")) and " " not in name:
            files[name] = block
    return files


def _bash_lines(section: str) -> list[str]:
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL):
        lines += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _superlinks_of(home: Path) -> list[int]:
    """Process ids of the ``flower-superlink`` processes started with this HOME (their log file is in it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(b"flower-superlink" in part for part in cmdline) and any(str(home).encode() in part
                                                                           for part in cmdline):
                pids.append(int(entry.name))
    return pids


def _stop(pid: int, deadline_s: float = 60.0) -> None:
    """Stop a process that `flwr run` started in its own session (group id = its pid), and its group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:  # not our child: wait for it to be gone
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


@pytest.fixture
def user(tmp_path):
    """A user's folder with the section's app, and a fresh shell's environment; afterwards the local
    SuperLink that ``flwr run`` started is stopped."""
    if shutil.which("flower-superlink", path=str(BIN)) is None:
        pytest.skip("flower-superlink is not installed in this environment")
    files = _app_files(_section())
    assert {"pyproject.toml", "my_app/server_app.py", "my_app/client_app.py"} <= set(files), sorted(files)
    app, home = tmp_path / "my-app", tmp_path / "home"
    home.mkdir()
    for name, content in files.items():
        (app / name).parent.mkdir(parents=True, exist_ok=True)
        (app / name).write_text(content)
    keep = ("LANG", "LC_ALL", "TMPDIR", "FLWR_INCA_STATE_DIR", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
            "MKL_NUM_THREADS")  # the session's node-state root and pinned threads
    env = {name: os.environ[name] for name in keep if name in os.environ}
    env.update({"HOME": str(home), "PATH": f"{BIN}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
                "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
                "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()), "FLWR_TELEMETRY_ENABLED": "0"})
    try:
        yield app, env
    finally:
        for pid in _superlinks_of(home):
            _stop(pid)


def _shell(command: str, app: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=app, env=env, capture_output=True, text=True,
                          timeout=280, check=False)


def _run_id(done: subprocess.CompletedProcess) -> str:
    match = re.search(r"Successfully started run (\d+)", done.stdout + done.stderr)
    assert match, f"flwr run did not start a run:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return match.group(1)


def _status_check(run_id: str, app: Path, env: dict) -> tuple[int, dict]:
    """The section's script check of a run's outcome (its exit status), and the run's row of `flwr ls`."""
    (check,) = [line for line in _bash_lines(_section()) if line.startswith("flwr ls --run-id")]
    status = _shell(check.split("#")[0].replace('"$RUN_ID"', run_id), app, env).returncode
    listed = _shell(f"flwr ls --run-id {run_id} --format json", app, env)
    (row,) = json.loads(listed.stdout[listed.stdout.index("{"):])["runs"]
    return status, row


def test_the_readme_app_runs_with_flwr_run_in_a_fresh_shell(user):
    app, env = user
    (command,) = [line for line in _bash_lines(_section()) if line.startswith(VARIABLE + "flwr run .")]
    done = _shell(command, app, env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    run_id = _run_id(done)
    assert "Starting local SuperLink" in out  # a fresh shell: flwr run started it, with the variable
    assert re.search(r"Federation .* \(4 simulated SuperNodes\)", out), out[-4000:]
    # it trained: two rounds mixed by IncA among the 4 nodes, each certified and charged
    assert len(re.findall(r"IncA round \d: 4/4 finals, round mu = [\d.]+, epsilon = [\d.]+ of 8; model updated",
                          out)) == 2, out[-4000:]
    assert "IncA model: [" in out and "num_releases=2" in out
    status, row = _status_check(run_id, app, env)
    assert row["status"] == "finished:completed" and status == 0, row


def _listening(port: str) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", int(port))) == 0


@pytest.mark.slow  # Flower's own behaviour, which the README's route avoids (15 s)
def test_a_failed_dependency_installation_exits_0_and_the_variable_needs_a_new_superlink(user):
    """What the section says of Flower's own dependency installation, as a user meets it: the command
    without the variable (installation on) fails here whether or not an index is reachable (uv offline, no
    cache), yet `flwr run` exits 0, and only the run's status (the section's check) tells; setting the
    variable then changes nothing while that local SuperLink runs; the section's command stops it."""
    app, env = user
    (command,) = [line for line in _bash_lines(_section()) if line.startswith(VARIABLE + "flwr run .")]
    offline = {**env, "UV_OFFLINE": "1", "UV_NO_CACHE": "1"}
    for attempt, run in enumerate([command.removeprefix(VARIABLE), command]):
        done = _shell(run, app, offline)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out[-4000:]  # Flower's behaviour: if this changes, update the README
        assert ("Starting local SuperLink" in out) == (attempt == 0)  # the second run uses the running one
        assert "Runtime installation of app dependencies failed" in out, out[-4000:]
        status, row = _status_check(_run_id(done), app, env)
        assert row["status"] == "finished:failed" and "uv sync failed" in row["status-details"], row
        assert status == 1  # the section's check tells
    port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
    (stop,) = [line for line in _bash_lines(_section()) if line.startswith("kill ") and "lsof" in line]
    if shutil.which("lsof") is None:
        pytest.skip("lsof is not installed: the section's command to stop the SuperLink was not run")
    assert _listening(port) and _shell(stop.split("#")[0], app, env).returncode == 0
    deadline = time.monotonic() + 60
    while _listening(port) and time.monotonic() < deadline:  # until it has stopped listening
        time.sleep(0.1)
    assert not _listening(port)


NETWORK_VARIABLES = ("SSL_CERT_FILE", "SSL_CERT_DIR", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy",
                     "https_proxy", "no_proxy", "UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_EXTRA_INDEX_URL")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flowers_own_installation_takes_flwr_inca_from_the_built_wheel(user, tmp_path):
    """The section's route for Flower's own dependency installation (online: everything but flwr-inca comes
    from the package index into the run's fresh environment): the wheel built from the checkout, found
    through UV_FIND_LINKS, set for the `flwr run` that starts the local SuperLink."""
    import flwr_inca
    from test_packaging import _build, _source_copy

    app, env = user
    _, wheel = _build(_source_copy(tmp_path), tmp_path / "wheels", isolation=False)
    network = {name: os.environ[name] for name in NETWORK_VARIABLES if name in os.environ}
    (command,) = [line for line in _bash_lines(_section()) if line.startswith(VARIABLE + "flwr run .")]
    done = _shell(command.removeprefix(VARIABLE), app, {**env, **network, "UV_FIND_LINKS": str(wheel.parent)})
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "App dependencies installed successfully" in out, out[-4000:]
    assert re.search(rf"Installed: \[.*flwr-inca=={re.escape(flwr_inca.__version__)}", out), out[-4000:]
    assert "IncA model: [" in out and "num_releases=2" in out, out[-4000:]
