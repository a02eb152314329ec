"""``flwr-inca reproduce``: each figure's pipeline at a tiny scale, the helpers against brute force,
and the command line's errors. The paper-scale runs are marked slow."""

from __future__ import annotations

import csv
import io
import math
import re
import subprocess
import sys
from pathlib import Path

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


@pytest.fixture
def drawn(monkeypatch):
    """``{file name: figure}`` of every figure the plots save (still written), to look inside."""
    pytest.importorskip("matplotlib")
    from flwr_inca import _plots

    figures = {}
    save = _plots.save_figure

    def keep(fig, path, **options):
        figures[Path(path).name] = fig
        return save(fig, path, **options)

    monkeypatch.setattr(_plots, "save_figure", keep)
    return figures


def _words_outside_math(fig) -> list[str]:
    """Names of symbols written out in words (``gamma``, ``eps``...) in any text of ``fig``, outside ``$...$``."""
    from matplotlib.text import Text

    found = []
    for text in fig.findobj(Text):
        plain = re.sub(r"\$[^$]*\$", "", text.get_text())
        found += re.findall(r"\b(?:eps|epsilon|gamma\w*|sigma\w*|delta|rho|alpha|mu)\b", plain)
    return found


PAPER_FIGURE = {"fig1": "Fig. 1", "fig2": "Fig. 2", "fig3a": "Fig. 3a", "fig3b": "Fig. 3b", "fig5": "Fig. 5"}


def test_every_figure_pipeline_writes_csv_png_svg_and_table(tiny, tmp_path, drawn):
    out = io.StringIO()
    results = reproduce(["all"], runs=2, out=tmp_path, seed=1, progress=False, stream=out)
    assert [r.figure for r in results] == [name for name, f in FIGURES.items() if f.in_all]  # not the frontier
    text = out.getvalue()
    for r in results:
        assert (tmp_path / f"{r.figure}.png").stat().st_size > 5000
        svg = (tmp_path / f"{r.figure}.svg").read_text()
        assert svg.startswith("<?xml") and "<svg" in svg
        # the plot names the paper's figure it reproduces (matplotlib keeps each text as a comment)
        assert f"Reproduces {PAPER_FIGURE[r.figure]} of Sabater et al., PoPETs 2026" in svg
        table = (tmp_path / f"{r.figure}.txt").read_text()
        assert table.startswith(f"== {r.title}")
        assert f"{tmp_path / r.figure}.png, {tmp_path / r.figure}.svg" in table
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
    # symbols, not words: epsilon, gamma, sigma, delta, rho, alpha, mu in mathtext everywhere
    assert sorted(drawn) == sorted(f"{f}.png" for f, figure in FIGURES.items() if figure.in_all)
    for name, fig in drawn.items():
        assert _words_outside_math(fig) == [], name


def _error_bars(ax) -> list:
    """The (lower, upper) y of every error bar drawn in ``ax``."""
    from matplotlib.container import ErrorbarContainer

    bars = []
    for container in ax.containers:
        if isinstance(container, ErrorbarContainer) and container.has_yerr:
            for segments in container.lines[2]:
                bars += [(seg[0][1], seg[1][1]) for seg in segments.get_segments()]
    return bars


def test_measured_mse_points_carry_their_standard_error_and_the_plots_draw_it(tiny, tmp_path, drawn):
    """Figs. 1 and 3: every measured MSE has its standard error over the runs in the CSV, and the plots
    draw it as an error bar of +-1 standard error around the point."""
    results = {r.figure: r for r in reproduce(["fig1", "fig3b"], runs=3, out=tmp_path, seed=2, progress=False,
                                              stream=io.StringIO())}
    f1 = _csv(tmp_path / "fig1.csv")
    for proc in ("paper", "exact"):
        for row in f1:
            mse, stderr = float(row[f"inca_{proc}_mse"]), float(row[f"inca_{proc}_mse_stderr"])
            assert math.isnan(mse) == math.isnan(stderr)
            assert math.isnan(stderr) or 0 < stderr < mse
    f3 = [r for r in _csv(tmp_path / "fig3b.csv") if r["figure"] == "3b"]
    assert f3 and all(0 < float(r["mse_stderr"]) < float(r["mse"]) for r in f3)
    # the bars: one per measured point, from mse - stderr (on the log axis: at most 95% down) to mse + stderr
    def bar(mse, stderr):
        return (mse - min(stderr, 0.95 * mse), mse + stderr)

    measured = [bar(r[f"inca_{p}_mse"], r[f"inca_{p}_mse_stderr"]) for p in ("paper", "exact")
                for r in results["fig1"].rows if math.isfinite(r[f"inca_{p}_mse"])]
    np.testing.assert_allclose(sorted(_error_bars(drawn["fig1.png"].axes[0])), sorted(measured), rtol=1e-12)
    expected = [bar(r["mse"], r["mse_stderr"]) for r in results["fig3b"].rows
                if r.get("figure") == "3b" and r["procedure"] == "paper"]
    np.testing.assert_allclose(sorted(_error_bars(drawn["fig3b.png"].axes[0])), sorted(expected), rtol=1e-12)


def test_fig5_success_shares_carry_their_standard_error_and_each_panel_its_legend(tiny, tmp_path, drawn):
    """Fig. 5: the binomial standard error of each success share, a band of +-1 of it, and in every panel a
    legend naming k and both markers; the exact markers are drawn above the precondition's, smaller and of
    another shape, so both show where they coincide."""
    (result,) = reproduce(["fig5"], runs=5, out=tmp_path, seed=3, progress=False, stream=io.StringIO())
    for row in _csv(tmp_path / "fig5.csv"):
        runs = int(row["runs"])
        for column in ("precondition_success", "exact_floor_success"):
            successes = round(float(row[column]) * runs)
            spread = math.sqrt(sum((float(i < successes) - successes / runs) ** 2 for i in range(runs)) / runs)
            assert float(row[f"{column}_stderr"]) == pytest.approx(spread / math.sqrt(runs), abs=1e-12)
    fig = drawn["fig5.png"]
    assert "Reproduces Fig. 5 of Sabater et al., PoPETs 2026" in fig.get_suptitle()
    assert len(fig.axes) == 4
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        labels = [t.get_text() for t in legend.get_texts()]
        assert labels == [f"$k = {k}$" for k in fig5.KS] + ["precondition", "exact certificate"]
        pre = [line for line in ax.get_lines() if line.get_marker() == "o"]
        exact = [line for line in ax.get_lines() if line.get_marker() == "x"]
        assert len(pre) == len(exact) == len(fig5.KS)
        for p, e in zip(pre, exact):
            assert e.get_zorder() > p.get_zorder() and p.get_markersize() > e.get_markersize()
            assert p.get_markerfacecolor() == "white"  # hollow: the cross inside stays visible
        assert len(ax.collections) == len(fig5.KS)  # one +-1 standard error band per k
    assert result.rows[0]["precondition_success_stderr"] >= 0


def test_fig2_tells_measured_cells_from_extrapolated_ones(tiny, tmp_path, drawn):
    """Fig. 2: measured cells (filled markers, solid lines) and extrapolated ones (hollow markers, dashed),
    the legend saying which is which, and the spread of the runs shaded."""
    reproduce(["fig2"], runs=4, out=tmp_path, seed=1, progress=False, stream=io.StringIO())
    fig = drawn["fig2.png"]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(label.startswith("measured: smallest $T$") for label in labels)
    assert any(label.startswith("extrapolated:") for label in labels)
    assert any("spread" in label for label in labels)
    panels = [ax for ax in fig.axes if ax.get_lines()]
    assert len(panels) == len(fig2.PARTIES)
    for ax in panels:
        measured = [line for line in ax.get_lines() if line.get_marker() == "o"]
        extrapolated = [line for line in ax.get_lines() if line.get_marker() == "s"]
        assert len(measured) == len(extrapolated) == 1
        assert measured[0].get_linestyle() == "-" and measured[0].get_markerfacecolor() != "white"
        assert extrapolated[0].get_linestyle() == "--" and extrapolated[0].get_markerfacecolor() == "white"
        assert len(ax.collections) == 1  # the band: median to 99th percentile of the runs


def test_plots_need_no_matplotlib_to_import_and_reproduce_writes_the_csv_without_it(tmp_path):
    """matplotlib is optional: the package and its plotting modules import without it, and a reproduction
    writes its CSV and table (no PNG, a note saying why)."""
    code = (
        "import io, sys\n"
        "sys.modules['matplotlib'] = None\n"  # any import of it now fails
        "import flwr_inca, flwr_inca._plots, flwr_inca.reproduce, flwr_inca.study.report\n"
        "import flwr_inca.privacy.attack, flwr_inca.simulation.history\n"
        "from flwr_inca._plots import have_matplotlib\n"
        "from flwr_inca.reproduce import fig2, reproduce\n"
        "assert not have_matplotlib()\n"
        "fig2.PARTIES, fig2.RHOS = (20,), (0.1,)\n"
        "out = io.StringIO()\n"
        f"reproduce(['fig2'], runs=2, out={str(tmp_path)!r}, progress=False, stream=out)\n"
        "assert 'matplotlib is not installed' in out.getvalue()\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "fig2.csv").exists() and not (tmp_path / "fig2.png").exists()
    assert not (tmp_path / "fig2.svg").exists()


def test_reproduction_is_deterministic(tiny, tmp_path):
    # the numbers, not the plots (test_every_figure_pipeline_writes_csv_png_svg_and_table draws them)
    quiet = {"runs": 2, "progress": False, "plots": False}
    a = reproduce(["fig3b"], out=tmp_path / "a", seed=5, stream=io.StringIO(), **quiet)
    b = reproduce(["fig3b"], out=tmp_path / "b", seed=5, stream=io.StringIO(), **quiet)
    assert (tmp_path / "a" / "fig3b.csv").read_text() == (tmp_path / "b" / "fig3b.csv").read_text()
    c = reproduce(["fig3b"], out=tmp_path / "c", seed=6, stream=io.StringIO(), **quiet)
    assert [r["mse"] for r in a[0].rows] == [r["mse"] for r in b[0].rows] != [r["mse"] for r in c[0].rows]


def test_figures_3a_and_3b_share_the_inca_runs(monkeypatch, tiny, tmp_path):
    monkeypatch.setattr(fig3, "TOPOLOGIES_3A", ((1, 20),))
    calls = []
    original = fig3.calibrate_and_measure
    monkeypatch.setattr(fig3, "calibrate_and_measure", lambda *a, **k: calls.append(a[0].name) or original(*a, **k))
    results = reproduce(["fig3a", "fig3b"], runs=2, out=tmp_path, progress=False, stream=io.StringIO(),
                        plots=False)
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


def test_progress_bar_in_a_log_also_reports_slow_work_between_tenths():
    """Off a terminal a long unit of work prints a line once ``heartbeat`` seconds have passed, not only at
    each tenth (heartbeat 0: after every unit that moved the bar; a status change alone prints nothing)."""
    stream = io.StringIO()
    bar = ProgressBar(100, "frontier", stream=stream, heartbeat=0.0)
    bar.advance(status="a")
    bar.advance()
    bar.set_status("b")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert [line.split("] ")[1][:7] for line in lines] == ["  1% a ", "  2% a ", "100% b "]


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
