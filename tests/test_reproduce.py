"""``flwr-inca reproduce``: each figure's pipeline at a tiny scale, the helpers against brute force,
and the command line's errors. The paper-scale runs are marked slow."""

from __future__ import annotations

import csv
import io
import math

import numpy as np
import pytest

from flwr_inca import cli
from flwr_inca.privacy import analyze_structure, random_collusion
from flwr_inca.protocol import IncaConfig, sample_trace
from flwr_inca.reproduce import FIGURES, fig1, fig2, fig3, fig5, reproduce
from flwr_inca.reproduce.common import ProgressBar


@pytest.fixture
def tiny(monkeypatch):
    """Every figure shrunk to seconds: fewer parties, points and settings."""
    monkeypatch.setattr(fig1, "N", 64)
    monkeypatch.setattr(fig1, "RHOS", (0.0, 0.25, 0.5))
    monkeypatch.setattr(fig1, "MEASURED_RHOS", (0.0, 0.5))
    monkeypatch.setattr(fig1, "ITERATIONS", 8)
    monkeypatch.setattr(fig1, "DIM", 4)
    monkeypatch.setattr(fig2, "PARTIES", (30, 60))
    monkeypatch.setattr(fig2, "RHOS", (0.1, 0.5))
    monkeypatch.setattr(fig3, "N", 40)
    monkeypatch.setattr(fig3, "GAMMAS", (0.1, 0.2))
    monkeypatch.setattr(fig3, "TOPOLOGIES_3A", ((1, 4), (2, 6)))
    monkeypatch.setattr(fig3, "GOPA_NEIGHBORS", 4)
    monkeypatch.setattr(fig3, "DIM", 2)
    monkeypatch.setattr(fig5, "KS", (1, 2))
    monkeypatch.setattr(fig5, "TS", (2, 6))


def _csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_every_figure_pipeline_writes_csv_png_and_table(tiny, tmp_path):
    out = io.StringIO()
    results = reproduce(["all"], runs=2, out=tmp_path, seed=1, progress=False, stream=out)
    assert [r.figure for r in results] == [name for name, f in FIGURES.items() if f.in_all]  # not the frontier
    text = out.getvalue()
    for r in results:
        assert (tmp_path / f"{r.figure}.png").stat().st_size > 5000
        assert (tmp_path / f"{r.figure}.txt").read_text().startswith(f"== {r.title}")
        rows = _csv(tmp_path / f"{r.figure}.csv")
        assert len(rows) == len(r.rows) > 0 and list(rows[0]) == r.columns
        assert r.checks and r.title in text
    by = {r.figure: r for r in results}
    assert len(by["fig1"].rows) == 3 and len(by["fig2"].rows) == 4 and len(by["fig5"].rows) == 3 * 2 * 2
    fig3b = [row for row in by["fig3b"].rows if row.get("figure") == "3b"]
    assert {row["protocol"] for row in fig3b} == {"IncA k=1 T=20", "GOPA gamma_2=gamma/2", "GOPA gamma_2=gamma/4",
                                                  "GOPA gamma_2=1/n", "CorDP-DME"}
    assert len(fig3b) == 2 * 5 * 2  # gammas x protocols x procedures
    # each IncA curve twice, and the measured MSE of the paper's calibration is about 1.3x the formula
    f1 = {row["rho"]: row for row in by["fig1"].rows}
    assert all(math.isfinite(f1[rho][f"inca_{p}_mse"]) for rho in (0.0, 0.5) for p in ("paper", "exact"))
    assert f1[0.5]["inca_paper_sigma_star"] ** 2 == pytest.approx(
        1.3 * 2 * math.log(1.25e5) / (0.5 * 64 * 0.01))
    assert math.isnan(f1[0.25]["inca_paper_mse"])
    cordp = [row for row in fig3b if row["protocol"] == "CorDP-DME"]
    assert all(row["noise_lower_bound"] > 0 for row in cordp)


def test_reproduction_is_deterministic(tiny, tmp_path):
    a = reproduce(["fig3b"], runs=2, out=tmp_path / "a", seed=5, progress=False, stream=io.StringIO())
    b = reproduce(["fig3b"], runs=2, out=tmp_path / "b", seed=5, progress=False, stream=io.StringIO())
    assert (tmp_path / "a" / "fig3b.csv").read_text() == (tmp_path / "b" / "fig3b.csv").read_text()
    c = reproduce(["fig3b"], runs=2, out=tmp_path / "c", seed=6, progress=False, stream=io.StringIO())
    assert [r["mse"] for r in a[0].rows] == [r["mse"] for r in b[0].rows] != [r["mse"] for r in c[0].rows]


def test_figures_3a_and_3b_share_the_inca_runs(monkeypatch, tiny, tmp_path):
    monkeypatch.setattr(fig3, "TOPOLOGIES_3A", ((1, 20),))
    calls = []
    original = fig3.calibrate_and_measure
    monkeypatch.setattr(fig3, "calibrate_and_measure", lambda *a, **k: calls.append(a[0].name) or original(*a, **k))
    results = reproduce(["fig3a", "fig3b"], runs=2, out=tmp_path, progress=False, stream=io.StringIO())
    assert calls.count("IncA") == 2  # one per gamma, not two
    inca = [[r["mse"] for r in res.rows if r.get("protocol", "").startswith("IncA k=1 T=20")] for res in results]
    assert inca[0] == inca[1]


def test_first_connected_iteration_is_the_precondition():
    for n, rho, seed in ((24, 0.3, 0), (30, 0.5, 1), (40, 0.1, 2)):
        trace = sample_trace(n, fig2._config(12), seed)
        corrupted = random_collusion(trace, rho, seed + 9).corrupted
        first = fig2.first_connected_iteration(trace, corrupted)
        assert first is not None
        for T in range(max(1, first - 2), min(12, first + 2) + 1):
            short = sample_trace(n, fig2._config(T), seed)  # the same topology, cut at T
            view = random_collusion(short, rho, seed + 9)
            assert np.array_equal(view.corrupted, corrupted)
            assert analyze_structure(short, view).rank_condition == (T >= first), (n, rho, T, first)


def test_expected_isolated_matches_simulation():
    n, rho, T = 40, 0.5, 4
    expected = fig2.expected_isolated(n, rho, T)
    assert 0.05 < expected < 2
    runs, isolated = 600, 0
    for r in range(runs):
        trace = sample_trace(n, fig2._config(T), r)
        C = random_collusion(trace, rho, 10_000 + r).corrupted
        honest = np.setdiff1d(np.arange(n), C)
        touched = np.zeros(n, dtype=bool)
        for step in trace.steps:
            m = step.messages
            hh = np.isin(m.senders, honest) & np.isin(m.receivers, honest)
            touched[m.senders[hh]] = touched[m.receivers[hh]] = True
        isolated += int((~touched[honest]).sum())
    assert isolated / runs == pytest.approx(expected, rel=0.25)


def test_paper_reading_of_eavesdropping_sees_half_the_senders():
    trace = sample_trace(100, IncaConfig(sigma_star=1, sigma_delta=1, iterations=4, neighbors=3), 0)
    view = fig5.eavesdrop_senders(trace, 0.5, seed=1)
    assert view.observed[:4].sum(axis=1).tolist() == [50, 50, 50, 50]
    assert view.observed[4].all()  # the finals are public
    copies = fig5.view_for("eavesdrop-copies", trace, 1)
    assert copies.observed[:4].sum() > view.observed[:4].sum()  # any of k copies reveals a message


def test_progress_bar_reports_to_a_stream():
    stream = io.StringIO()
    bar = ProgressBar(10, "figX", stream=stream)
    for i in range(10):
        bar.advance(status=f"step {i}")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[-1].startswith("figX [####################] 100% step 9")
    assert len(lines) == 10  # one per tenth (not a terminal), the last not repeated


def test_progress_bar_total_can_change_as_the_work_becomes_known():
    """A plan whose size is known step by step (the study: runs found done, rounds tuned): the share and
    the time left count the new total; done units never exceed it."""
    stream = io.StringIO()
    bar = ProgressBar(100, "study", stream=stream, lines=True)
    bar.advance(25, "a")
    assert bar.line().split("] ")[1].startswith(" 25% a")
    bar.set_total(50)  # half of the work turned out to be done already
    bar.advance(0, "b")
    assert bar.line().split("] ")[1].startswith(" 50% b")
    bar.set_total(10)
    assert bar.done == bar.total == 10
    bar.set_total(0)
    assert bar.total == 1 and bar.done == 1
    assert len(stream.getvalue().splitlines()) == 2  # one line per advance


def test_cli_reproduce_runs_and_rejects_bad_arguments(tiny, tmp_path, capsys):
    assert cli.main(["reproduce", "fig2", "--runs", "2", "--out", str(tmp_path), "--no-progress"]) == 0
    assert (tmp_path / "fig2.csv").exists() and "Fig. 2" in capsys.readouterr().out
    for argv, needle in ((["reproduce", "fig4"], "argument figure"),
                         (["reproduce", "fig1", "--runs", "0"], "argument --runs"),
                         (["reproduce", "fig1", "--runs", "many"], "argument --runs"),
                         (["reproduce", "fig1", "--seed", "-1"], "argument --seed")):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err
    afile = tmp_path / "file.txt"
    afile.write_text("x")
    assert cli.main(["reproduce", "fig2", "--runs", "1", "--out", str(afile)]) == 2
    assert "--out" in capsys.readouterr().err


def test_reproduce_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="figure must be one of"):
        reproduce(["fig6"], out=tmp_path)
    with pytest.raises(ValueError, match="runs"):
        reproduce(["fig1"], runs=0, out=tmp_path)
    with pytest.raises(ValueError, match="seed"):
        reproduce(["fig1"], seed=-2, out=tmp_path)


# ---------------------------------------------------------------------------------------- paper scale
@pytest.mark.slow
def test_default_reproduction_meets_the_papers_numbers(tmp_path):
    """``flwr-inca reproduce all`` at its default run counts (about 15 minutes on 2 cores)."""
    results = {r.figure: r for r in reproduce(["all"], out=tmp_path, progress=False, stream=io.StringIO())}
    fig1_checks = results["fig1"].checks
    assert all(c.holds for c in fig1_checks[:4])  # 0.002238, 0.00747, 2.292, >= 0.1764
    assert results["fig2"].checks[0].holds  # slightly more than 15 for 1e5 runs at n = 5000
    f5 = {c.claim.split("(")[-1].rstrip(")"): c for c in results["fig5"].checks}
    assert f5["5a"].holds and f5["5b"].holds and f5["5c"].holds
    assert all(r["agreement"] == 1.0 for r in results["fig5"].rows)  # precondition <=> exact floor
    f3b = results["fig3b"].checks
    assert all(c.holds for c in f3b if c.claim.startswith("CorDP-DME worst"))
