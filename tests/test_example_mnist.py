"""The MNIST logistic-regression example: task unit tests and end-to-end runs through Flower."""

import gzip
import json
import logging
import os
import re
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

EXAMPLE = Path(__file__).parent.parent / "examples" / "mnist_logreg"
sys.path.insert(0, str(EXAMPLE))
MNIST = Path(os.environ.get("FLWR_INCA_MNIST_DIR") or Path(__file__).parent.parent.parent / "shared" / "data" / "mnist")

from mnist_logreg import task


def _write_idx(path, array, magic):
    header = struct.pack(">II", magic, array.shape[0])
    if magic == 2051:
        header += struct.pack(">II", 28, 28)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_idx_reader_and_partitions(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in [("train", 60), ("t10k", 20)]:
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 784)), 2051)
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, n), 2049)
    task.load_data.cache_clear()
    data = task.load_data(str(tmp_path))
    assert data.x_train.shape == (60, 784) and data.y_test.shape == (20,) and data.features == 784
    parts = [task.partition(data, i, 4) for i in range(4)]
    assert sum(len(y) for _, y in parts) == 60
    # IID split: disjoint and covering
    rows = np.concatenate([x for x, _ in parts])
    assert len({r.tobytes() for r in rows}) == len({r.tobytes() for r in data.x_train})
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    task.load_data.cache_clear()
    with pytest.raises(FileNotFoundError, match="t10k-labels"):
        task.load_data(str(tmp_path))


def test_offline_fallback_to_digits(monkeypatch, capsys):
    monkeypatch.delenv("FLWR_INCA_MNIST_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # flwr-datasets unavailable
    task.load_data.cache_clear()
    data = task.load_data("")
    assert data.features == 64 and "digits" in data.name
    assert "falling back to scikit-learn" in capsys.readouterr().err


def test_record_sensitivity_bound_by_brute_force():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((30, 12)).astype(np.float32) * 3
    y = rng.integers(0, 10, 30)
    lr, clip, B = 0.7, 0.5, 10

    def step(rows):
        torch.manual_seed(0)
        m = task.make_model(12)
        before = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()
        task.clipped_step(m, x[rows], y[rows], lr, clip, B)
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()]) - before

    base = np.arange(12)
    for extra in range(12, 30):  # add one example: the step moves by at most lr * clip / B
        diff = (step(np.append(base, extra)) - step(base)).norm().item()
        assert diff <= lr * clip / B * (1 + 1e-5)
    big = (step(np.arange(30)) - step(np.arange(29))).norm().item()
    assert big > 0.5 * lr * clip / B  # large gradients are clipped to exactly the bound


def test_privacy_plan_record_level_composes_to_the_budget():
    from opacus.accountants import PRVAccountant

    cfg = task.load_config({"epsilon": 2.0, "num-server-rounds": 25, "batch-size": 40, "lr": 3.0, "clip-norm": 0.8})
    plan = task.privacy_plan(cfg, 2000)
    assert plan["sample_rate"] == pytest.approx(0.02)
    assert plan["value_sensitivity"] == pytest.approx(3.0 * 0.8 / 40)
    acc = PRVAccountant()
    acc.history = [(1 / plan["mu_round"], 0.02, 25)]
    assert acc.get_epsilon(delta=1e-5) == pytest.approx(2.0, abs=0.02)


def test_privacy_plan_party_level():
    from flwr_inca.privacy import epsilon_for_delta

    plan = task.privacy_plan(task.load_config({"privacy-unit": "party", "epsilon": 4.0, "num-server-rounds": 16}), 1)
    assert plan["value_sensitivity"] == 2.0 and plan["sample_rate"] == 1.0
    assert epsilon_for_delta(plan["mu_round"] * 4, 1e-5) == pytest.approx(4.0, rel=1e-6)
    with pytest.raises(ValueError, match="privacy-unit"):
        task.load_config({"privacy-unit": "household"})


def _run_example(tmp_path, monkeypatch, expect=0, **config):
    from mnist_logreg import run

    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv(task.ENV_CONFIG, "{}")  # run.main overwrites it; monkeypatch restores it
    args = ["--num-supernodes", "10", "--output-dir", str(tmp_path)]
    for key, value in config.items():
        args += [f"--{key}", str(value)]
    task.load_data.cache_clear()
    assert run.main(args) == expect


def _results(tmp_path, unit="record"):
    """The results.json of every run so far, oldest first."""
    runs = sorted((tmp_path / f"mnist_logreg-{unit}").glob("run-*"))
    return runs, [json.loads((r / "results.json").read_text()) for r in runs]


@pytest.mark.flower
@pytest.mark.timeout(300)  # a run of Flower's simulation engine (Ray); a deadline for a loaded machine
def test_example_runs_offline_on_digits_and_a_spent_budget_keeps_earlier_results(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FLWR_INCA_MNIST_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)
    root_handlers = list(logging.getLogger().handlers)
    _run_example(tmp_path, monkeypatch, **{"num-server-rounds": 5, "epsilon": 2.0, "batch-size": 20})
    assert logging.getLogger().handlers == root_handlers  # Opacus's import configured no root handler
    err = capsys.readouterr().err
    assert "round 5/5" in err and "left" in err  # per-round progress with an ETA
    assert "note: this run used scikit-learn's 8x8 digits" in err  # repeated at the end of the run
    runs, (out,) = _results(tmp_path)
    history = out["history"]
    assert "digits" in out["dataset"] and len(history) == 6
    # learns: 3x chance after 5 private rounds (8 seeds of the same setting offline: 63% to 89%)
    assert history[-1]["accuracy"] > 0.3
    eps = [h["epsilon"] for h in history[1:]]
    assert eps == sorted(eps) and 0 < eps[-1] <= 2.0 + 0.02
    assert (runs[0] / "accuracy_epsilon.png").exists()
    assert len(list((runs[0] / "traces").iterdir())) == 5
    before = (runs[0] / "results.json").read_bytes()

    # the same command again: the shared ledger has no room for a round; exit 1 before Flower starts,
    # earlier results intact
    def not_started(**_):
        raise AssertionError("Flower's simulation engine started for a run the ledger refuses")

    monkeypatch.setattr("flwr.simulation.run_simulation", not_started)
    _run_example(tmp_path, monkeypatch, expect=1, **{"num-server-rounds": 5, "epsilon": 2.0, "batch-size": 20})
    err = capsys.readouterr().err
    ledger = tmp_path / "mnist_logreg-record" / "inca_ledger.json"
    assert f"rm {ledger}" in err and "No round ran and no results were written" in err
    assert _results(tmp_path)[0] == runs and (runs[0] / "results.json").read_bytes() == before


def test_an_unreachable_ray_address_exits_2_in_one_line_before_flower_starts(tmp_path, monkeypatch, capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setitem(sys.modules, "datasets", None)

    def not_started(**_):
        raise AssertionError("Flower's simulation engine started without a Ray cluster")

    monkeypatch.setattr("flwr.simulation.run_simulation", not_started)
    _run_example(tmp_path, monkeypatch, expect=2, **{"num-server-rounds": 1})
    err = [line for line in capsys.readouterr().err.splitlines() if "falling back" not in line]
    assert err == [f"error: RAY_ADDRESS='127.0.0.1:{port}': no Ray cluster answers there ([Errno 111] Connection "
                   "refused); start one with `ray start --head` or unset RAY_ADDRESS for a local Ray"]
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()


@pytest.mark.slow  # a second run of Flower's simulation engine (30 s); the default run starts a local Ray
@pytest.mark.flower
@pytest.mark.timeout(300)
def test_example_runs_on_the_ray_cluster_that_ray_address_names(ray_cluster, tmp_path, monkeypatch, capsys):
    """``RAY_ADDRESS`` set: Flower's engine runs on that cluster (Ray refuses the CPU count a local Ray is
    started with), and the run's settings reach the cluster's workers, which were not started from here."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster[0])
    monkeypatch.delenv("FLWR_INCA_MNIST_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)
    _run_example(tmp_path, monkeypatch, **{"num-server-rounds": 2, "epsilon": 3.0, "batch-size": 20})
    err = capsys.readouterr().err
    assert "round 2/2" in err
    _, (out,) = _results(tmp_path)
    assert out["config"]["epsilon"] == 3.0 and len(out["history"]) == 3
    assert 0 < out["history"][-1]["epsilon"] <= 3.0 + 0.02


@pytest.mark.parametrize("args, message", [
    (["--epsilon", "0"], "epsilon must be a number > 0, got 0.0"),
    (["--collusion", "-0.5"], "collusion must be in [0, 1), got -0.5"),
    (["--data-dir", "/nonexistent/mnist"], "data-dir must be '' or an existing directory"),
    (["--epsilon", "0.001"], "epsilon = 0.001 is too small for 40 rounds"),
    (["--num-supernodes", "1"], "num-supernodes must be an integer >= 2, got 1"),
])
def test_bad_settings_exit_2_with_one_line_before_flower_starts(args, message, monkeypatch, capsys):
    from mnist_logreg import run

    monkeypatch.setitem(sys.modules, "datasets", None)
    task.load_data.cache_clear()
    assert run.main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "falling back" not in line]
    assert err == [f"error: {message}"] or (len(err) == 1 and err[0].startswith(f"error: {message}"))
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()


def test_privacy_unit_is_a_choice(capsys):
    from mnist_logreg import run

    with pytest.raises(SystemExit) as info:
        run.main(["--privacy-unit", "foo"])
    assert info.value.code == 2 and "invalid choice: 'foo' (choose from 'record', 'party')" in capsys.readouterr().err


def test_run_help_explains_every_key():
    from mnist_logreg import run

    text = "".join(run.build_parser().format_help().split())  # wrapping (at spaces or hyphens) ignored
    for key, value in task.DEFAULTS.items():
        flag = "--num-supernodes" if key == "num-partitions" else f"--{key}"
        assert flag in text and "".join(task.HELP[key].split()) in text
        assert f"(default:{value})" in text
    assert "python-mmnist_logreg.run--num-supernodes20" in text


def test_config_keys_are_validated_with_their_range():
    for cfg, message in [({"num-server-rounds": 0}, "num-server-rounds must be an integer >= 1, got 0"),
                         ({"iterations": 2.5}, "iterations must be 'auto' or an integer >= 1, got 2.5"),
                         ({"iterations": "many"}, "iterations must be 'auto' or an integer >= 1, got 'many'"),
                         ({"expected-dropout": 0.8}, "expected-dropout must be in [0, 0.8), got 0.8"),
                         ({"delta": 1.0}, "delta must be in (0, 1), got 1.0"),
                         ({"party-lr": -1}, "party-lr must be a number > 0"),
                         ({"lr": True}, "lr must be a number > 0, got True"),
                         ({"epochs": 3}, "unknown config key(s) epochs")]:
        with pytest.raises(task.ConfigError) as info:
            task.load_config(cfg)
        assert str(info.value).startswith(message)
    assert task.load_config({"num-server-rounds": 5.0})["num-server-rounds"] == 5  # TOML may give floats
    from mnist_logreg import run

    assert task.load_config({"iterations": 20.0})["iterations"] == 20 and task.load_config()["iterations"] == "auto"
    assert run.build_parser().parse_args(["--iterations", "20"]).iterations == 20
    assert run.build_parser().parse_args([]).iterations == "auto"
    assert task.expected_dropout(task.load_config()) is None
    assert task.expected_dropout(task.load_config({"expected-dropout": 0.1})).gamma == 0.1


def test_the_log_states_the_users_settings_and_explains_the_derived_ones():
    cfg = task.load_config({})
    line = task.describe_plan(cfg, task.privacy_plan(cfg, 3000), 20)
    assert "total budget (1, 1e-05) over 40 rounds" in line and "clip-norm 1" in line and "lr 6" in line
    assert "lr * clip-norm / batch-size = 0.12" in line and "per round" in line.lower()


NO_MNIST = pytest.mark.skipif(not MNIST.exists(), reason="MNIST IDX files not available: set FLWR_INCA_MNIST_DIR "
                              "to the directory of the 4 IDX .gz files (default ../shared/data/mnist)")


@NO_MNIST
def test_the_example_reads_the_real_mnist_files_and_splits_them_for_its_nodes():
    """What the example changes on MNIST is its data: the four IDX files read whole, standardized, every
    class present, an IID split over the nodes that covers the training set (the run itself, on digits,
    is test_example_runs_offline_on_digits_...; on MNIST, test_example_runs_on_mnist under -m slow)."""
    task.load_data.cache_clear()
    data = task.load_data(str(MNIST))
    assert data.name.startswith("MNIST") and data.features == 784
    assert data.x_train.shape == (60000, 784) and data.x_test.shape == (10000, 784)
    assert data.y_train.shape == (60000,) and data.y_test.shape == (10000,)
    assert abs(float(data.x_train.mean())) < 1e-3 and abs(float(data.x_train.std()) - 1.0) < 1e-2
    assert np.isfinite(data.x_test).all() and data.x_train.dtype == np.float32
    assert set(np.unique(data.y_train)) == set(range(10)) == set(np.unique(data.y_test))
    sizes = [len(task.partition(data, i, 10)[1]) for i in range(10)]
    assert sum(sizes) == 60000 and max(sizes) - min(sizes) <= 1


@pytest.mark.slow  # the run is the offline one's on other data (about a minute on a loaded 2-core machine)
@pytest.mark.flower
@pytest.mark.timeout(300)
@NO_MNIST
def test_example_runs_on_mnist(tmp_path, monkeypatch):
    _run_example(tmp_path, monkeypatch, **{"num-server-rounds": 2, "data-dir": MNIST,
                                           "privacy-unit": "party", "epsilon": 8.0})
    _, (out,) = _results(tmp_path, "party")
    assert out["dataset"].startswith("MNIST") and out["nodes"] == 10
    assert out["history"][-1]["epsilon"] <= 8.0 + 1e-9
    assert out["plan"]["value_sensitivity"] == 2.0


def test_online_route_the_built_wheel_satisfies_the_apps_requirement(tmp_path):
    """README's online route: Flower's installer (uv sync) finds flwr-inca[flower] in the wheel built from
    the checkout. Offline, we check what uv would: name, version and extra against the app's requirement."""
    import subprocess
    import tomllib
    import zipfile

    from packaging.requirements import Requirement

    root = EXAMPLE.parent.parent
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(root)], capture_output=True, text=True, timeout=300,
                           check=False)
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("flwr_inca-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        assert "flwr_inca/flower/strategy.py" in zf.namelist()
    version = re.search(r"^Version: (.+)$", meta, re.MULTILINE).group(1)
    deps = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "flwr-inca"]
    assert req.specifier.contains(version) and "flower" in req.extras
    assert "Provides-Extra: flower" in meta
    assert req.specifier and not req.specifier.contains("0.0.1")  # never an unrelated flwr-inca from PyPI


@pytest.mark.parametrize("run_config, message", [({"epsilon": 0.0}, "epsilon must be a number > 0"),
                                                 ({"privacy-unit": "foo"}, "privacy-unit must be 'record' or"),
                                                 ({"epsilon": 0.001}, "epsilon = 0.001 is too small")])
def test_serverapp_checks_its_run_config_before_waiting_for_nodes(run_config, message, monkeypatch):
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict
    from mnist_logreg import server_app

    class NoGrid:  # the checks come first: the grid must not be used
        def get_node_ids(self):
            return [1, 2, 3, 4] if "epsilon" in run_config and run_config["epsilon"] == 0.001 else pytest.fail()

    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setattr(server_app, "_wait_for_nodes", lambda grid: len(grid.get_node_ids()))
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with pytest.raises(task.ConfigError, match=re.escape(message)):
        server_app.main(NoGrid(), context)


def test_each_run_gets_its_own_folder_and_all_share_the_ledger(tmp_path):
    pytest.importorskip("flwr")
    from mnist_logreg.server_app import output_paths

    cfg = task.load_config({"output-dir": str(tmp_path)})
    ledger, first = output_paths(cfg)
    assert not first.exists()  # created only once a round has run
    first.mkdir(parents=True)
    ledger2, second = output_paths(cfg)  # same second: a suffix, never the same folder
    assert ledger2 == ledger == tmp_path / "mnist_logreg-record" / "inca_ledger.json"
    assert second != first and second.parent == first.parent and second.name.startswith("run-")


def test_budget_message_counts_the_rounds_the_budget_skipped(tmp_path):
    from flwr.app import ArrayRecord

    from flwr_inca.flower import IncaBudgetExhausted
    from flwr_inca.privacy.session import BudgetExhausted
    from mnist_logreg import server_app

    stop = IncaBudgetExhausted(BudgetExhausted("spent", round=9, epsilon=1.9, predicted_epsilon=2.3, max_epsilon=2.0,
                                               delta=1e-5), ArrayRecord())
    message = server_app._budget_message(stop, tmp_path / "ledger.json", 8, 2, 10, tmp_path / "run")
    assert "8 of 10 rounds ran, 2 of them skipped: refused by the budget" in message
    assert "skipped" not in server_app._budget_message(stop, tmp_path / "l.json", 8, 0, 10, tmp_path / "run")
    assert "No round ran" in server_app._budget_message(stop, tmp_path / "l.json", 0, 0, 10, None)


def test_the_check_before_flower_starts_refuses_only_a_ledger_without_room_for_a_round(tmp_path):
    """What `python -m mnist_logreg.run` checks before starting Flower and Ray: no ledger yet, or one with
    room for the first round, passes (the round's own admission then decides as before); a ledger that
    earlier runs spent refuses with the budget message, and nothing is written to it."""
    pytest.importorskip("flwr")
    from flwr_inca.privacy import PrivacyLedger
    from flwr_inca.rounds import budget_share
    from mnist_logreg.server_app import check_ledger, output_paths

    cfg = task.load_config({"output-dir": str(tmp_path), "privacy-unit": "party", "epsilon": 2.0,
                            "num-server-rounds": 5})
    plan = task.privacy_plan(cfg, 100)
    assert check_ledger(cfg, plan, 10) is None  # no ledger yet
    path, _ = output_paths(cfg)
    ledger = PrivacyLedger(path, delta=cfg["delta"], max_epsilon=2.0)
    ledger.spend(plan["mu_round"])  # an earlier run's round: room is left
    assert check_ledger(cfg, plan, 10) is None
    ledger.spend(budget_share(ledger, 1) * 0.999)  # then all but a sliver of the budget
    before = path.read_bytes()
    message = check_ledger(cfg, plan, 10)
    assert message.startswith("privacy budget spent: stopping before round 1")
    assert f"rm {path}" in message and "No round ran and no results were written" in message
    assert path.read_bytes() == before


def test_an_unreadable_ledger_is_named_in_one_line_before_flower_starts(tmp_path, monkeypatch, capsys):
    """A ledger file that is not JSON (or was edited): exit 2, one line naming the file, Flower not started,
    the file left as it was."""
    monkeypatch.delenv("FLWR_INCA_MNIST_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)

    def not_started(**_):
        raise AssertionError("Flower's simulation engine started despite an unreadable ledger")

    monkeypatch.setattr("flwr.simulation.run_simulation", not_started)
    ledger = tmp_path / "mnist_logreg-record" / "inca_ledger.json"
    ledger.parent.mkdir()
    ledger.write_text("not json")
    _run_example(tmp_path, monkeypatch, expect=2, **{"num-server-rounds": 2})
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(ledger) in errors[0] and "not valid JSON" in errors[0], errors
    assert "Traceback" not in err and ledger.read_text() == "not json"
