"""The communication-accuracy frontier under dropouts: ``flwr-inca reproduce frontier``.

Mean estimation of values in [0, 1] (U[0, 1] for the MSE), delta = 1e-5, a random coalition of 10%
of the parties, a fraction gamma of the parties dropping out permanently. Every protocol is calibrated
by the same exact procedure (``flwr_inca.privacy.calibrate``'s ``"exact"``: every simulated run
certified at the target, alpha chosen to minimise the predicted MSE, ``min_alpha = 1``; with
``--target-success q`` a share q of the runs instead, every protocol alike); each point is
the predicted MSE (closed form per execution, averaged over the simulated executions) against what a
party sends per round:

* **IncA**, T in {10, 20, 40, 80} x k in {1, 2}, with D_Inc and with D_Inc's value-free tail
  (``InjectionSchedule.incremental(T, tail=L)``, L = :data:`TAIL` [k]): T k peer messages per party plus
  its final message; T + 1 rounds of latency.
* **GOPA**, k_PR in {5, 10, 20, 40}, gamma_2 (the share of the parties dropping out during its roll-back
  round) in :data:`GOPA_SPLITS`: its pairwise-term messages (one per edge of the union graph) plus the
  published value plus the roll-back message; 3 rounds (terms, publish, roll-back).
* **CorDP-DME**: the complete graph, no roll-back: (n - 1)/2 pairwise messages per party plus the value;
  2 rounds.
* **central DP**: the Gaussian mechanism on the mean of all n values (one message each), and on the
  n - round(gamma n) values that stay (what a trusted curator could do with the same dropouts).

``--protocols`` (names in :data:`PROTOCOLS`) runs some of them only, e.g. one IncA configuration as a piece of
the grid, without repeating the baselines; ``--merge`` joins the pieces.

Bytes per party are for scalar values (d = 1) and 8-byte floats: an IncA message carries (y, omega),
a pairwise term, a published value and a rolled-back term one float each (a roll-back message carries
one term per dropped neighbour). With d-dimensional values every count of floats but IncA's omega
scales with d.

Outputs (besides ``frontier.csv`` and ``frontier.txt``): ``frontier.png`` (every (n, epsilon) x
gamma panel), ``frontier-n<n>-eps<epsilon>.png`` and ``.svg`` (one figure per (n, epsilon), one panel
per gamma) and ``frontier.md`` (the markdown table).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._checks import check_int, check_real
from ..baselines.base import Threat
from ..baselines.calibration import calibrate_samples, sample_views
from ..baselines.gaussian import gaussian_mu
from ..baselines.pairwise import GOPA, CorDPDME
from ..privacy.calibration import (
    BOUND_NOMINAL_RATIO,
    AlphaSelection,
    check_runs_fit,
    simulate_runs,
    simulation_seeds,
)
from ..privacy.methods import SOLVERS
from ..privacy.conversions import mu_for_epsilon
from ..protocol.config import IncaConfig
from ..protocol.dropout import PermanentDropout
from ..protocol.schedules import InjectionSchedule
from .._plots import new_figure, paper_style, save_figure
from . import FRONTIER_PROTOCOLS
from .common import Check, FigureResult, ProgressBar

__all__ = ["Grid", "central_mse", "checks", "inca_cost", "inca_units", "markdown", "merged",
           "pairwise_cost", "plot", "run", "work"]

PARTIES = (200, 1000)
EPSILONS = (0.2, 1.0)
GAMMAS = (0.0, 0.05, 0.1, 0.2, 0.3)
DELTA, RHO = 1e-5, 0.1
INCA_ITERATIONS = (10, 20, 40, 80)
INCA_NEIGHBORS = (1, 2)
# the value-free tail L per k (benchmarks/bench_schedules.py "tails": among the lowest MSE across T and gamma)
TAIL = {1: 3, 2: 2}
GOPA_NEIGHBORS = (5, 10, 20, 40)
GOPA_SPLITS = ("1/n", "gamma/4")
PROTOCOLS = FRONTIER_PROTOCOLS  # what --protocols names (defined where the command line reads it without this module)
VALUE_VARIANCE = 1.0 / 12.0  # U[0, 1]
FLOAT_BYTES = 8
# progress units of one simulated execution: a pairwise baseline's is 1; IncA's certificate costs about 4 of
# them at T k = 10 and grows as (T k)^1.25 (the frontier's own timings at n = 200 and 1000: exponents 1.05 to
# 1.4), so the bar's time left is not off by the 6x that counting every execution alike gave at T = 80
INCA_UNITS_AT_10, INCA_UNITS_EXPONENT = 4.0, 1.25


def inca_units(T: int, k: int) -> int:
    """Progress units of one IncA execution with T iterations and k neighbours (a GOPA execution: 1)."""
    return max(1, round(INCA_UNITS_AT_10 * (T * k / 10) ** INCA_UNITS_EXPONENT))


COLUMNS = ["n", "epsilon", "gamma", "protocol", "schedule", "k", "T", "k_PR", "gamma_2", "messages_per_party",
           "bytes_per_party", "rounds", "sigma_star", "sigma_delta", "alpha", "success_fraction", "predicted_mse",
           "central_dp_mse", "runs", "target_success", "seconds"]


# ---------------------------------------------------------------------------------------------- counting
def inca_cost(T: int, k: int) -> tuple[float, float, int]:
    """(messages, bytes, rounds) per party per round: T k peer messages and the final, each (y, omega)."""
    messages = T * k + 1
    return float(messages), float(messages * 2 * FLOAT_BYTES), T + 1


def pairwise_cost(baseline: GOPA | CorDPDME, n: int, seeds: np.ndarray) -> tuple[float, float, int]:
    """(messages, bytes, rounds) per party per round, averaged over the executions of ``seeds``: one message
    per edge (the term, from one end to the other), the published value, and for GOPA one roll-back message
    carrying one term per dropped neighbour."""
    edges, revealed = [], []
    for s in seeds[:, 0]:
        execution = baseline.sample_execution(n, int(s))
        edges.append(execution.edges.shape[0] / n)
        revealed.append(float(execution.edge_status()[0].sum()) / n)
    rollback = 1.0 if baseline.rollback else 0.0
    messages = statistics.fmean(edges) + 1.0 + rollback
    floats = statistics.fmean(edges) + 1.0 + statistics.fmean(revealed)
    return messages, floats * FLOAT_BYTES, 3 if baseline.rollback else 2


def central_mse(n: int, epsilon: float, gamma: float = 0.0) -> float:
    """MSE of the Gaussian mechanism on the mean of the n - round(gamma n) values that stay, against the
    mean of all n (values of variance 1/12): noise 1 / (mu n_O)^2 plus the values missing."""
    stay = n - round(gamma * n)
    mu = gaussian_mu(epsilon, DELTA)
    return 1.0 / (mu * stay) ** 2 + VALUE_VARIANCE * (1.0 / stay - 1.0 / n)


# ---------------------------------------------------------------------------------------------- points
def _gamma_2(split: str, gamma: float, n: int) -> float:
    return min(gamma, {"1/n": 1.0 / n, "gamma/4": gamma / 4}[split])


def _seed(seed: int, *key: float) -> int:
    return (seed * 1_000_003 + sum(int(round(v * 1000)) * 7919**i for i, v in enumerate(key, 1))) % 2**62


def inca_label(k: int, tail: int) -> str:
    """The protocol name of an IncA point in the CSV: ``"IncA k=1"``, ``"IncA k=2 tail"``."""
    return f"IncA k={k}" + (" tail" if tail else "")


def gopa_label(split: str) -> str:
    """The protocol name of a GOPA point in the CSV (``split``: one of :data:`GOPA_SPLITS`)."""
    return f"GOPA gamma_2={split}"


CENTRAL_LABELS = ("central DP", "central DP (stayers)")  # on all n values; on the parties that stay


def inca_config(T: int, k: int, tail: int, gamma: float) -> IncaConfig:
    """IncA's setting at a point (unit sigmas): D_Inc or the value-free tail ``tail``, permanent dropouts."""
    return IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=T, neighbors=k,
                      schedule=InjectionSchedule.incremental(T, tail=tail),
                      dropout=PermanentDropout(gamma) if gamma > 0 else None)


def pairwise_points(grid: Grid, n: int, gamma: float) -> list[tuple[GOPA | CorDPDME, str, dict]]:
    """``(baseline at unit sigmas, protocol label, its settings for the CSV)`` of every pairwise point of
    ``grid`` at (n, gamma): GOPA per k_PR and gamma_2, CorDP-DME."""
    points: list[tuple[GOPA | CorDPDME, str, dict]] = []
    for k_pr in GOPA_NEIGHBORS if "gopa" in grid.protocols else ():
        for split in GOPA_SPLITS:
            k, g2 = min(k_pr, n - 1), _gamma_2(split, gamma, n)
            points.append((GOPA(1.0, 1.0, neighbors=k, gamma=gamma, gamma_rollback=g2), gopa_label(split),
                           {"k_PR": k, "gamma_2": g2}))
    if "cordp-dme" in grid.protocols:
        points.append((CorDPDME(1.0, 1.0, gamma=gamma), CorDPDME.name, {"k_PR": n - 1}))
    return points


def inca_rows(n: int, T: int, k: int, tail: int, gamma: float, runs: int, seed: int, bar: ProgressBar,
              epsilons: tuple[float, ...] | None = None, solver: str = "auto",
              target_success: float = 1.0) -> list[dict]:
    """IncA calibrated for every epsilon on one set of simulated executions: the steps of the product's
    ``calibrate`` (exact procedure, ``target_success``: the share of the runs certified at the target), the
    executions' certificates computed once, each by ``solver``
    (:func:`~flwr_inca.privacy.certificate.choose_solver`). Exact certificates hold for every pair of
    sigmas; a sound bound is tightest near the central-DP level of the geometric mean of the epsilons'
    targets and valid at both."""
    epsilons = EPSILONS if epsilons is None else epsilons
    base = inca_config(T, k, tail, gamma)
    schedule = base.schedule
    targets = [mu_for_epsilon(eps, DELTA) for eps in epsilons]
    guess = 1.0 / (math.sqrt(n * (1.0 - RHO)) * math.prod(targets) ** (1.0 / len(targets)))
    bar.set_status(f"IncA n={n} T={T} k={k} {schedule.name} gamma={gamma:g}")
    start = time.perf_counter()
    sims = simulate_runs(n, base, simulation_seeds(_seed(seed, n, T, k, gamma), runs), rho=RHO, observed_fraction=None,
                         solver=solver, nominal=(guess, BOUND_NOMINAL_RATIO * guess),
                         progress=bar.callback(len(epsilons) * inca_units(T, k)))
    messages, size, rounds = inca_cost(T, k)
    rows = []
    for eps, mu in zip(epsilons, targets):
        selection = AlphaSelection(procedure="exact", mu_target=mu, quantile=target_success, epsilon=eps,
                                   delta=DELTA, value_sensitivity=1.0, value_variance=VALUE_VARIANCE)
        best, _, _ = selection.choose(sims)
        rows.append({"n": n, "epsilon": eps, "gamma": gamma, "protocol": inca_label(k, tail),
                     "schedule": schedule.name, "k": k, "T": T, "messages_per_party": messages,
                     "bytes_per_party": size, "rounds": rounds, "sigma_star": best["sigma_star"],
                     "sigma_delta": best["sigma_delta"], "alpha": best["alpha"],
                     "success_fraction": best["success_fraction"], "predicted_mse": best["predicted_mse"],
                     "central_dp_mse": central_mse(n, eps), "runs": runs, "target_success": target_success,
                     "seconds": (time.perf_counter() - start) / len(epsilons)})
    return rows


def pairwise_rows(baseline: GOPA | CorDPDME, protocol: str, n: int, gamma: float, runs: int, seed: int,
                  bar: ProgressBar, epsilons: tuple[float, ...], target_success: float = 1.0,
                  **extra) -> list[dict]:
    """GOPA or CorDP-DME: one set of simulated views, calibrated for every epsilon (``target_success``: the
    share of the runs certified at the target)."""
    bar.set_status(f"{protocol} n={n} gamma={gamma:g}")
    key = _seed(seed, n, gamma, extra.get("k_PR", 0), extra.get("gamma_2", 0))
    samples = sample_views(baseline, n, Threat.collusion(RHO), runs, key, bar.callback(len(epsilons)))
    messages, size, rounds = pairwise_cost(baseline, n, simulation_seeds(key, runs))
    rows = []
    for eps in epsilons:
        cal = calibrate_samples(samples, eps, DELTA, procedure="exact", baseline=baseline.name,
                                value_variance=VALUE_VARIANCE, target_success=target_success)
        rows.append({"n": n, "epsilon": eps, "gamma": gamma, "protocol": protocol, "schedule": "",
                     "messages_per_party": messages, "bytes_per_party": size, "rounds": rounds,
                     "sigma_star": cal.sigma_star, "sigma_delta": cal.sigma_delta, "alpha": cal.alpha,
                     "success_fraction": cal.success_fraction, "predicted_mse": cal.predicted_mse,
                     "central_dp_mse": central_mse(n, eps), "runs": runs, "target_success": target_success,
                     "seconds": cal.seconds, **extra})
    return rows


def central_rows(n: int, gamma: float, epsilons: tuple[float, ...]) -> list[dict]:
    rows = []
    for eps in epsilons:
        for protocol, g in zip(CENTRAL_LABELS, (0.0, gamma)):
            rows.append({"n": n, "epsilon": eps, "gamma": gamma, "protocol": protocol, "schedule": "",
                         "messages_per_party": 1.0, "bytes_per_party": float(FLOAT_BYTES), "rounds": 1,
                         "predicted_mse": central_mse(n, eps, g), "central_dp_mse": central_mse(n, eps)})
    return rows


# ---------------------------------------------------------------------------------------------- run
def _check_protocol(name: str, value) -> str:
    if value not in PROTOCOLS:
        raise ValueError(f"{name} must name some of {', '.join(PROTOCOLS)}, got {value!r}")
    return value


def _in_order(protocols: tuple[str, ...]) -> tuple[str, ...]:
    """``protocols`` once each, in :data:`PROTOCOLS`' order."""
    return tuple(p for p in PROTOCOLS if p in protocols)


@dataclass(frozen=True)
class Grid:
    """The settings a frontier covers; :meth:`of` fills what is not given from the module's constants.
    ``solver``: how IncA's simulated executions are certified (GOPA's and CorDP-DME's are always exact);
    ``target_success``: the share of each point's simulated runs its noise is calibrated to certify at the
    target (1: all of them, the worst case over the runs, as the paper), the same for every protocol."""

    parties: tuple[int, ...]
    epsilons: tuple[float, ...]
    gammas: tuple[float, ...]
    iterations: tuple[int, ...]
    neighbors: tuple[int, ...]
    solver: str = "auto"
    protocols: tuple[str, ...] = PROTOCOLS
    target_success: float = 1.0

    @classmethod
    def of(cls, parties: Sequence[int] | None = None, epsilons: Sequence[float] | None = None,
           gammas: Sequence[float] | None = None, iterations: Sequence[int] | None = None,
           neighbors: Sequence[int] | None = None, solver: str | None = None,
           protocols: Sequence[str] | None = None, target_success: float | None = None) -> Grid:
        """Raises ``ValueError`` naming the setting (as its command-line option) and its range."""
        def values(name: str, given, default, check) -> tuple:
            # one value (a number, or a name given as a string rather than its letters) is a list of one
            single = isinstance(given, str) or not isinstance(given, Iterable)
            got = tuple(default if given is None else (given,) if single else given)
            if not got:
                raise ValueError(f"{name} must list at least one value")
            return tuple(check(name, v) for v in got)

        grid = cls(values("--parties", parties, PARTIES, lambda n, v: check_int(n, v, 3)),
                   values("--epsilons", epsilons, EPSILONS, lambda n, v: check_real(n, v, 0.0, low_open=True)),
                   values("--gammas", gammas, GAMMAS, lambda n, v: check_real(n, v, 0.0, 0.8, high_open=True)),
                   values("--iterations", iterations, INCA_ITERATIONS, lambda n, v: check_int(n, v, 1, 1000)),
                   values("--neighbors", neighbors, INCA_NEIGHBORS, lambda n, v: check_int(n, v, 1, 2)),
                   "auto" if solver is None else solver,
                   _in_order(values("--protocols", protocols, PROTOCOLS, _check_protocol)),
                   1.0 if target_success is None else check_real("--target-success", target_success, 0.0, 1.0,
                                                                  low_open=True))
        if grid.solver not in SOLVERS:
            raise ValueError(f"--solver must be one of {', '.join(SOLVERS)}, got {grid.solver!r}")
        return grid

    def inca_settings(self) -> list[tuple[int, int, int]]:
        """(T, k, tail) of every IncA point: D_Inc and the value-free tail (where T > L), those of
        :attr:`protocols`."""
        return [(T, k, tail) for k in self.neighbors
                for tail, name in ((0, "inca"), (TAIL[k], "inca-tail")) if name in self.protocols
                for T in self.iterations if tail < T]

    def check_fits(self) -> None:
        """Raise ``ValueError`` (one line) if a point would not fit in memory, before any point runs: a
        refusal after hours of other points would lose them. IncA's runs are checked by
        :func:`~flwr_inca.privacy.calibration.check_runs_fit`, each pairwise baseline on one execution
        (its graph and the view of a coalition), which it builds but does not certify."""
        for n in self.parties:
            for gamma in self.gammas:
                for T, k, tail in self.inca_settings():
                    check_runs_fit(n, inca_config(T, k, tail, gamma), self.solver)
                for baseline, _, _ in pairwise_points(self, n, gamma):
                    execution = baseline.sample_execution(n, 0)
                    baseline.check_size(execution, baseline.adversary(execution, Threat.collusion(RHO), 0))

    def pairwise(self) -> int:
        """How many pairwise-baseline points per (n, gamma): GOPA's k_PR x gamma_2, CorDP-DME's one."""
        return (len(GOPA_NEIGHBORS) * len(GOPA_SPLITS) * ("gopa" in self.protocols)
                + ("cordp-dme" in self.protocols))

    def work(self, runs: int) -> int:
        """Progress units: every simulated execution (IncA's weighted by :func:`inca_units`, the pairwise
        baselines' 1), counted once per epsilon it is calibrated for."""
        units = sum(inca_units(T, k) for T, k, _ in self.inca_settings()) + self.pairwise()
        return len(self.parties) * len(self.gammas) * runs * units * len(self.epsilons)


def work(runs: int, **settings: Sequence) -> int:
    return Grid.of(**settings).work(runs)


def run(runs: int, seed: int, bar: ProgressBar, **settings: Sequence) -> FigureResult:
    """The frontier over :class:`Grid` ``.of(**settings)`` (parties, epsilons, gammas, iterations, neighbors,
    solver, protocols, target_success)."""
    grid = Grid.of(**settings)
    grid.check_fits()
    eps = grid.epsilons
    rows: list[dict] = []
    for n in grid.parties:
        for gamma in grid.gammas:
            if "central-dp" in grid.protocols:
                rows += central_rows(n, gamma, eps)
            for T, k, tail in grid.inca_settings():
                rows += inca_rows(n, T, k, tail, gamma, runs, seed, bar, eps, grid.solver, grid.target_success)
            for baseline, protocol, extra in pairwise_points(grid, n, gamma):
                rows += pairwise_rows(baseline, protocol, n, gamma, runs, seed, bar, eps, grid.target_success,
                                      **extra)
    result = FigureResult(
        "frontier", "IncA under dropouts: MSE against messages per party per round, every protocol calibrated "
        "exactly", COLUMNS, rows, plot=plot, params=_params(grid, runs, seed), write_extra=write_extra,
        checks_heading="What the frontier shows (measured; the paper states none of it):")
    result.checks = checks(rows)
    result.notes.append(f"value-free tail per k: {TAIL}; GOPA gamma_2 in {GOPA_SPLITS}; MSE = predicted (closed "
                        "form per simulated execution, averaged over them)")
    return result


MERGE_MAX_ROWS = 1_000_000  # --merge reads no further (a whole grid is a few hundred rows)
_INTEGER_COLUMNS = frozenset({"n", "k", "T", "k_PR", "rounds", "runs"})
_TEXT_COLUMNS = frozenset({"protocol", "schedule"})
# what a merged point must hold (its place, its value, what the plots and tables show it against)
_NEEDED_COLUMNS = ("n", "epsilon", "gamma", "protocol", "predicted_mse", "messages_per_party", "rounds")
# the protocols a frontier writes (an IncA point also needs its k, matching its name, and its T)
_INCA_LABELS = {inca_label(k, tail): k for k in INCA_NEIGHBORS for tail in (0, TAIL[k])}
_LABELS = frozenset({*_INCA_LABELS, *map(gopa_label, GOPA_SPLITS), CorDPDME.name, *CENTRAL_LABELS})


# what a merged number may be besides >= 0 (a point no run can produce is refused, not plotted)
_LIMITS = {"n": {"low": 1}, "runs": {"low": 1}, "epsilon": {"low": 0.0, "low_open": True},
           "target_success": {"low": 0.0, "high": 1.0, "low_open": True},
           "gamma": {"low": 0.0, "high": 1.0, "high_open": True}}


def _check_value(column: str, value):
    """``value`` of a merged ``column``, checked by the package's own checks (``ValueError`` naming it)."""
    if column in _TEXT_COLUMNS:
        return value
    if column in _INTEGER_COLUMNS:
        return check_int(column, value, _LIMITS.get(column, {"low": 0})["low"])
    return check_real(column, value, **_LIMITS.get(column, {"low": 0.0}))


def _check_point(row: dict) -> None:
    """What a merged point's columns must say together (``ValueError`` naming the column)."""
    protocol = row["protocol"]
    if protocol not in _LABELS:
        raise ValueError(f"protocol must be one of {', '.join(sorted(_LABELS))}, got {protocol[:60]!r}")
    if protocol in _INCA_LABELS:
        missing = [c for c in ("k", "T") if c not in row]
        if missing:
            raise ValueError(f"no {', '.join(missing)} (an IncA point needs them)")
        if row["k"] != _INCA_LABELS[protocol]:
            raise ValueError(f"k = {row['k']} does not match protocol {protocol!r}")


def _point(row: dict) -> tuple:
    return (row["n"], row["epsilon"], row["gamma"], row["protocol"], row.get("T"), row.get("k_PR"))


def merged(paths: Sequence[str | Path]) -> FigureResult:
    """The frontier of the points in ``paths`` (``frontier.csv`` files of earlier runs, e.g. pieces of the grid
    run apart): a point measured in several files is taken from the last one. Raises ``ValueError`` naming a
    file that cannot be read or is not a frontier CSV (``--merge``)."""
    import csv

    points: dict[tuple, dict] = {}
    for path in paths:
        try:
            with open(path, newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh)
                missing = [c for c in _NEEDED_COLUMNS if c not in (reader.fieldnames or [])]
                if missing:
                    raise ValueError(f"--merge {path}: not a frontier CSV (no column {', '.join(missing)})")
                for line, raw in enumerate(reader, 2):
                    row: dict = {}
                    for column, text in raw.items():
                        if column not in COLUMNS or text in ("", None):
                            continue
                        try:
                            row[column] = (text if column in _TEXT_COLUMNS else
                                           int(text) if column in _INTEGER_COLUMNS else float(text))
                        except ValueError:
                            raise ValueError(f"--merge {path}, line {line}: {column} must be a number, got "
                                             f"{text[:40]!r}") from None
                    empty = [c for c in _NEEDED_COLUMNS if c not in row]
                    if empty:
                        raise ValueError(f"--merge {path}, line {line}: no {', '.join(empty)}")
                    try:
                        for column, value in row.items():
                            _check_value(column, value)
                        _check_point(row)
                    except ValueError as exc:
                        raise ValueError(f"--merge {path}, line {line}: {exc}") from None
                    if line > MERGE_MAX_ROWS:
                        raise ValueError(f"--merge {path}: more than {MERGE_MAX_ROWS} rows; a frontier has a few "
                                         "hundred")
                    points[_point(row)] = row
        except OSError as exc:
            raise ValueError(f"--merge {path}: cannot read it: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, csv.Error) as exc:
            raise ValueError(f"--merge {path}: not a frontier CSV ({exc})") from None
    rows = sorted(points.values(), key=lambda r: (r["n"], r["epsilon"], r["gamma"], r["protocol"],
                                                  r.get("T") or 0, r.get("k_PR") or 0))
    if not rows:
        raise ValueError("--merge: the files hold no frontier point")
    runs = sorted({r["runs"] for r in rows if "runs" in r})
    params = {"n": tuple(sorted({r["n"] for r in rows})), "epsilon": tuple(sorted({r["epsilon"] for r in rows})),
              "gamma": tuple(sorted({r["gamma"] for r in rows})), "runs": tuple(runs),
              "target_success": tuple(sorted({r.get("target_success", 1.0) for r in rows if "runs" in r})),
              "merged": ", ".join(str(p) for p in paths)}
    result = FigureResult(
        "frontier", "IncA under dropouts: MSE against messages per party per round, every protocol calibrated "
        "exactly (merged)", COLUMNS, rows, plot=plot, params=params, write_extra=write_extra,
        checks_heading="What the frontier shows (measured; the paper states none of it):")
    result.checks = checks(rows)
    result.seconds = sum(r.get("seconds", 0.0) for r in rows)
    return result


def _params(grid: Grid, runs: int, seed: int) -> dict:
    return {"n": grid.parties, "epsilon": grid.epsilons, "gamma": grid.gammas, "T": grid.iterations,
            "k": grid.neighbors, "delta": DELTA, "rho": RHO, "runs": runs, "seed": seed, "solver": grid.solver,
            "protocols": grid.protocols, "target_success": grid.target_success}


# ---------------------------------------------------------------------------------------------- checks
def _select(rows: list[dict], **match) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def _mse(rows: list[dict], **match) -> float:
    got = _select(rows, **match)
    return got[0]["predicted_mse"] if got else math.nan


def _ratio_line(ratios: list[float]) -> str:
    return (f"median x{statistics.median(ratios):.2f}, range [{min(ratios):.2f}, {max(ratios):.2f}]; "
            f"lower in {sum(r < 1 for r in ratios)} of {len(ratios)}")


def checks(rows: list[dict]) -> list[Check]:
    """What the frontier shows, as measured statements (the paper states none of these)."""
    out = []
    keys = sorted({(r["n"], r["epsilon"], r["gamma"]) for r in rows})
    for k in sorted({r["k"] for r in rows if r["protocol"].startswith("IncA")}):
        ratios = [r["predicted_mse"] / _mse(rows, n=r["n"], epsilon=r["epsilon"], gamma=r["gamma"], T=r["T"],
                                             protocol=inca_label(k, 0))
                  for r in rows if r["protocol"] == inca_label(k, TAIL[k]) and r["gamma"] > 0]
        ratios = [x for x in ratios if math.isfinite(x)]
        if ratios:
            out.append(Check(f"value-free tail (L = {TAIL[k]}) vs D_Inc, k = {k}, equal messages, gamma > 0: "
                             "MSE ratio", "-", _ratio_line(ratios), None))
    for split in GOPA_SPLITS:
        for protocol in (inca_label(1, 0), inca_label(1, TAIL[1])):
            wins, cells, notes = 0, 0, []
            for n, eps, gamma in keys:
                for m in sorted(set(GOPA_NEIGHBORS) & {r["T"] for r in rows if r["protocol"] == protocol}):
                    inca = _mse(rows, n=n, epsilon=eps, gamma=gamma, protocol=protocol, T=m)
                    gopa = _mse(rows, n=n, epsilon=eps, gamma=gamma, protocol=gopa_label(split), k_PR=m)
                    if gamma > 0 and math.isfinite(inca) and math.isfinite(gopa):
                        cells += 1
                        wins += inca < gopa
                        notes.append(gopa / inca)
            if cells:
                out.append(Check(f"{protocol} (T = m) vs GOPA gamma_2 = {split} (k_PR = m), gamma > 0", "-",
                                 f"IncA lower in {wins} of {cells} (n, eps, gamma, m) cells", None,
                                 f"GOPA / IncA MSE: median {statistics.median(notes):.2f}, range "
                                 f"[{min(notes):.2f}, {max(notes):.2f}]"))
    for gamma_zero in (True, False):
        gaps = [min((r["predicted_mse"] for r in _select(rows, n=n, epsilon=eps, gamma=gamma)
                     if r["protocol"].startswith("IncA") and math.isfinite(r["predicted_mse"])), default=math.nan)
                / _mse(rows, n=n, epsilon=eps, gamma=gamma, protocol=CENTRAL_LABELS[1])
                for n, eps, gamma in keys if (gamma == 0) == gamma_zero]
        gaps = [g for g in gaps if math.isfinite(g)]
        if gaps:
            out.append(Check(f"best IncA point vs central DP on the parties that stay, gamma {'=' if gamma_zero else '>'}"
                             " 0: MSE ratio", "-", f"x{min(gaps):.2f} to x{max(gaps):.2f}", None))
    return out


# ---------------------------------------------------------------------------------------------- output
# (protocol, colour, marker and line) of every plotted series but central DP's lines, in the legend's order
SERIES = ((inca_label(1, 0), "tab:blue", "o-"), (inca_label(1, TAIL[1]), "tab:blue", "o--"),
          (inca_label(2, 0), "tab:purple", "s-"), (inca_label(2, TAIL[2]), "tab:purple", "s--"),
          (gopa_label("1/n"), "tab:green", "^-"), (gopa_label("gamma/4"), "tab:olive", "^--"),
          (CorDPDME.name, "tab:brown", "x"))


def _label(protocol: str) -> str:
    label = protocol + (f" (L={TAIL[_INCA_LABELS[protocol]]})" if protocol.endswith("tail") else "")
    return (label.replace("gamma_2=gamma/4", r"$\gamma_2 = \gamma/4$").replace("gamma_2=1/n", r"$\gamma_2 = 1/n$")
            .replace("L=", "$L$ = ").replace("k=", "$k$ = "))


def _panel(ax, rows: list[dict], n: int, eps: float, gamma: float) -> None:
    from matplotlib.ticker import NullFormatter

    cell = _select(rows, n=n, epsilon=eps, gamma=gamma)
    for protocol, color, style in SERIES:
        pts = sorted((r["messages_per_party"], r["predicted_mse"]) for r in cell
                     if r["protocol"] == protocol and math.isfinite(r["predicted_mse"]))
        if pts:
            ax.plot(*zip(*pts), style, color=color, label=_label(protocol), ms=4)
    for protocol, style in zip(CENTRAL_LABELS, ("k-", "k:")):
        got = _select(cell, protocol=protocol)
        if got:
            ax.axhline(got[0]["predicted_mse"], color="k", ls=style[1:], lw=1, label=protocol)
    ax.set_xscale("log")
    ax.set_yscale("log")
    low, high = ax.get_xlim()
    ticks = [t for t in (2, 5, 10, 20, 50, 100, 200, 500, 1000) if low <= t <= high]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_title(rf"$n = {n}$, $\varepsilon = {eps:g}$, $\gamma = {gamma:g}$", fontsize=8)
    ax.grid(alpha=0.3, which="both")


def _figure(rows: list[dict], keys: list[tuple[int, float]], gammas: list[float]):
    columns = max(2, min(4, 2 * len(gammas)))
    fig, axes = new_figure(len(keys), len(gammas), figsize=(3.2 * len(gammas), 2.9 * len(keys) + 0.6),
                           squeeze=False)
    for i, (n, eps) in enumerate(keys):
        for j, gamma in enumerate(gammas):
            _panel(axes[i, j], rows, n, eps, gamma)
        axes[i, 0].set_ylabel("MSE of the mean")
    for ax in axes[-1]:
        ax.set_xlabel("messages per party per round")
    # every series of any panel (a configuration run at one gamma only is in that panel alone), in SERIES order
    entries: dict[str, object] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    order = [_label(protocol) for protocol, _, _ in SERIES] + list(CENTRAL_LABELS)
    labels = sorted(entries, key=lambda label: order.index(label) if label in order else len(order))
    fig.legend([entries[label] for label in labels], labels, loc="outside lower center", ncol=columns, fontsize=7,
               frameon=False)
    return fig


def _keys(rows: list[dict]) -> tuple[list[tuple[int, float]], list[float]]:
    keys = sorted({(r["n"], r["epsilon"]) for r in rows})
    return keys, sorted({r["gamma"] for r in rows})


def plot(result: FigureResult, path: Path) -> list[Path]:
    """``frontier.png`` (all panels) and one PNG + SVG per (n, epsilon); returns the paths written."""
    keys, gammas = _keys(result.rows)
    with paper_style():
        written = save_figure(_figure(result.rows, keys, gammas), path, dpi=90, vector=False)
        for key in keys:
            written += save_figure(_figure(result.rows, [key], gammas),
                                   path.with_name(f"frontier-n{key[0]}-eps{key[1]:g}.png"), dpi=110)
    return written


def _mse_cell(row: dict, usual: int | None) -> str:
    """A point's MSE in :func:`markdown`, with its number of runs where it is not ``usual`` (None: never)."""
    other = usual is not None and row.get("runs", usual) != usual
    return f"{row['predicted_mse']:.3g}" + (f" ({row['runs']})" if other else "")


def markdown(rows: list[dict]) -> str:
    """One table per (n, epsilon): the predicted MSE of every configuration, a column per gamma. Where the
    points of a table were calibrated on different numbers of simulated runs (pieces merged), a point whose
    number differs from the table's most common one shows it in brackets, and a line under the table says so."""
    keys, gammas = _keys(rows)
    parts = []
    for n, eps in keys:
        cell = _select(rows, n=n, epsilon=eps)
        counts = Counter(r["runs"] for r in cell if "runs" in r)
        usual = counts.most_common(1)[0][0] if len(counts) > 1 else None  # None: one number of runs, no marks
        configs: dict[tuple, dict] = {}  # (protocol, T, k_PR) -> its first row (messages, rounds)
        for r in sorted(cell, key=lambda r: (r["protocol"], r["messages_per_party"])):
            configs.setdefault((r["protocol"], r.get("T") or 0, r.get("k_PR") or 0), r)
        header = ["protocol", "T / k_PR", "messages", "rounds"] + [f"γ = {g:g}" for g in gammas]
        lines = [f"**n = {n}, ε = {eps:g}** (predicted MSE of the mean)", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for (protocol, T, k_pr), first in configs.items():
            values = []
            for g in gammas:
                got = [r for r in cell if r["gamma"] == g and r["protocol"] == protocol and (r.get("T") or 0) == T
                       and (r.get("k_PR") or 0) == k_pr]
                values.append(_mse_cell(got[0], usual) if got else "")
            lines.append(f"| {protocol} | {T or k_pr or ''} | {first['messages_per_party']:.1f} | {first['rounds']} | "
                         + " | ".join(values) + " |")
        if usual is not None:
            lines += ["", f"Calibrated on {usual} simulated runs per point; (R): on R runs."]
        covers = sorted({r.get("target_success", 1.0) for r in cell if "runs" in r})
        if covers and covers != [1.0]:
            lines += ["", "Noise calibrated to certify " + " or ".join(f"{q:g}" for q in covers)
                      + " of each point's runs at the target (--target-success; 1: all of them)."]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def write_extra(result: FigureResult, out: Path) -> list[str]:
    """``frontier.md``; the plots' extra files are written by :func:`plot`."""
    (out / "frontier.md").write_text(markdown(result.rows), encoding="utf-8")
    return ["frontier.md"]


