"""``flwr-inca reproduce frontier`` at a tiny scale: the files it writes, how it counts messages, and
that its IncA points are the product's ``calibrate`` (both epsilons on one set of executions)."""

from __future__ import annotations

import csv
import io
import math

import numpy as np
import pytest

from flwr_inca import PermanentDropout, cli
from flwr_inca.baselines.pairwise import GOPA, CorDPDME
from flwr_inca.privacy import calibrate
from flwr_inca.privacy.calibration import simulation_seeds
from flwr_inca.reproduce import FIGURES, frontier, reproduce
from flwr_inca.reproduce.common import ProgressBar, single_blas_thread


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(frontier, "PARTIES", (30,))
    monkeypatch.setattr(frontier, "EPSILONS", (0.5, 1.0))
    monkeypatch.setattr(frontier, "GAMMAS", (0.0, 0.2))
    monkeypatch.setattr(frontier, "INCA_ITERATIONS", (4, 6))
    monkeypatch.setattr(frontier, "GOPA_NEIGHBORS", (4,))


def _csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_frontier_pipeline_writes_csv_plots_and_markdown(tiny, tmp_path):
    out = io.StringIO()
    (result,) = reproduce(["frontier"], runs=2, out=tmp_path, seed=3, progress=False, stream=out)
    assert result.figure == "frontier" and result.checks
    rows = _csv(tmp_path / "frontier.csv")
    assert len(rows) == len(result.rows) and list(rows[0]) == frontier.COLUMNS
    for name in ("frontier.png", "frontier-n30-eps0.5.png", "frontier-n30-eps1.png", "frontier-n30-eps0.5.svg",
                 "frontier-n30-eps1.svg"):
        assert (tmp_path / name).stat().st_size > 5000, name
    md = (tmp_path / "frontier.md").read_text()
    assert md.count("**n = 30, ε =") == 2 and "| IncA k=1 tail | 6 | 7.0 | 7 |" in md
    assert "frontier.md" in (tmp_path / "frontier.txt").read_text()
    by = {}
    for r in result.rows:
        by.setdefault(r["protocol"], []).append(r)
    # 2 gammas x 2 epsilons per configuration
    assert {p: len(v) for p, v in by.items()} == {
        "IncA k=1": 8, "IncA k=1 tail": 8, "IncA k=2": 8, "IncA k=2 tail": 8, "GOPA gamma_2=1/n": 4,
        "GOPA gamma_2=gamma/4": 4, "CorDP-DME": 4, "central DP": 4, "central DP (stayers)": 4}
    # the tail per k: L = 3 (k = 1) and 2 (k = 2), only where T > L
    assert {r["schedule"] for r in by["IncA k=1 tail"]} == {"incremental:tail=3"}
    assert {r["schedule"] for r in by["IncA k=2 tail"]} == {"incremental:tail=2"}
    for r in by["IncA k=2"]:
        assert r["messages_per_party"] == 2 * r["T"] + 1 and r["rounds"] == r["T"] + 1
        assert r["bytes_per_party"] == 16 * r["messages_per_party"]
        assert math.isfinite(r["predicted_mse"]) and r["success_fraction"] == 1.0
    for r in by["CorDP-DME"]:
        assert r["messages_per_party"] == pytest.approx(29 / 2 + 1) and r["rounds"] == 2
    for r in by["GOPA gamma_2=1/n"]:
        assert 4 < r["messages_per_party"] <= 4 + 2 and r["rounds"] == 3
    claims = [c.claim for c in result.checks]
    assert any("IncA k=1 tail (T = m) vs GOPA gamma_2 = 1/n" in c for c in claims)
    assert any("value-free tail (L = 3) vs D_Inc, k = 1" in c for c in claims)
    assert "What the frontier shows" in (tmp_path / "frontier.txt").read_text()
    cdp = {(r["epsilon"], r["gamma"]): r["predicted_mse"] for r in by["central DP"]}
    stay = {(r["epsilon"], r["gamma"]): r["predicted_mse"] for r in by["central DP (stayers)"]}
    assert cdp[(1.0, 0.0)] == stay[(1.0, 0.0)] < stay[(1.0, 0.2)] and cdp[(1.0, 0.2)] == cdp[(1.0, 0.0)]


def test_the_legend_names_every_series_of_any_panel():
    """A configuration run at one gamma only (merged pieces) is drawn in that panel alone; the figure's legend
    still names it, once, in the fixed series order."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    def row(gamma, protocol, messages, mse, **extra):
        return {"n": 30, "epsilon": 1.0, "gamma": gamma, "protocol": protocol, "messages_per_party": messages,
                "predicted_mse": mse, **extra}

    rows = [row(0.0, "IncA k=1", 11.0, 1e-3, T=10), row(0.1, "IncA k=1", 11.0, 2e-3, T=10),
            row(0.1, "IncA k=2", 21.0, 3e-3, T=10), row(0.0, "central DP", 1.0, 1e-4),
            row(0.1, "central DP", 1.0, 1e-4)]
    fig = frontier._figure(rows, [(30, 1.0)], [0.0, 0.1, 0.2])  # the last panel (0.2) is empty
    try:
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
    finally:
        plt.close(fig)
    assert labels == ["IncA $k$ = 1", "IncA $k$ = 2", "central DP"]


def test_frontier_is_not_part_of_all():
    assert "frontier" in FIGURES and not FIGURES["frontier"].in_all
    assert all(f.in_all for name, f in FIGURES.items() if name != "frontier")


def test_inca_points_are_the_products_calibration(tiny):
    bar = ProgressBar(1, "t", enabled=False)
    for tail, gamma in ((0, 0.2), (2, 0.2), (2, 0.0)):
        with single_blas_thread():
            rows = frontier.inca_rows(30, 5, 1, tail, gamma, 4, 7, bar)
        for row in rows:
            cal = calibrate(row["epsilon"], frontier.DELTA, 30, iterations=5, neighbors=1, collusion=frontier.RHO,
                            schedule=row["schedule"], runs=4, seed=frontier._seed(7, 30, 5, 1, gamma),
                            dropout=PermanentDropout(gamma) if gamma else None)
            assert (row["sigma_star"], row["alpha"]) == (cal.sigma_star, cal.alpha)
            assert row["sigma_delta"] == pytest.approx(cal.sigma_delta, rel=1e-12)
            assert row["predicted_mse"] == pytest.approx(cal.predicted_mse, rel=1e-12)


def test_progress_units_are_the_planned_total_and_weigh_inca_by_its_cost(tiny):
    """The bar advances exactly the units ``work`` planned (so its time left is an extrapolation of the whole),
    and an IncA execution counts more the more iterations and neighbours it certifies."""
    settings = {"iterations": [4, 6], "neighbors": [1, 2], "gammas": [0.2], "epsilons": [1.0]}
    planned = frontier.work(2, **settings)
    bar = ProgressBar(planned, "t", enabled=False)
    with single_blas_thread():
        frontier.run(2, 0, bar, **settings)
    assert bar.done == bar.total == planned
    units = [frontier.inca_units(T, k) for T, k in ((10, 1), (20, 1), (40, 1), (80, 1), (80, 2))]
    assert units == sorted(units) and units[0] >= 2 and units[-1] > 20 * units[0]
    assert frontier.inca_units(1, 1) == 1  # never 0: every execution moves the bar


def test_pairwise_messages_are_counted_per_edge_plus_publish_and_rollback():
    n, seeds = 25, simulation_seeds(4, 3)
    gopa = GOPA(1.0, 1.0, neighbors=4, gamma=0.2, gamma_rollback=0.04)
    messages, size, rounds = frontier.pairwise_cost(gopa, n, seeds)
    edges, revealed = 0, 0
    for s in seeds[:, 0]:
        execution = gopa.sample_execution(n, int(s))
        pairs = {tuple(sorted(e)) for e in execution.edges.tolist()}  # one message per undirected pair
        edges += len(pairs)
        pub = execution.published
        gone = execution.dropped_rollback
        revealed += sum(1 for i, j in pairs if pub[i] != pub[j] and not gone[i if pub[i] else j])
    assert messages == pytest.approx(edges / (3 * n) + 2)
    assert size == pytest.approx(8 * (edges / (3 * n) + 1 + revealed / (3 * n)))
    assert rounds == 3
    assert frontier.pairwise_cost(CorDPDME(1.0, 1.0, gamma=0.2), n, seeds)[:1] == (pytest.approx((n - 1) / 2 + 1),)
    assert frontier.inca_cost(20, 2) == (41.0, 41 * 16.0, 21)


def test_central_dp_lines():
    mu = frontier.gaussian_mu(1.0, frontier.DELTA)
    assert frontier.central_mse(200, 1.0) == pytest.approx(1 / (mu * 200) ** 2)
    stay = 200 - 60
    assert frontier.central_mse(200, 1.0, 0.3) == pytest.approx(1 / (mu * stay) ** 2 + (1 / stay - 1 / 200) / 12)
    assert np.isclose(frontier.central_mse(200, 1.0, 0.0), frontier.central_mse(200, 1.0))


def test_settings_narrow_the_grid_and_bad_ones_are_refused(tiny, tmp_path, capsys):
    (result,) = reproduce(["frontier"], runs=1, out=tmp_path, seed=0, progress=False, stream=io.StringIO(),
                          plots=False, settings={"gammas": [0.1], "iterations": [5], "neighbors": [1],
                                                 "epsilons": [1.0]})
    assert {r["gamma"] for r in result.rows} == {0.1} and {r["epsilon"] for r in result.rows} == {1.0}
    assert {(r["T"], r["k"]) for r in result.rows if r["protocol"].startswith("IncA")} == {(5, 1)}
    for settings, needle in (({"gammas": [0.8]}, r"--gammas must be in \[0, 0.8\)"),
                             ({"neighbors": [3]}, r"--neighbors must be an integer in \[1, 2\]"),
                             ({"parties": []}, "--parties must list at least one value"),
                             ({"iterations": [0]}, "--iterations must be an integer")):
        with pytest.raises(ValueError, match=needle):
            reproduce(["frontier"], runs=1, out=tmp_path, settings=settings)
    with pytest.raises(ValueError, match="only the frontier takes these settings, not fig2"):
        reproduce(["fig2"], runs=1, out=tmp_path, settings={"parties": [50]})
    assert cli.main(["reproduce", "frontier", "--gammas", "0.9", "--out", str(tmp_path)]) == 2
    assert "--gammas must be in [0, 0.8), got 0.9" in capsys.readouterr().err
    assert cli.main(["reproduce", "fig1", "--parties", "100", "--out", str(tmp_path)]) == 2
    assert "not fig1" in capsys.readouterr().err


def test_solver_setting_reaches_incas_certificates_and_is_recorded(tiny, tmp_path, capsys):
    """``--solver bound`` certifies IncA's runs with the sound bound: never below the exact method's sigma_delta
    (the same executions), above it somewhere; GOPA is untouched; the parameters say which solver ran."""
    grid = {"gammas": [0.2], "iterations": [5], "neighbors": [1], "epsilons": [1.0]}
    by = {}
    for solver in ("exact", "bound"):
        (result,) = reproduce(["frontier"], runs=2, out=tmp_path / solver, seed=0, progress=False,
                              stream=io.StringIO(), plots=False, settings={**grid, "solver": solver})
        assert result.params["solver"] == solver
        by[solver] = {r["protocol"]: r for r in result.rows}
    inca = [p for p in by["exact"] if p.startswith("IncA")]
    assert len(inca) == 2
    ratios = [by["bound"][p]["sigma_delta"] / by["exact"][p]["sigma_delta"] for p in inca]
    assert min(ratios) >= 1 - 1e-12 and max(ratios) > 1 + 1e-9
    gopa = [p for p in by["exact"] if p.startswith("GOPA")]
    assert gopa and all(by["bound"][p]["sigma_delta"] == by["exact"][p]["sigma_delta"] for p in gopa)
    with pytest.raises(ValueError, match="--solver must be one of auto, exact, bound, cascade, got 'fast'"):
        reproduce(["frontier"], runs=1, out=tmp_path, settings={"solver": "fast"})
    with pytest.raises(SystemExit) as exc:  # argparse's own refusal of a choice outside the list
        cli.main(["reproduce", "frontier", "--solver", "fast", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "invalid choice: 'fast'" in capsys.readouterr().err


def test_merge_joins_pieces_of_the_grid_into_one_frontier(tiny, tmp_path, capsys, monkeypatch):
    """Pieces of the grid run apart (two gammas, then one gamma again with more runs) and merged: every point
    once, a point in several files taken from the last, the checks and tables over all of them, nothing run."""
    settings = {"iterations": [4], "neighbors": [1], "epsilons": [1.0]}
    pieces = []
    for name, gammas, runs in (("a", [0.0], 1), ("b", [0.2], 1), ("c", [0.2], 2)):
        reproduce(["frontier"], runs=runs, out=tmp_path / name, seed=0, progress=False, stream=io.StringIO(),
                  plots=False, settings={**settings, "gammas": gammas})
        pieces.append(_csv(tmp_path / name / "frontier.csv"))
    paths = [str(tmp_path / name / "frontier.csv") for name in "abc"]
    (result,) = reproduce(["frontier"], out=tmp_path / "all", progress=False, stream=io.StringIO(), plots=False,
                          merge=paths)
    written = _csv(tmp_path / "all" / "frontier.csv")
    assert len(written) == len(result.rows) == len(pieces[0]) + len(pieces[2])  # b's points replaced by c's
    gamma_02 = [r for r in written if r["gamma"] == "0.2" and r["runs"]]
    assert gamma_02 and {r["runs"] for r in gamma_02} == {"2"}
    assert {r["predicted_mse"] for r in gamma_02} == {r["predicted_mse"] for r in pieces[2] if r["runs"]}
    assert {r["gamma"] for r in result.rows} == {0.0, 0.2} and all(isinstance(r["n"], int) for r in result.rows)
    md = (tmp_path / "all" / "frontier.md").read_text()
    assert "γ = 0 | γ = 0.2" in md and "merged" in (tmp_path / "all" / "frontier.txt").read_text()
    # the points of one table come from different numbers of runs: each point off the usual number shows its own
    usual = int(md.split("Calibrated on ")[1].split()[0])
    other = [r for r in written if r["runs"] and int(r["runs"]) != usual]
    assert usual in (1, 2) and other and md.count(f" ({3 - usual}) |") == len(other)
    assert "simulated runs per point; (R): on R runs." in md and f" ({usual}) |" not in md
    assert "alpha  runs  predicted_mse" in (tmp_path / "all" / "frontier.txt").read_text()
    assert any("IncA lower in" in c.measured and "of 1 " in c.measured for c in result.checks)  # the merged cell
    # bad files and combinations: one line naming what was wrong
    header = "n,epsilon,gamma,protocol,k,T,messages_per_party,rounds,predicted_mse\n"
    (tmp_path / "bad.csv").write_text(header + "30,x,0,IncA k=1,1,4,5,5,1\n")
    (tmp_path / "hole.csv").write_text(header + "30,1,0,IncA k=1,1,4,5,5,1\n,1,0,CorDP-DME,,,29,2,2\n")
    # a file with the point's place and value but not what the plots need (its messages) is not a frontier CSV
    (tmp_path / "short.csv").write_text("n,epsilon,gamma,protocol,predicted_mse\n30,1,0.1,CorDP-DME,0.1\n")
    (tmp_path / "runs0.csv").write_text(header.replace("\n", ",runs\n") + "30,1,0,IncA k=1,1,4,5,5,1,0\n")
    for name, line in (("nan", "30,1,0,IncA k=1,1,4,5,5,nan"), ("neg", "-5,1,0,IncA k=1,1,4,5,5,1"),
                       ("g1", "30,1,1,IncA k=1,1,4,5,5,1"), ("who", "30,1,0,IncA k=3 tail,3,4,5,5,1"),
                       ("noT", "30,1,0,IncA k=2 tail,2,,5,5,1"), ("k", "30,1,0,IncA k=1,2,4,5,5,1")):
        (tmp_path / f"{name}.csv").write_text(header + line + "\n")
    for argv, needle in ((["--merge", str(tmp_path / "none.csv")], "none.csv: cannot read it"),
                         (["--merge", str(tmp_path / "a" / "frontier.txt")], "not a frontier CSV"),
                         (["--merge", str(tmp_path / "short.csv")],
                          "not a frontier CSV (no column messages_per_party, rounds)"),
                         (["--merge", str(tmp_path / "who.csv")], "line 2: protocol must be one of CorDP-DME, GOPA"),
                         (["--merge", str(tmp_path / "noT.csv")], "line 2: no T (an IncA point needs them)"),
                         (["--merge", str(tmp_path / "k.csv")], "line 2: k = 2 does not match protocol 'IncA k=1'"),
                         (["--merge", str(tmp_path / "bad.csv")], "line 2: epsilon must be a number, got 'x'"),
                         (["--merge", str(tmp_path / "hole.csv")], "hole.csv, line 3: no n"),
                         (["--merge", str(tmp_path)], "cannot read it"),
                         (["--merge", str(tmp_path / "nan.csv")],
                          "line 2: predicted_mse must be a finite number >= 0, got nan"),
                         (["--merge", str(tmp_path / "neg.csv")], "line 2: n must be an integer >= 1, got -5"),
                         (["--merge", str(tmp_path / "runs0.csv")], "line 2: runs must be an integer >= 1, got 0"),
                         (["--merge", str(tmp_path / "g1.csv")], "line 2: gamma must be in [0, 1), got 1.0"),
                         (["--merge", paths[0], "--runs", "3"], "without --runs or grid settings")):
        assert cli.main(["reproduce", "frontier", *argv, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setattr(frontier, "MERGE_MAX_ROWS", 3)  # a huge file is refused, not read into memory
    with pytest.raises(ValueError, match="more than 3 rows"):
        frontier.merged([paths[0]])


def test_target_success_calibrates_every_protocol_to_cover_that_share_of_its_runs(tiny, tmp_path, capsys):
    """``--target-success q``: IncA's points are the product's ``calibrate(target_success=q)``, GOPA's its
    ``calibrate_samples(target_success=q)`` on the same views; the share is in the CSV and under the table,
    covering fewer runs needs less noise somewhere, and a share outside (0, 1] is refused in one line."""
    from flwr_inca.baselines.base import Threat
    from flwr_inca.baselines.calibration import calibrate_samples, sample_views

    settings = {"parties": [30], "gammas": [0.2], "iterations": [5], "neighbors": [1], "epsilons": [1.0],
                "protocols": ["inca", "gopa"]}
    with single_blas_thread():
        every = frontier.run(8, 3, ProgressBar(1, "t", enabled=False), **settings).rows
        (half,) = reproduce(["frontier"], runs=8, out=tmp_path, seed=3, progress=False, stream=io.StringIO(),
                            plots=False, settings={**settings, "target_success": 0.5})
    assert {r["target_success"] for r in every} == {1.0} and {r["target_success"] for r in half.rows} == {0.5}
    assert half.params["target_success"] == 0.5
    assert {r["target_success"] for r in _csv(tmp_path / "frontier.csv")} == {"0.5"}
    assert "Noise calibrated to certify 0.5 of each point's runs" in (tmp_path / "frontier.md").read_text()
    (inca,) = [r for r in half.rows if r["protocol"] == "IncA k=1"]
    cal = calibrate(1.0, frontier.DELTA, 30, iterations=5, neighbors=1, collusion=frontier.RHO,
                    schedule=inca["schedule"], runs=8, seed=frontier._seed(3, 30, 5, 1, 0.2),
                    dropout=PermanentDropout(0.2), target_success=0.5)
    assert (inca["sigma_star"], inca["alpha"]) == (cal.sigma_star, cal.alpha)
    assert inca["predicted_mse"] == pytest.approx(cal.predicted_mse, rel=1e-12)
    assert inca["success_fraction"] >= 0.5
    gopa = next(r for r in half.rows if r["protocol"] == "GOPA gamma_2=1/n")
    baseline = GOPA(1.0, 1.0, neighbors=gopa["k_PR"], gamma=0.2, gamma_rollback=gopa["gamma_2"])
    key = frontier._seed(3, 30, 0.2, gopa["k_PR"], gopa["gamma_2"])
    views = sample_views(baseline, 30, Threat.collusion(frontier.RHO), 8, key)
    direct = calibrate_samples(views, 1.0, frontier.DELTA, value_variance=frontier.VALUE_VARIANCE,
                               target_success=0.5)
    assert (gopa["sigma_star"], gopa["sigma_delta"]) == (direct.sigma_star, direct.sigma_delta)
    mse = {(r["protocol"], r.get("k_PR")): r["predicted_mse"] for r in every}
    lower = [mse[(r["protocol"], r.get("k_PR"))] / r["predicted_mse"] for r in half.rows if "runs" in r]
    assert min(lower) > 0.999 and max(lower) > 1.01  # never more noise, and less where a run needed the most
    for value, needle in (("0", "argument --target-success"), ("1.5", "argument --target-success")):
        with pytest.raises(SystemExit):
            cli.main(["reproduce", "frontier", "--target-success", value, "--out", str(tmp_path / "x")])
        assert needle in capsys.readouterr().err
    assert cli.main(["reproduce", "fig2", "--target-success", "0.9", "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "--target-success: only the frontier takes these settings, not fig2" in err
    assert len(err.strip().splitlines()) == 1
    (tmp_path / "q.csv").write_text("n,epsilon,gamma,protocol,k,T,messages_per_party,rounds,predicted_mse,runs,"
                                    "target_success\n30,1,0,IncA k=1,1,4,5,5,1,4,1.5\n")
    assert cli.main(["reproduce", "frontier", "--merge", str(tmp_path / "q.csv"), "--out", str(tmp_path / "z")]) == 2
    assert "line 2: target_success must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_protocols_setting_runs_only_the_protocols_named(tiny, tmp_path, capsys):
    """``--protocols inca-tail`` runs IncA's tail schedule alone (no baseline, no D_Inc), its points equal to those
    of the whole grid on the same seed, and the progress plan counts only what runs; a bad name is refused."""
    grid = {"gammas": [0.2], "iterations": [5], "neighbors": [1], "epsilons": [1.0]}
    common = dict(runs=2, seed=0, progress=False, stream=io.StringIO(), plots=False)
    (whole,) = reproduce(["frontier"], out=tmp_path / "whole", settings=grid, **common)
    (tail,) = reproduce(["frontier"], out=tmp_path / "tail", settings={**grid, "protocols": ["inca-tail"]}, **common)
    assert [r["protocol"] for r in tail.rows] == ["IncA k=1 tail"]
    assert tail.params["protocols"] == ("inca-tail",)
    assert frontier.Grid.of(protocols="gopa").protocols == ("gopa",)  # one name as a string
    assert frontier.Grid.of(parties=200, gammas=0.1).parties == (200,)  # one number
    (same,) = [r for r in whole.rows if r["protocol"] == "IncA k=1 tail"]
    assert {c: tail.rows[0][c] for c in ("sigma_star", "sigma_delta", "alpha", "predicted_mse")} == \
        {c: same[c] for c in ("sigma_star", "sigma_delta", "alpha", "predicted_mse")}
    bar = ProgressBar(frontier.work(2, **grid, protocols=["gopa", "central-dp"]), "t", enabled=False)
    rows = frontier.run(2, 0, bar, **grid, protocols=["gopa", "central-dp"]).rows
    assert bar.done == bar.total > 0
    assert {r["protocol"] for r in rows} == {"GOPA gamma_2=1/n", "GOPA gamma_2=gamma/4", "central DP",
                                             "central DP (stayers)"}
    with pytest.raises(ValueError, match="--protocols must name some of inca, inca-tail, gopa, cordp-dme, "
                                         "central-dp, got 'muffliato'"):
        reproduce(["frontier"], runs=1, out=tmp_path, settings={"protocols": ["muffliato"]})
    with pytest.raises(SystemExit) as exc:
        cli.main(["reproduce", "frontier", "--protocols", "gossip", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "invalid choice: 'gossip'" in capsys.readouterr().err


def test_a_piece_without_comparable_points_says_so_instead_of_an_empty_table(tiny, tmp_path):
    out = io.StringIO()
    reproduce(["frontier"], runs=1, out=tmp_path, seed=0, progress=False, stream=out, plots=False,
              settings={"gammas": [0.2], "protocols": ["central-dp"]})
    text = (tmp_path / "frontier.txt").read_text()
    assert "(none: these settings hold no points the statements compare)" in text and text in out.getvalue() + "\n"
    assert "paper states  paper  measured" not in text  # no empty table header


def test_a_point_too_large_is_refused_before_any_point_of_the_grid_runs(tiny, tmp_path, monkeypatch):
    """n = 30 would run first; GOPA at n = 20000 would not fit a 1 GiB limit: the grid is refused as a whole,
    before the first simulated run, naming the point, and nothing is written."""
    from flwr_inca._checks import MEMORY_ENV

    monkeypatch.setenv(MEMORY_ENV, str(2**30))
    settings = {"parties": [30, 20000], "gammas": [0.1], "iterations": [4], "neighbors": [1],
                "protocols": ["inca", "gopa"]}
    bar = ProgressBar(frontier.work(1, **settings), "t", enabled=False)
    with pytest.raises(ValueError, match=r"the exact certificate of one GOPA run \(\d+ observed values of 18000 "
                                         r"honest parties\) would need about .* over the limit of 1 GiB"):
        frontier.run(1, 0, bar, **settings)
    assert bar.done == 0
    with pytest.raises(ValueError, match="over the limit of 1 GiB"):
        reproduce(["frontier"], runs=1, out=tmp_path, progress=False, stream=io.StringIO(), settings=settings)
    assert not any(tmp_path.iterdir())


def test_the_tail_statement_counts_every_cell_with_dropouts():
    """The tail-vs-D_Inc statement takes every (n, eps, gamma > 0, T) cell, a cell where the tail loses
    included; without dropouts the schedules are not compared."""
    def row(gamma: float, protocol: str, mse: float) -> dict:
        return {"n": 100, "epsilon": 1.0, "gamma": gamma, "protocol": protocol, "k": 2, "T": 10, "k_PR": None,
                "predicted_mse": mse}
    rows = [row(0.0, "IncA k=2", 1.0), row(0.0, "IncA k=2 tail", 2.0),
            row(0.05, "IncA k=2", 1.0), row(0.05, "IncA k=2 tail", 1.5),
            row(0.1, "IncA k=2", 1.0), row(0.1, "IncA k=2 tail", 0.5),
            row(0.3, "IncA k=2", 2.0), row(0.3, "IncA k=2 tail", 1.0)]
    [tail] = [c.measured for c in frontier.checks(rows) if c.claim.startswith("value-free tail (L = 2)")]
    assert tail == "median x0.50, range [0.50, 1.50]; lower in 2 of 3"
