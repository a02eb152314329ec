"""The baselines as simulator mixers (flwr_inca.simulation.baseline_mixers) and the MNIST study's
pipeline (flwr_inca.study) at a tiny scale; the real study is `flwr-inca study mnist` (docs/results.md)."""

import csv
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flwr_inca.baselines import noisy_gossip_step
from flwr_inca.simulation import (
    CentralDPMixer,
    MixContext,
    SimulationConfig,
    iid,
    seeding,
    simulate,
)
from flwr_inca.simulation.baseline_mixers import (
    DPGossipMixer,
    LocalDPMixer,
    MuffliatoMixer,
    WithinRoundDropout,
)
from flwr_inca.simulation.data import Dataset
from flwr_inca.simulation.training import CohortTrainer, LocalWork
from flwr_inca.study import TINY_GRID, StudyGrid, run_study
from flwr_inca.study.mnist import CalibrationCache, accuracies, run_one, split_data, worst_node
from flwr_inca.study.runs import StudyOutputExists, run_key, skipped_note

MNIST = Path(os.environ.get("FLWR_INCA_MNIST_DIR", Path(__file__).resolve().parents[2] / "shared/data/mnist"))


def _context(n, d, mu_round=0.5, sensitivity=0.2, precision="float64"):
    return MixContext(sensitivity, mu_round, 1e-5, n, d, 7, precision)


# ------------------------------------------------------------------------------------------ mixers
def test_local_dp_mixer_noise_has_the_calibrated_variance():
    n, d, mu, S = 40, 50_000, 0.5, 0.2
    mixer = LocalDPMixer()
    mixer.prepare(_context(n, d, mu, S))
    plan = mixer.plan(1, n)
    assert plan.mu == pytest.approx(mu) and plan.certified
    out = mixer.mix(np.zeros((n, d)), plan)
    # each party adds N(0, (S / mu)^2): their mean has std S / (mu sqrt(n))
    assert np.std(out) == pytest.approx(S / mu / math.sqrt(n), rel=0.02)
    # ... sqrt(n) times the central-DP noise for the same mu
    central = CentralDPMixer()
    central.prepare(_context(n, d, mu, S))
    ratio = np.std(out) / np.std(central.mix(np.zeros((n, d)), central.plan(1, n)))
    assert ratio == pytest.approx(math.sqrt(n), rel=0.03)


def test_dp_gossip_mixer_is_one_noisy_gossip_step_of_the_baselines():
    n, d = 30, 8
    mixer = DPGossipMixer(expected_degree=4)
    mixer.prepare(_context(n, d))
    plan = mixer.plan(3, n)
    W = plan.info["execution"].W
    assert plan.mu == pytest.approx(0.5)  # local DP: a neighbour sees x_i + eta_i
    assert np.allclose(np.asarray(W.sum(axis=1)).ravel(), 1.0)  # row-normalised A + I
    x = np.random.default_rng(0).standard_normal((n, d))
    out = mixer.mix(x, plan)
    expected = noisy_gossip_step(x, W, 0.2 / 0.5, seeding.stream(7, seeding.NOISE, 3))
    assert np.allclose(plan.info["node_updates"], expected)
    assert np.allclose(out, expected.mean(axis=0))
    # more gossip steps per round: the noisy step, then plain averaging steps
    more = DPGossipMixer(expected_degree=4, gossip_steps=3)
    more.prepare(_context(n, d))
    plan = more.plan(3, n)
    W = plan.info["execution"].W
    more.mix(x, plan)
    assert np.allclose(plan.info["node_updates"], W @ (W @ expected))


def test_muffliato_mixer_uses_its_own_pairwise_accounting_and_says_so():
    n, d, mu, S = 64, 6, 0.5, 0.2
    mixer = MuffliatoMixer()
    mixer.prepare(_context(n, d, mu, S))
    plan = mixer.plan(1, n)
    T = plan.info["iterations"]
    A = plan.info["execution"].adjacency
    degree = float(np.asarray((A > 0).sum(axis=1)).max())
    sigma = plan.info["noise_std"]
    # mean pairwise Renyi loss alpha T d S^2 / (2 n sigma^2) = alpha mu^2 / 2 (Cyffers et al. Eq. (7))
    assert T * degree * S**2 / (n * sigma**2) == pytest.approx(mu**2)
    assert plan.mu == pytest.approx(mu) and not plan.certified
    # against a colluding neighbour it is local DP, with far less protection
    assert plan.info["mu_collusion"] == pytest.approx(S / sigma) == pytest.approx(mu / math.sqrt(T * degree / n))
    assert "Pairwise Network DP" in plan.info["cost"]
    x = np.random.default_rng(1).standard_normal((n, d))
    out = mixer.mix(x, plan)
    nodes = plan.info["node_updates"]
    assert np.allclose(out, nodes.mean(axis=0))
    # gossip averages: the parties' estimates are much closer to each other than the noised values
    assert np.std(nodes, axis=0).mean() < 0.2 * sigma
    # doubly stochastic W: the average is the mean of the noised values, with or without the gossip
    quick = MuffliatoMixer(node_estimates=False)
    quick.prepare(_context(n, 20_000, mu, S))
    zero = quick.mix(np.zeros((n, 20_000)), quick.plan(1, n))
    assert np.std(zero) == pytest.approx(sigma / math.sqrt(n), rel=0.03)


def test_within_round_dropout_mixes_the_survivors_only():
    n, d = 20, 5
    inner = CentralDPMixer(noise_multiplier=1e-9)  # practically no noise: the mean of the survivors
    mixer = WithinRoundDropout(inner, 0.25)
    mixer.prepare(_context(n, d))
    plan = mixer.plan(2, n)
    rows = plan.info["rows"]
    assert rows.size == 15 and plan.info["dropped"] == 5 and len(set(rows.tolist())) == 15
    assert plan.mu == pytest.approx(1e9)
    x = np.random.default_rng(2).standard_normal((n, d))
    assert np.allclose(mixer.mix(x, plan), x[rows].mean(axis=0), atol=1e-6)
    assert not np.allclose(mixer.mix(x, mixer.plan(2, n)), x.mean(axis=0), atol=1e-3)
    with pytest.raises(ValueError, match="gamma"):
        WithinRoundDropout(inner, 1.0)
    with pytest.raises(ValueError, match="inner"):
        WithinRoundDropout("central-dp", 0.1)


def _blobs(n, features=784, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((classes, features)).astype(np.float32)
    y = rng.integers(0, classes, n)
    x = (centers[y] + rng.standard_normal((n, features))).astype(np.float32)
    return x, y.astype(np.int64)


@pytest.mark.parametrize("mode", ["local-dp", "dp-gossip", "muffliato"])
def test_baseline_mixers_train_in_the_simulator_within_the_budget(mode):
    x, y = _blobs(1200, features=20, classes=3)
    parts = iid(x[:1000], y[:1000], 10)
    config = SimulationConfig(rounds=4, mode=mode, max_epsilon=4.0, backend="inline", lr=1.0, batch_size=20,
                              accountant="opacus-rdp")
    history = simulate(lambda: torch.nn.Linear(20, 3), parts, (x[1000:], y[1000:]), config, progress=False)
    assert len(history.records) == 5 and not history.stopped
    assert history.records[-1].epsilon <= 4.0
    assert history.records[-1].accuracy > 0.5  # three well-separated blobs: far above chance (1/3)


def test_linear_record_step_matches_the_generic_per_example_gradients():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 30)).astype(np.float32)
    y = rng.integers(0, 4, 300)
    trainer = CohortTrainer(lambda: torch.nn.Linear(30, 4), x, y, unit="record", lr=2.0, clip_norm=0.5,
                            batch_size=8, party_clip=1e9)
    assert trainer._linear
    rows = np.full((12, 20), -1)
    for c in range(12):
        k = int(rng.integers(0, 20))
        rows[c, :k] = np.sort(rng.choice(np.arange(25 * c, 25 * c + 25), k, replace=False))
    start = rng.standard_normal(4 * 30 + 4).astype(np.float32)
    work = LocalWork(np.arange(12), rows)
    fast = trainer.train(start, work)
    trainer._linear = False
    generic = trainer.train(start, work)
    assert np.abs(generic).max() > 0.1
    np.testing.assert_allclose(fast, generic, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ study
def _dataset():
    x, y = _blobs(1400, seed=4)
    return Dataset(x[:1100], y[:1100], x[1100:], y[1100:], "blobs")


def test_study_pipeline_tunes_on_validation_and_writes_table_and_plots(tmp_path):
    from dataclasses import replace

    grid = replace(TINY_GRID, epsilons=(1.0,), gammas=(0.25,), tune_lr=(0.05, 2.0), validation=200,
                   train_examples=None, test_examples=None)
    lines = []
    summary = run_study(_dataset(), grid, tmp_path, log=lines.append)
    for name in ("runs.csv", "results.json", "table.csv", "table.md", "accuracy_vs_epsilon.png",
                 "accuracy_vs_gamma.png", "accuracy_vs_epsilon.svg", "accuracy_vs_gamma.svg"):
        assert (tmp_path / name).stat().st_size > 0, name
    # the package's progress bar, through the study's log: the share done and the time left
    assert any(line.startswith("[flwr-inca study mnist] [") and " left" in line for line in lines)
    with (tmp_path / "runs.csv").open() as f:
        runs = list(csv.DictReader(f))
    methods = set(grid.methods)
    assert {r["method"] for r in runs} == methods
    # the setting kept for each method is the best on the validation split (never the test set)
    for method in methods:
        tune = [r for r in runs if r["phase"] == "tune" and r["method"] == method and r["accuracy"] not in ("", "None")]
        if not tune:
            continue
        best = max(tune, key=lambda r: float(r["accuracy"]))
        chosen = summary["tuned"][f"{method} n=8 iid"]
        assert float(best["lr"]) == chosen["lr"], method
    table = {r["method"]: r for r in summary["table"]}
    accs = {m: r["accuracy"] for m, r in table.items()}
    assert accs["fedavg"] > 0.5 and accs["central-dp"] > 0.3, accs  # ten classes: chance is 0.1
    assert table["dp-gossip"]["worst_node"] is not None
    assert "not run" in table["inca-paper"]["note"] or table["inca-paper"]["accuracy"] is not None
    for method, row in table.items():
        if method != "fedavg" and row["epsilon_spent"] is not None:
            assert row["epsilon_spent"] <= 1.0 + 1e-9, method
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["grid"]["epsilons"] == [1.0] and len(saved["table"]) == len(methods)
    assert "| central DP (trusted server) |" in (tmp_path / "table.md").read_text()


def test_an_interrupted_study_loses_no_runs_and_resume_completes_it(tmp_path, monkeypatch, capsys):
    """runs.csv is replaced only at the end; an interruption leaves runs.csv.partial, which --resume
    reuses; an earlier grid's rows in the same folder survive; without --resume nothing is touched."""
    from dataclasses import replace

    from flwr_inca.cli import main
    from flwr_inca.study import mnist

    grid = replace(TINY_GRID, methods=("fedavg", "central-dp"), epsilons=(1.0,), gammas=(0.0,),
                   tune_lr=(0.5,), tune_clip=(1.0,), tune_rounds=(2,), validation=200,
                   train_examples=None, test_examples=None)
    data = _dataset()
    run_study(data, grid, tmp_path, log=lambda s: None)
    first = (tmp_path / "runs.csv").read_text()
    first_rows = list(csv.DictReader(first.splitlines()))
    assert first_rows

    real, calls = mnist.run_one, []

    def dies_on_the_third(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(mnist, "run_one", dies_on_the_third)
    other = replace(grid, seeds=(5,))  # a second grid in the same folder: new tuning and test runs
    with pytest.raises(KeyboardInterrupt):
        run_study(data, other, tmp_path, resume=True, log=lambda s: None)
    assert (tmp_path / "runs.csv").read_text() == first  # untouched until the study finishes
    partial = list(csv.DictReader((tmp_path / "runs.csv.partial").open()))
    assert len(partial) >= 2  # what finished before the interruption

    # without --resume: refused with one line naming the file, nothing deleted
    assert main(["study", "mnist", "--grid", "tiny", "--out", str(tmp_path), "--data-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and (tmp_path / "runs.csv").read_text() == first
    with pytest.raises(StudyOutputExists, match="--resume"):
        run_study(data, other, tmp_path, log=lambda s: None)

    calls.clear()
    monkeypatch.setattr(mnist, "run_one", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    run_study(data, other, tmp_path, resume=True, log=lambda s: None)
    assert not (tmp_path / "runs.csv.partial").exists()
    final = list(csv.DictReader((tmp_path / "runs.csv").open()))
    keys = [run_key(r) for r in final]
    assert len(keys) == len(set(keys))
    assert {run_key(r) for r in first_rows} <= set(keys)  # the earlier grid's rows survive
    assert {run_key(r) for r in partial} <= set(keys)
    assert {r["seed"] for r in final} == {"0", "5"}
    # the runs finished before the interruption were not run again; the rest were
    ran = {(a[11], a[2], a[3], a[4], float(a[5]), float(a[6]), a[7], float(a[8]), float(a[9]), int(a[10]))
           for a in calls}
    assert ran and not ran & {run_key(r) for r in partial}


def test_study_grid_and_cli_errors_name_the_parameter(tmp_path, capsys):
    from flwr_inca.cli import main

    with pytest.raises(ValueError, match="methods"):
        StudyGrid(methods=("inca", "secagg"))
    with pytest.raises(ValueError, match="partition"):
        StudyGrid(partitions=("dirichlet:-1",))
    with pytest.raises(ValueError, match="gammas"):
        StudyGrid(gammas=(1.0,))
    assert main(["study", "mnist", "--grid", "tiny", "--methods", "fedavg,nope", "--out", str(tmp_path)]) == 2
    assert "methods" in capsys.readouterr().err


def test_worst_node_is_the_lowest_accuracy():
    x, y = _blobs(3000, features=784, seed=5)
    rng = np.random.default_rng(6)
    good = rng.standard_normal(7850).astype(np.float32) * 0.01
    models = np.stack([good + rng.standard_normal(7850).astype(np.float32) * s for s in np.linspace(0, 0.5, 40)])
    accs = accuracies(models, x, y)
    assert worst_node(models, x, y, screen=500, keep=10) == pytest.approx(accs.min())


@pytest.mark.skipif(not (MNIST / "train-images-idx3-ubyte.gz").exists() and not (MNIST / "train-images-idx3-ubyte").exists(),
                    reason="MNIST IDX files not found: set FLWR_INCA_MNIST_DIR")
def test_cli_study_mnist_tiny(tmp_path, capsys):
    from flwr_inca.cli import main

    code = main(["study", "mnist", "--grid", "tiny", "--data-dir", str(MNIST), "--out", str(tmp_path),
                 "--methods", "fedavg,central-dp,inca", "--epsilons", "1", "--gammas", "0"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| IncA (improved calibration) |" in out
    assert (tmp_path / "accuracy_vs_epsilon.png").exists()


def test_study_runs_share_a_calibrator_per_protocol_with_the_settings_of_their_n():
    """Every run of one protocol (procedure, gamma) shares one NoiseCalibrator, so the calibrations are
    made once; at n <= small_clients it calibrates on small_calibration_runs executions at the
    small_calibration_success share (n = 100 in docs/results.md: a fresh round certified up to 17% above a
    target calibrated on 3 executions), and the calibration equals a direct one with those settings."""
    from flwr_inca.privacy.calibration import NoiseCalibrator
    from flwr_inca.protocol.dropout import PermanentDropout

    grid = StudyGrid(iterations=4, calibration_runs=2, calibration_success=1.0, certify_every=10, small_clients=30,
                     small_calibration_runs=8, small_calibration_success=0.5, small_certify_every=1)
    assert grid.inca_settings(30) == (8, 0.5, 1) and grid.inca_settings(31) == (2, 1.0, 10)
    cache = CalibrationCache(grid)
    small, large = cache.calibrator("exact", 0.1, 25, 4), cache.calibrator("exact", 0.1, 1000, 4)
    assert cache.calibrator("exact", 0.1, 20, 4) is small and small is not large
    assert cache.calibrator("exact", 0.1, 20, 8) is not small  # one per T ('auto' compares several)
    assert cache.calibrator("exact", 0.1, 20, 8).settings["iterations"] == 8
    assert small.settings["runs"] == 8 and small.settings["target_success"] == 0.5
    assert large.settings["runs"] == 2 and cache.calibrator("paper", 0.1, 25, 4).settings["procedure"] == "paper"
    n, mu, S = 20, 0.3, 2.0
    cal = small.calibration(n, mu, 1e-5, S)
    direct = NoiseCalibrator(iterations=4, neighbors=1, collusion=0.1, dropout=PermanentDropout(0.1), runs=8,
                             schedule=grid.schedule, target_success=0.5, seed=small.seed).calibration(n, mu, 1e-5, S)
    assert cal.runs == 8 and cal.success_fraction >= 0.5
    assert (cal.sigma_star, cal.sigma_delta) == (direct.sigma_star, direct.sigma_delta)
    with pytest.raises(ValueError, match="small_calibration_success"):
        StudyGrid(small_calibration_success=0)
    with pytest.raises(ValueError, match="small_certify_every"):
        StudyGrid(small_certify_every=0)


@pytest.mark.parametrize("clients, every, runs", [(8, 1, 5), (12, 10, 2)])
def test_study_inca_run_uses_the_settings_of_its_n(monkeypatch, clients, every, runs):
    """run_one gives the simulator and IncA's calibration the small-n settings at n <= small_clients
    (every round certified, more calibration executions), the others above (a spy on simulate: the real
    simulation is run by the pipeline test)."""
    from flwr_inca import simulation

    grid = StudyGrid(iterations=3, calibration_runs=2, certify_every=10, small_clients=10, small_calibration_runs=5,
                     small_calibration_success=0.8, small_certify_every=1, validation=200, batch_size=10)
    seen = {}

    class Stop(Exception):
        pass

    def spy(model_fn, parts, test_set, config, *, mixer, **kwargs):
        seen["config"] = config
        mixer.prepare(simulation.MixContext(0.2, 0.5, 1e-5, clients - 1, 7850, 0))
        seen["calibration"] = mixer.calibration
        raise Stop

    monkeypatch.setattr(simulation, "simulate", spy)
    data = split_data(_dataset_784(), grid)
    cache = CalibrationCache(grid)
    with pytest.raises(Stop):
        run_one(data, grid, "inca", clients, "iid", 1.0, 0.1, 0, 1.0, 1.0, 3, "tune", cache)
    assert seen["config"].mixing.certify_every == every
    assert seen["calibration"].runs == runs


def _dataset_784():
    rng = np.random.default_rng(3)
    x = rng.random((600, 784), dtype=np.float32)
    y = rng.integers(0, 10, 600)
    return Dataset(x[:500], y[:500], x[500:], y[500:], "random")


def test_plots_have_one_panel_per_clients_and_partition(tmp_path):
    """The full grid has two n and two partitions: each plot gets a 2 x 2 grid of panels, every panel
    with its own curves (not only the last n and first partition)."""
    import matplotlib.image as mpimg

    from flwr_inca.study.report import plot

    def table(clients, partitions):
        return {"table": [
            {"method": m, "clients": n, "partition": p, "epsilon": e, "gamma": g, "accuracy": 0.8 + 0.01 * e,
             "spread": 0.0}
            for m in ("fedavg", "inca") for n in clients for p in partitions for e, g in ((1.0, 0.1), (4.0, 0.1))]}

    sizes = {}
    for name, clients, partitions in (("one", (8,), ("iid",)), ("four", (8, 16), ("iid", "dirichlet:0.5"))):
        out = tmp_path / name
        out.mkdir()
        grid = StudyGrid(clients=clients, partitions=partitions, methods=("fedavg", "inca"), epsilons=(1.0, 4.0))
        plot(table(clients, partitions), grid, out)
        image = mpimg.imread(out / "accuracy_vs_epsilon.png")
        sizes[name] = image.shape[:2]
    assert sizes["four"][0] == pytest.approx(2 * sizes["one"][0], rel=0.02)
    assert sizes["four"][1] == pytest.approx(2 * sizes["one"][1], rel=0.02)
    coloured = np.ptp(image[..., :3], axis=2) > 0.3  # the curves; axes and text are grey
    h, w = coloured.shape
    for quadrant in (coloured[: h // 2, : w // 2], coloured[: h // 2, w // 2:], coloured[h // 2:, : w // 2],
                     coloured[h // 2:, w // 2:]):
        assert quadrant.sum() > 50


def _seeded_summary(methods=("fedavg", "inca")):
    """A summary of two seeds per point: accuracy and its spread (std over the seeds) per (method, epsilon)."""
    return {"table": [
        {"method": m, "clients": 8, "partition": "iid", "epsilon": e, "gamma": 0.1, "runs": 2,
         "accuracy": 0.6 + 0.05 * i + 0.01 * e, "spread": 0.01 * (i + 1) * e}
        for i, m in enumerate(methods) for e in (1.0, 4.0)]}


def test_study_plots_draw_the_spread_over_seeds_as_error_bars_and_symbols_for_epsilon_and_gamma():
    """Each point's bar is +-1 spread (the table's std over seeds), in percent; the axes and titles write
    epsilon, gamma and delta as symbols."""
    pytest.importorskip("matplotlib")
    from matplotlib.container import ErrorbarContainer

    from flwr_inca.study.report import figures

    summary = _seeded_summary()
    grid = StudyGrid(clients=(8,), partitions=("iid",), methods=("fedavg", "inca"), epsilons=(1.0, 4.0))
    (name, fig), _ = figures(summary, grid)
    assert name == "accuracy_vs_epsilon"
    ax = fig.axes[0]
    bars = sorted((seg[0][1], seg[1][1]) for c in ax.containers if isinstance(c, ErrorbarContainer)
                  for seg in c.lines[2][0].get_segments())
    expected = sorted((100 * (r["accuracy"] - r["spread"]), 100 * (r["accuracy"] + r["spread"]))
                      for r in summary["table"])
    np.testing.assert_allclose(bars, expected, rtol=1e-12)
    assert ax.get_xlabel().startswith(r"$\varepsilon$") and r"$\delta = 10^{-5}$" in ax.get_xlabel()
    assert r"$\gamma = 0.1$" in ax.get_title() and "2 seeds" in ax.get_title()


def test_replot_redraws_png_and_svg_from_results_json_and_names_a_bad_file(tmp_path, capsys):
    """``flwr-inca study mnist --replot --out DIR`` redraws both plots (PNG and SVG) from DIR/results.json,
    running nothing; a folder without a study's results: exit 2, one line naming --replot and the file."""
    pytest.importorskip("matplotlib")
    from dataclasses import asdict

    from flwr_inca.cli import main

    grid = StudyGrid(clients=(8,), partitions=("iid",), methods=("fedavg", "inca"), epsilons=(1.0, 4.0))
    (tmp_path / "results.json").write_text(json.dumps({**_seeded_summary(), "grid": asdict(grid)}))
    assert main(["study", "mnist", "--replot", "--out", str(tmp_path)]) == 0
    for name in ("accuracy_vs_epsilon", "accuracy_vs_gamma"):
        assert (tmp_path / f"{name}.png").stat().st_size > 5000
        assert (tmp_path / f"{name}.svg").read_text().startswith("<?xml")
    assert str(tmp_path / "accuracy_vs_gamma.svg") in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["study", "mnist", "--replot", "--out", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--replot" in err[0] and str(empty / "results.json") in err[0]
    assert list(empty.iterdir()) == []


@pytest.mark.parametrize("clients,partitions", [((8,), ("iid",)), ((8,), ("iid", "dirichlet:0.5")),
                                                ((8, 16), ("iid", "dirichlet:0.5"))])
def test_the_legend_of_every_method_fits_below_the_panels_without_covering_their_labels(clients, partitions):
    """All eight methods (three legend rows at three columns covered the x-axis label in the n = 1000 plots):
    the legend lies inside the figure and below every panel's x-axis label and tick labels."""
    import matplotlib.pyplot as plt

    from flwr_inca.study.grid import METHODS
    from flwr_inca.study.report import figures

    methods = tuple(METHODS)
    summary = {"table": [
        {"method": m, "clients": n, "partition": p, "epsilon": e, "gamma": g, "accuracy": 0.5 + 0.05 * i,
         "spread": 0.01}
        for i, m in enumerate(methods) for n in clients for p in partitions for e, g in ((1.0, 0.1), (4.0, 0.1))]}
    grid = StudyGrid(clients=clients, partitions=partitions, methods=methods, epsilons=(1.0, 4.0))
    for name, fig in figures(summary, grid):
        fig.canvas.draw()  # the axis labels take their places at draw time
        renderer = fig.canvas.get_renderer()
        legend = fig.legends[0].get_window_extent(renderer)
        width, height = fig.bbox.width, fig.bbox.height
        assert legend.x0 >= 0 and legend.y0 >= 0 and legend.x1 <= width and legend.y1 <= height, name
        assert len(fig.legends[0].get_texts()) == len(methods)
        for ax in fig.axes:
            below = [ax.xaxis.label.get_window_extent(renderer)] + [
                t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
            assert legend.y1 <= min(b.y0 for b in below) + 1, (name, clients, partitions)
        plt.close(fig)


@pytest.mark.parametrize("name", ["default", "full"])
def test_every_grid_certifies_every_inca_round_and_calibrates_on_60_executions_at_0_9(name):
    """docs/results.md, "30% dropouts": at n = 1000 the default grid had calibrated IncA on 3 executions (success
    share 1) and certified every 10th round, charging the rounds between the largest certified mu so far; at
    gamma = 0.3 training stopped after 20 of 25 rounds (benchmarks/study_round_cost.py: in the same way after
    12 of 25 at gamma = 0.1 in one of four sequences). Every grid now uses the n <= 300 rule at every n."""
    from flwr_inca.study import DEFAULT_GRID, FULL_GRID

    grid = {"default": DEFAULT_GRID, "full": FULL_GRID}[name]
    for n in sorted(set(grid.clients) | {100, 1000, 10_000}):
        assert grid.inca_settings(n) == (60, 0.9, 1), (name, n)


def test_study_inca_at_large_n_trains_every_round_when_an_early_round_certifies_high(monkeypatch):
    """The grid's IncA rule above small_clients, in a study run at a small scale (12 clients, 30% dropouts):
    round 1's execution certifies at 1.25x the per-round target and every later one at 0.85x (a scripted
    certificate; the noise, traces, ledger and budget guard are the real ones). Charged its own certificate,
    every round fits the budget and trains."""
    from dataclasses import replace

    from flwr_inca.privacy.rounds import RoundCertificate
    from flwr_inca.simulation.mixers import IncaMixer
    from flwr_inca.study import DEFAULT_GRID, FULL_GRID

    def scripted(self, trace, round, seed, finals=None):
        return RoundCertificate(self.context.mu_round * (1.25 if round == 1 else 0.85), ("exact",))

    monkeypatch.setattr(IncaMixer, "certificate", scripted)
    assert DEFAULT_GRID.inca_settings(1000) == FULL_GRID.inca_settings(1000)  # one rule: one grid tested
    base = FULL_GRID
    # the grid's own IncA rule at n > small_clients, at a test's scale
    grid = replace(base, clients=(12,), small_clients=4, iterations=3, validation=100, batch_size=10,
                   calibration_runs=min(base.calibration_runs, 12))
    assert grid.inca_settings(12)[1:] == base.inca_settings(1000)[1:]
    data = split_data(_dataset_784(), grid)
    rounds = 10

    def train(g):
        return run_one(data, g, "inca", 12, "iid", 1.0, 0.3, 0, 1.0, 1.0, rounds, "test", CalibrationCache(g))

    now = train(grid)
    assert now.rounds_done == rounds, now.note
    assert now.rounds_refused == 0 and 0.9 < now.epsilon_spent <= 1.0  # the budget spent, never exceeded


def test_study_run_counts_rounds_refused_by_the_budget_and_trains_on(monkeypatch, tmp_path):
    """One outlier execution (round 3 certifies at 3x the per-round target; a scripted certificate, the
    noise, traces, ledger and guard are real): the round is refused, charged what it revealed and skipped;
    the run trains every other round, and its row says so (rounds_done, rounds_refused, note)."""
    from dataclasses import replace

    from flwr_inca.privacy.rounds import RoundCertificate
    from flwr_inca.rounds import IncaRounds

    class Scripted:
        """A round's certificates, scripted: round 3 at 3x the per-round target, the others at 0.85x."""

        def __init__(self, rounds, trace, round):
            self.cost = rounds.mu_target * (3.0 if round == 3 else 0.85)

        def with_finals(self, finals=None):
            return RoundCertificate(self.cost, ("exact",))

        def through(self, t):
            return RoundCertificate(self.cost * 0.5, ("exact",))

    monkeypatch.setattr(IncaRounds, "prefix", lambda self, trace, round: Scripted(self, trace, round))
    grid = replace(TINY_GRID, clients=(12,), iterations=3, validation=100, small_calibration_runs=6)
    res = run_one(split_data(_dataset_784(), grid), grid, "inca", 12, "iid", 1.0, 0.25, 0, 1.0, 1.0, 6, "test",
                  CalibrationCache(grid))
    assert (res.rounds_done, res.rounds_refused) == (5, 1), res.note
    assert res.note == "1 round(s) refused by the budget and skipped (round(s) 3)"
    assert 0 < res.epsilon_spent <= 1.0
    assert skipped_note({"rounds_refused": 1, "rounds": 6}) == " (1 of 6 rounds skipped: refused by the budget)"
    assert skipped_note({"rounds_refused": ""}) == skipped_note({"rounds_refused": 0}) == ""
    # the study's progress line says it once: the note (with the round numbers), not the count again
    one = replace(grid, methods=("inca",), epsilons=(1.0,), gammas=(0.25,), tune_rounds=(6,), seeds=(0,))
    lines = []
    run_study(_dataset_784(), one, tmp_path, log=lines.append)
    runs = [line for line in lines if "refused by the budget" in line]
    assert runs and all(line.count("refused by the budget") == 1 for line in runs), runs
    assert "(round(s) 3)" in runs[0]


def test_resume_refuses_a_runs_file_with_other_columns_naming_it_and_touching_nothing(tmp_path, capsys):
    """The package has one format of runs.csv: a file with other columns (one fewer, or one this version does
    not know) is not migrated but refused, with one line naming the file and what differs, and left as it
    was (the CLI: exit 2); rows appended to it would not line up with its header."""
    from dataclasses import replace

    from flwr_inca.cli import main
    from flwr_inca.study.runs import FIELDS

    grid = replace(TINY_GRID, methods=("fedavg",), epsilons=(1.0,), gammas=(0.0,), tune_lr=(0.5,), tune_clip=(1.0,),
                   tune_rounds=(2,), validation=200, train_examples=None, test_examples=None)
    data = _dataset()
    run_study(data, grid, tmp_path, log=lambda s: None)
    rows = list(csv.DictReader((tmp_path / "runs.csv").open()))
    fewer = [f for f in FIELDS if f != "rounds_refused"]
    for name, header, words in (("runs.csv.partial", fewer, "lacks ['rounds_refused']"),
                                ("runs.csv", FIELDS + ["future_column"], "has unknown ['future_column']")):
        with (tmp_path / name).open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        with pytest.raises(ValueError) as info:
            run_study(data, replace(grid, seeds=(5,)), tmp_path, resume=True, log=lambda s: None)
        message = str(info.value)
        assert message.startswith(f"{tmp_path / name}: ") and words in message and "\n" not in message
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing touched
        if name == "runs.csv.partial" and (MNIST / "train-images-idx3-ubyte.gz").exists():
            capsys.readouterr()
            assert main(["study", "mnist", "--grid", "tiny", "--out", str(tmp_path), "--resume",
                         "--data-dir", str(MNIST)]) == 2
            err = capsys.readouterr().err.strip()
            assert "\n" not in err and name in err and words in err
        (tmp_path / name).unlink()


def test_a_study_stopped_while_replacing_runs_csv_leaves_it_whole_and_no_temporary_file(tmp_path, monkeypatch):
    """runs.csv is replaced by the package's atomic write (a temporary file, fsynced, renamed): a study
    stopped while writing it leaves the earlier runs.csv and the partial file as they were, and no
    temporary file beside them."""
    from dataclasses import replace

    grid = replace(TINY_GRID, methods=("fedavg",), epsilons=(1.0,), gammas=(0.0,), tune_lr=(0.5,), tune_clip=(1.0,),
                   tune_rounds=(2,), validation=200, train_examples=None, test_examples=None)
    data = _dataset()
    run_study(data, grid, tmp_path, log=lambda s: None)
    first = (tmp_path / "runs.csv").read_bytes()
    files = {p.name for p in tmp_path.iterdir()}
    real = csv.DictWriter.writerows

    def stops_midway(self, rows):  # the first half of the rows written, then the study is stopped
        rows = list(rows)
        real(self, rows[: len(rows) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(csv.DictWriter, "writerows", stops_midway)
    with pytest.raises(KeyboardInterrupt):
        run_study(data, replace(grid, seeds=(5,)), tmp_path, resume=True, log=lambda s: None)
    assert (tmp_path / "runs.csv").read_bytes() == first
    partial = list(csv.DictReader((tmp_path / "runs.csv.partial").open()))
    assert partial and {r["seed"] for r in partial} == {"5"}  # this study's runs, kept for --resume
    assert {p.name for p in tmp_path.iterdir()} == files | {"runs.csv.partial"}  # no temporary file


def test_the_command_line_overrides_reach_the_grid(monkeypatch, tmp_path):
    """Every override of ``flwr-inca study`` lands in the grid the study runs (here the full grid's tuning
    narrowed to one setting, tuned at another dropout rate, with a larger T allowed)."""
    import types

    from flwr_inca.cli import main
    from flwr_inca.simulation import data as data_module
    from flwr_inca.study import FULL_GRID, command, mnist

    got = {}
    monkeypatch.setattr(data_module, "load_mnist", lambda d: types.SimpleNamespace(features=784, name="fake"))
    monkeypatch.setattr(mnist, "run_study", lambda dataset, grid, out, resume: got.update(grid=grid) or {"table": []})
    monkeypatch.setattr(command, "markdown_table", lambda table: "")
    argv = ["study", "mnist", "--grid", "full", "--out", str(tmp_path / "out"), "--clients", "1000",
            "--gammas", "0.3", "--methods", "inca", "--tune-lr", "8", "--tune-clip", "1", "--tune-rounds", "50",
            "--tune-gamma", "0.3", "--tune-epsilon", "0.5", "--max-iterations", "80"]
    assert main(argv) == 0
    grid = got["grid"]
    assert (grid.tune_lr, grid.tune_clip, grid.tune_rounds, grid.tune_gamma) == ((8.0,), (1.0,), (50,), 0.3)
    assert grid.tune_epsilon == 0.5
    assert (grid.max_iterations, grid.clients, grid.gammas, grid.methods) == (80, (1000,), (0.3,), ("inca",))
    assert grid.epsilons == FULL_GRID.epsilons and grid.product  # what was not overridden stays the full grid's
