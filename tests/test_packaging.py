"""The package as a release publishes it: ``python -m build`` gives a source archive and a wheel (the wheel
built from the archive, so that the archive is complete) with the metadata an index shows, and the wheel,
installed into a fresh virtual environment, imports and runs ``flwr-inca``.

The default test builds without build isolation (the build backend of this environment) and installs the
wheel alone into a fresh venv that borrows this environment's packages for the dependencies: offline, in
seconds. ``-m slow`` adds the route of a fresh machine: an isolated build and ``pip install`` of the wheel
with its dependencies from the package index.
"""

from __future__ import annotations

import email
import functools
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import flwr_inca

ROOT = Path(__file__).parent.parent
SOURCES = ("pyproject.toml", "README.md", "LICENSE")
pytest.importorskip("build")
packaging_metadata = pytest.importorskip("packaging.metadata")


def _source_copy(tmp_path: Path) -> Path:
    """The files a release is built from, copied: the build writes no egg-info or build/ into the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "flwr_inca", src / "flwr_inca", ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _build(src: Path, out: Path, isolation: bool) -> tuple[Path, Path]:
    args = [sys.executable, "-m", "build", "--outdir", str(out), str(src)]
    done = subprocess.run(args if isolation else [*args, "--no-isolation"], capture_output=True, text=True,
                          timeout=500, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (sdist,) = out.glob("flwr_inca-*.tar.gz")
    (wheel,) = out.glob("flwr_inca-*-py3-none-any.whl")
    return sdist, wheel


def _fresh_venv(path: Path, borrow_packages: bool) -> Path:
    """A new virtual environment (its python); with ``borrow_packages``, this environment's packages are
    importable after its own (a .pth line), so the wheel's dependencies need no download."""
    options = ["--without-pip"] if borrow_packages else []
    subprocess.run([sys.executable, "-m", "venv", *options, str(path)], check=True, timeout=300)
    python = path / "bin" / "python"
    if borrow_packages:
        code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        purelib = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        Path(purelib, "borrowed-test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _check_metadata(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = f"flwr_inca-{flwr_inca.__version__}.dist-info"
        raw = zf.read(f"{info}/METADATA")
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
    meta = packaging_metadata.Metadata.from_email(raw, validate=True)  # raises on an invalid field
    assert meta.name == "flwr-inca" and str(meta.version) == flwr_inca.__version__
    assert meta.license_expression == "Apache-2.0" and f"{info}/licenses/LICENSE" in names
    assert meta.project_urls and all(url.startswith("https://") for url in meta.project_urls.values())
    assert meta.summary and meta.keywords and meta.requires_python is not None
    assert "Programming Language :: Python :: 3" in meta.classifiers
    assert not any(c.startswith("License ::") for c in meta.classifiers)  # the SPDX expression says it
    assert meta.description_content_type == "text/markdown"
    assert email.message_from_bytes(raw).get_payload().startswith("# flwr-inca")  # the README, as the page
    assert {"flower", "opacus", "simulation", "test"} <= set(meta.provides_extra)
    assert "flwr-inca = flwr_inca.cli:main" in entry_points
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "flwr_inca").rglob("*.py")}
    assert modules <= set(names), sorted(modules - set(names))  # every module of the package is shipped


def _check_installed(python: Path, venv: Path, modules: str) -> None:
    """The installed wheel (not the checkout) imports ``modules``, and its console script runs: in another
    folder than the checkout's (``python -c`` imports from the current one), without PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=300, check=False,
                            cwd=venv.parent, env=env)
    where = run([str(python), "-c", f"import {modules}; print(flwr_inca.__file__)"])
    assert where.returncode == 0, where.stderr[-3000:]
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout
    cli = venv / "bin" / "flwr-inca"
    version = run([str(cli), "--version"])
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith(f"flwr-inca {flwr_inca.__version__}"), version.stdout
    demo = run([str(cli), "mean", "-n", "10", "-T", "5", "--dim", "2", "--runs", "2", "--json"])
    assert demo.returncode == 0 and '"mse_inca"' in demo.stdout, demo.stderr[-3000:]


@pytest.mark.timeout(240)
def test_the_release_builds_with_complete_metadata_and_the_wheel_runs_from_a_fresh_venv(tmp_path):
    sdist, wheel = _build(_source_copy(tmp_path), tmp_path / "dist", isolation=False)
    with tarfile.open(sdist) as tar:
        top = sdist.name.removesuffix(".tar.gz")
        assert {f"{top}/{name}" for name in (*SOURCES, "PKG-INFO")} <= set(tar.getnames())
    _check_metadata(wheel)
    venv = tmp_path / "venv"
    python = _fresh_venv(venv, borrow_packages=True)
    # --force-reinstall: pip also sees the borrowed environment's flwr-inca (this checkout, same version)
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                              "--no-index", "--force-reinstall", str(wheel)], capture_output=True, text=True,
                             timeout=300, check=False)
    assert install.returncode == 0, install.stderr[-3000:]
    _check_installed(python, venv, "flwr_inca, flwr_inca.flower, flwr_inca.simulation")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_on_a_fresh_machine_the_wheel_installs_with_its_dependencies_from_the_index(tmp_path):
    sdist, wheel = _build(_source_copy(tmp_path), tmp_path / "dist", isolation=True)
    venv = tmp_path / "venv"
    python = _fresh_venv(venv, borrow_packages=False)
    install = subprocess.run([str(python), "-m", "pip", "install", f"{wheel}[flower]"], capture_output=True,
                             text=True, timeout=800, check=False)
    assert install.returncode == 0, install.stderr[-3000:]
    _check_installed(python, venv, "flwr_inca, flwr_inca.flower")
