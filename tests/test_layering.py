"""The core never imports the adapters: protocol and privacy work without Flower and Ray."""

import subprocess
import sys

import pytest


def _prints_ok(code: str) -> None:
    """Run ``code`` in a fresh interpreter: it exits 0 and prints ``ok``."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_core_imports_without_flower_and_ray():
    code = (
        "import sys\n"
        "sys.modules['flwr'] = None; sys.modules['ray'] = None\n"  # any import of them now fails
        "import numpy as np\n"
        "import flwr_inca, flwr_inca.protocol, flwr_inca.privacy, flwr_inca.cli, flwr_inca.simulation\n"
        "import flwr_inca.baselines, flwr_inca.reproduce\n"
        "r = flwr_inca.run_inca(np.ones((4, 2)), flwr_inca.IncaConfig(sigma_star=0.0, sigma_delta=1.0), seed=0)\n"
        "assert np.allclose(r.estimate, 1.0)\n"
        "assert 'flwr' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
        "print('ok')\n"
    )
    _prints_ok(code)


def _loads_only_what_it_needs(first: str, forbidden: tuple[str, ...], package: str, then: str = "") -> None:
    """In a fresh interpreter, the imports ``first`` load no module under any prefix of ``forbidden``; then
    every public name of ``package`` (imported on first use) resolves, ``then``'s checks hold, and an
    unknown name is an AttributeError."""
    _prints_ok(
        "import sys\n" + first
        + f"heavy = sorted({{p for p in {forbidden!r} for m in sys.modules if m.startswith(p)}})\n"
        "assert not heavy, heavy\n"
        f"import {package} as package\n"
        "assert all(getattr(package, name) is not None for name in package.__all__)\n"
        "assert set(package.__all__) <= set(dir(package))\n" + then
        + "try:\n"
        "    package.NoSuchThing\n"
        "except AttributeError as e:\n"
        "    assert 'NoSuchThing' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
        "print('ok')\n"
    )


def test_a_clientapp_loads_no_privacy_accounting():
    """The deployment engine starts a ClientApp process per message: ``IncaClient`` (and the wire format a
    ClientApp reads) come without the strategy's privacy accounting, Opacus, Ray or SciPy (its sparse
    matrices added 0.19 s to the 0.05 s the client side takes now; benchmarks/bench_client_import.py); the strategy's names
    still import from the same package, and an unknown name is an AttributeError."""
    pytest.importorskip("flwr")
    _loads_only_what_it_needs(
        "from flwr_inca.flower import IncaClient\nfrom flwr_inca.flower.wire import peek_request\n",
        ("flwr_inca.privacy", "opacus", "ray", "torch", "scipy"), "flwr_inca.flower",
        "from flwr_inca.flower import IncaStrategy, IncaBudgetExhausted, PrivacyTarget\n"
        "assert IncaStrategy.__name__ == 'IncaStrategy'\n")


def test_a_ray_actor_loads_only_the_training_side():
    """The simulator's Ray backend starts an actor process per cohort (and a fresh one for each that died);
    Ray imports its class from ``flwr_inca.simulation.training``: that loads torch, not the accountant, the
    baselines, the runner or SciPy (they added about 1.3 s per actor; benchmarks/bench_client_import.py
    --side actor). The package's names still import from it, the registry with every baseline's mode."""
    pytest.importorskip("torch")
    _loads_only_what_it_needs(
        "from flwr_inca.simulation.training import CohortTrainer\n",
        ("flwr_inca.privacy", "flwr_inca.baselines", "flwr_inca.simulation.runner", "flwr_inca.simulation.mixers",
         "scipy", "numba", "ray", "flwr."), "flwr_inca.simulation",
        "from flwr_inca.simulation import MIXERS, SimulationConfig\n"
        "assert {'inca', 'gopa', 'muffliato', 'local-dp', 'dp-gossip', 'central-dp', 'fedavg'} <= set(MIXERS)\n"
        "assert SimulationConfig(mode='gopa', max_epsilon=1.0).mode == 'gopa'\n")


def test_the_ledger_and_the_cli_load_no_solver():
    """``flwr_inca.privacy`` (and its attack package) imports each name when first used: a process that only
    keeps the ledger (the processes that share one, the conversions) or builds the command line's parsers
    (``flwr-inca --help``: every subcommand's options, the solvers' names and limits, the figures' default
    runs) loads neither numba (the compiled cascade), SciPy's sparse matrices (the certificates) nor a
    figure's module; every public name still resolves."""
    _loads_only_what_it_needs(
        "from flwr_inca.privacy import PrivacyLedger, epsilon_for_delta\nimport flwr_inca.cli, flwr_inca.study\n"
        "flwr_inca.cli.build_parser()\n",
        ("numba", "scipy.sparse", "flwr_inca.privacy.certificate", "flwr_inca.privacy.attack.audit",
         "flwr_inca.reproduce.fig", "flwr_inca.reproduce.frontier", "torch"), "flwr_inca.privacy",
        "import flwr_inca.privacy.attack as attack\n"
        "assert all(getattr(attack, name) is not None for name in attack.__all__)\n"
        "assert attack.audit.DEFAULT_RUNS == attack.DEFAULT_RUNS\n")


# ---------------------------------------------------------------------------- one module, one owner
import ast  # noqa: E402
from pathlib import Path  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "flwr_inca"
# private names of other libraries the package uses on purpose (an argparse extension point)
FOREIGN = {"_SubParsersAction", "_get_help_string"}
# the numba kernels' Python bodies (one compiled loop each; docs/privacy.md explains why they are long)
KERNELS = {"_solve_blocks_py", "_evaluate_blocks_py"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent), ast.parse(path.read_text())


def test_no_module_reaches_into_another_modules_private_names():
    """A private name (``_x``) is used only by the module that defines it: never imported by another, and
    never read off anything but ``self``/``cls`` (an object of another module's class)."""
    found = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module is not None:  # a private module is the package's
                found += [f"{path}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls") or node.attr in FOREIGN:
                    continue
                found.append(f"{path}:{node.lineno} reads {ast.unparse(owner)}.{node.attr}")
    assert found == [], "\n".join(found)


def test_no_function_is_longer_than_100_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _modules() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in KERNELS
            and node.end_lineno - node.lineno + 1 > 100]
    assert long == [], "\n".join(long)


def test_the_package_imports_without_posix_only_modules():
    """``import flwr_inca`` (the engine, certificates, ledger) needs no ``fcntl``: the ledger's lock imports
    it when a lock is taken, and uses ``msvcrt`` on Windows."""
    code = ("import sys\nsys.modules['fcntl'] = None\nimport flwr_inca, flwr_inca.privacy, flwr_inca.protocol\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
