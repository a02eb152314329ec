"""Calibrating (sigma_star, sigma_delta) for a target (epsilon, delta) (paper Sec. 5.2, Fig. 3).

Both procedures simulate R executions (random corrupted set or intercepted messages, k-out
topology, dropouts), compute for each the smallest sigma_delta that makes it private, and keep a
sigma_delta that covers the runs:

* ``"paper"``: the paper's Sec. 5.2 recipe. sigma_star^2 = alpha * 2 ln(1.25/delta) / (n_O eps^2)
  with alpha = 1.3 and n_O = n (1 - gamma - rho); per run the Theorem 4.1 check with the classic
  bound (mu_i <= eps / c, c^2 = 2 ln(1.25/delta), needs eps < 1); sigma_delta = worst case over runs.
  (The paper derives each run's sigma_delta from Theorem 4.7's construction; we use the exact check
  of Theorem 4.1, which needs less noise for the same guarantee.)
* ``"exact"`` (improved): the exact per-party certificate with the tight analytic-Gaussian conversion
  (mu_i <= mu(eps, delta)). sigma_star^2 = alpha / (n_O mu^2) (n_O: mean number of honest
  finalists), with alpha chosen on a grid to minimise the predicted MSE among the alphas whose success
  fraction reaches ``target_success``. Without permanent dropouts each run has a floor (below it no
  sigma_delta suffices; the sigma_delta -> infinity limit of the certificate, 1/(n_H mu^2) with no
  dropouts), and the grid also holds multiples of it; with permanent dropouts the uncancelled noise
  can protect everyone and small alphas may win.

Every run counted as a success is certified at the returned sigmas, so the stated target holds for
it; a fresh execution should be certified again (``certify``) before it is trusted. Runs too large for
the exact check use the sound bound (``solver``, :func:`~flwr_inca.privacy.certificate.choose_solver`):
it never claims more privacy than the exact check would, so it may only ask for more noise. A bound's
``(X_i, E_i)`` hold for every pair of sigmas, so each such run is bounded once, near the central-DP level
(``bound_passes=1``; docs/privacy.md, "Calibrating with a bound: one pass per run"); ``bound_passes=2``
bounds it again at the sigmas the first pass chose (tightest there, twice the cost). Only the runs that set
sigma_delta must be tight: a run is not tightened below the level the runs before it charge, and one that
sets sigma_delta anyway is bounded again alone (``tight_runs=False``; docs/privacy.md, "Charging across
runs").

The procedure is split in small steps: :func:`simulate_runs`, then the selection of alpha
(:class:`AlphaSelection`: :func:`alpha_grid`, :func:`evaluate_alpha` and :func:`pick_alpha`), which the
baselines' calibration (:func:`flwr_inca.baselines.calibrate_samples`) shares.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from .._checks import (
    MAX_SCALE,
    check_bool,
    check_bytes,
    check_delta,
    check_epsilon,
    check_int,
    check_parties,
    check_probability,
    check_real,
    check_runs,
    check_scale,
)
from .._json import jsonable
from ..protocol.config import IncaConfig
from ..protocol.dropout import DropoutModel, NoDropout, PermanentDropout
from ..protocol.engine import sample_trace
from ..protocol.noise import resolve_seed
from ..protocol.schedules import InjectionSchedule
from ..protocol.topology import Topology
from ..protocol.utility import output_coefficients
from .bound import BoundSettings, SensitivityBound, bound_bytes
from .certificate import EXACT_MAX_PARTIES, SOLVERS, SensitivityProfile, profile
from .conversions import classic_mu, epsilon_for_delta, mu_for_epsilon
from .views import AdversaryView, random_collusion, random_eavesdrop

__all__ = ["DEFAULT_ALPHAS", "AlphaSelection", "Calibration", "NoiseCalibrator", "SimulatedRun", "alpha_candidates",
           "alpha_grid", "calibrate", "check_runs_fit", "covered_runs", "evaluate_alpha", "pick_alpha",
           "required_sigma_delta", "simulate_runs", "simulation_seeds"]

# alpha: sigma_star^2 in units of 1 / (n_O mu^2), the central-DP level of the honest finalists
DEFAULT_ALPHAS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 1.0, 1.1, 1.2, 1.3, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0)
# and multiples of the floor (smallest sigma_star^2 any sigma_delta can make private), when there is one
FLOOR_FACTORS = (1.01, 1.03, 1.06, 1.1, 1.15, 1.2, 1.3, 1.45, 1.6, 1.8, 2.0, 2.5, 3.0)
PAPER_ALPHA = 1.3
# the largest alpha (given or min_alpha): a million times the central-DP noise variance, far above the grid
MAX_ALPHA = 1e6


# first guess of sigma_delta / sigma_star for bound profiles (with bound_passes=2 the second pass uses the
# calibrated ratio)
BOUND_NOMINAL_RATIO = 10.0
# a run's bound is not tightened below this share of the level the runs before it charge (mu at the nominal
# pair; simulate_runs). Below 1 because calibration picks other sigmas than the nominal ones, where a bound
# left loose weighs differently: at n = 2000 (10 runs) 1.0 gave 2% more MSE, 0.95 the same as every run
# tightened alone. The run that sets sigma_delta is bounded again alone anyway (calibrate).
CHARGED_MARGIN = 0.95


@dataclass
class _Run:
    profile: SensitivityProfile | SensitivityBound
    trace: Any
    view: AdversaryView
    b2: float  # ||b||^2
    a2: float  # ||a||^2
    total: float  # sum(b)
    lost: float  # ||b / sum(b) - 1/n||^2
    honest_outputs: int  # honest finalists: the honest parties whose values reach the output
    charged: float | None = None  # charged_mu its bound was made with (None: tightened alone)

    def expected_mse(self, sigma_star: float, sigma_delta: float, value_variance: float) -> float:
        """Predicted per-coordinate MSE of this run's estimate at the sigmas (value units) for values of
        variance ``value_variance`` (:func:`flwr_inca.protocol.utility.expected_mse`)."""
        if self.total <= 0:
            return math.inf
        # products, not **: a huge sigma_delta (a run barely private) gives inf, not an OverflowError
        return (value_variance * self.lost
                + (sigma_star * sigma_star * self.b2 + sigma_delta * sigma_delta * self.a2) / self.total**2)


@dataclass
class Calibration:
    """Noise levels for a target guarantee, with their predicted accuracy.

    ``sigma_star`` and ``sigma_delta`` are in value units (already multiplied by
    ``value_sensitivity``); ``success_fraction`` is the share of the simulated runs whose every honest
    party meets the target at these sigmas; ``predicted_mse`` is the mean, over the runs, of the
    closed-form per-coordinate MSE for values with variance ``value_variance``. A calibration that
    :class:`NoiseCalibrator` made for ``calibrated_parties`` parties and serves to ``parties`` others
    (within 25%) has its sigmas scaled and its MSE extrapolated (:attr:`mse_terms`); its runs
    (``run_seeds``) are executions of ``calibrated_parties`` parties.
    """

    procedure: str
    epsilon: float
    delta: float
    mu_target: float
    sigma_star: float
    sigma_delta: float
    alpha: float
    success_fraction: float
    predicted_mse: float
    runs: int
    parties: int
    iterations: int
    neighbors: int
    threat: str
    value_sensitivity: float
    seconds: float
    alternatives: list[dict[str, float]] = field(default_factory=list)
    run_seeds: list[tuple[int, int]] = field(default_factory=list)  # (trace seed, view seed) per run
    notes: list[str] = field(default_factory=list)
    value_variance: float = 1.0 / 12.0
    # the predicted MSE's terms, means over the runs (extrapolated to ``parties`` when they differ from
    # ``calibrated_parties``): value_variance * lost + sigma_star^2 * star + sigma_delta^2 * delta (sigmas in
    # value units; :meth:`mse_at`)
    mse_terms: dict[str, float] = field(default_factory=dict)
    calibrated_parties: int | None = None  # the parties of the runs (None: ``parties``)

    def mse_at(self, sigma_star: float, sigma_delta: float) -> float:
        """The predicted per-coordinate MSE at other sigmas (value units), for values of variance
        ``value_variance``, from :attr:`mse_terms` (``predicted_mse`` is its value at the calibrated sigmas)."""
        return _mse(self.mse_terms, sigma_star, sigma_delta, self.value_variance)

    def config(self, **overrides: Any) -> IncaConfig:
        """An ``IncaConfig`` with these sigmas (pass topology, dropout, ... as overrides)."""
        kw: dict[str, Any] = {"iterations": self.iterations, "neighbors": self.neighbors,
                              "sigma_star": self.sigma_star, "sigma_delta": self.sigma_delta}
        kw.update(overrides)
        return IncaConfig(**kw)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record (``flwr_inca._json``: an infinite sigma is written ``"inf"``)."""
        return jsonable(asdict(self))


class Profile(Protocol):
    """What the selection needs of a run's certificate: an exact ``SensitivityProfile`` or a
    ``SensitivityBound`` (unit value sensitivity)."""

    def mu(self, sigma_star: float, sigma_delta: float) -> np.ndarray: ...

    def mu_limit(self, sigma_star: float) -> np.ndarray: ...

    def min_sigma_delta(self, sigma_star: float, mu_target: float) -> float: ...


class SimulatedRun(Protocol):
    """What the alpha selection needs of one simulated execution seen by one adversary: its certificate
    (unit value sensitivity), how many honest parties' values reach its output, and the predicted MSE of its
    estimate. :func:`calibrate`'s runs and the baselines' :class:`~flwr_inca.baselines.ViewSample` are such
    runs."""

    @property
    def profile(self) -> Profile: ...

    @property
    def honest_outputs(self) -> int: ...

    def expected_mse(self, sigma_star: float, sigma_delta: float, value_variance: float) -> float:
        """Per-coordinate MSE of the estimate at these sigmas (value units), values of variance
        ``value_variance``."""
        ...


def simulation_seeds(seed: int | None, runs: int) -> np.ndarray:
    """(runs, 2) seeds ``(execution, adversary)`` of the simulated runs of a calibration (every calibration
    derives them so: the baselines' too, so that IncA calibrated either way sees the same runs)."""
    root = np.random.SeedSequence(resolve_seed(seed))
    return root.generate_state(2 * runs, dtype=np.uint64).reshape(runs, 2)


def covered_runs(quantile: float, runs: int) -> int:
    """How many of ``runs`` simulated runs a calibration covering the share ``quantile`` must certify:
    ceil(quantile R), floating-point error aside (0.07 of 100 runs is 7, though 0.07 * 100 > 7)."""
    return math.ceil(quantile * runs - 1e-9)


def required_sigma_delta(profiles: Sequence[Profile], sigma_star: float, mu_target: float, *,
                         quantile: float = 1.0, every_run: bool = True) -> tuple[float, float]:
    """``(sigma_delta, success fraction)``: the smallest sigma_delta (unit sensitivity) that makes the
    required share of the simulated runs ``mu <= mu_target`` at ``sigma_star``.

    * ``quantile = 1`` (every run; the paper's worst case over runs): a running maximum. A run that the
      current maximum already makes private costs one evaluation of mu; only a run that needs more is
      bisected (a new record: about ln R of them in R runs in random order) instead of bisecting every
      run. With ``every_run``, one run that no sigma_delta makes private (its sigma_delta -> infinity
      limit misses the target) gives ``(inf, 0)``; without, the maximum covers the feasible runs and the
      success fraction is their share (the paper's procedure).
    * ``quantile < 1``: every run's smallest sufficient sigma_delta, and their ``quantile`` order
      statistic.
    """
    runs = len(profiles)
    if runs == 0:
        raise ValueError("profiles must hold at least one simulated run")
    if quantile < 1.0:
        need = np.array([p.min_sigma_delta(sigma_star, mu_target) for p in profiles])
        finite = np.sort(need[np.isfinite(need)])
        required = covered_runs(quantile, runs)
        s_delta = float(finite[required - 1]) if finite.size >= required and finite.size > 0 else math.inf
        return s_delta, (float(np.mean(need <= s_delta)) if math.isfinite(s_delta) else 0.0)
    current, feasible = 0.0, 0
    for p in profiles:
        limit = p.mu_limit(sigma_star)
        if not np.all(np.isfinite(limit)) or limit.max(initial=0.0) > mu_target:
            if every_run:
                return math.inf, 0.0
            continue
        feasible += 1
        if p.mu(sigma_star, current).max(initial=0.0) > mu_target:
            current = max(current, p.min_sigma_delta(sigma_star, mu_target))
    if feasible == 0 or not math.isfinite(current):
        return math.inf, 0.0
    return current, feasible / runs


def alpha_candidates(profiles: Sequence[Profile], mu_target: float, n_o: float, quantile: float, *,
                     alphas: Sequence[float] | None = None, min_alpha: float = 1.0) -> list[float]:
    """The exact procedure's alphas (sigma_star^2 in units of ``1 / (n_O mu^2)``): ``alphas`` if given,
    else :data:`DEFAULT_ALPHAS` above the floor plus multiples of the floor, the floor being the
    smallest alpha at which the ``quantile`` share of runs can be made private by some sigma_delta."""
    if alphas is not None:
        return sorted(check_real("alphas (each)", a, 0.0, MAX_ALPHA, low_open=True) for a in alphas)
    runs = len(profiles)
    # floor of each run: mu_inf(s*) = mu_inf(1) / s*, so s*_min = mu_inf(1) / mu_target
    floors = np.sort([float(p.mu_limit(1.0).max(initial=0.0)) / mu_target for p in profiles])
    floor = float(floors[covered_runs(quantile, runs) - 1]) ** 2 * n_o * mu_target**2
    if not math.isfinite(floor):
        raise ValueError("no sigma_star makes the simulated runs private: the adversary sees too "
                         "much (more iterations, fewer neighbours or a weaker threat may help)")
    candidates = sorted({a for a in DEFAULT_ALPHAS if a > floor * 1.005 and a >= min_alpha}
                        | {floor * f for f in FLOOR_FACTORS if floor > 0 and floor * f >= min_alpha})
    if not candidates:  # min_alpha above the whole grid: it is the only choice
        candidates = [max(min_alpha, floor * 1.01)]
    return candidates


def _threat(collusion: float | None, observed_fraction: float | None) -> tuple[float, str]:
    """``(rho, description)`` of the threat; raises for out-of-range fractions."""
    if observed_fraction is None:
        rho = check_probability("collusion fraction rho", 0.0 if collusion is None else collusion, one=False)
        return rho, f"collusion rho={rho:g}"
    observed_fraction = check_probability("observed_fraction", observed_fraction)
    return 0.0, f"eavesdrop fraction={observed_fraction:g}"


def check_runs_fit(parties: int, base: IncaConfig, solver: str = "auto",
                   bound_settings: BoundSettings | None = None) -> None:
    """Raise ``ValueError`` (one line) if simulated runs of ``base`` among ``parties`` parties would not fit in
    memory: their traces, and the bound that certifies every run above the exact method's size (the exact
    method's own size depends on the run and is checked on it). Simulates nothing."""
    base.check(parties)
    if parties > EXACT_MAX_PARTIES and solver != "exact":  # every run is bounded
        check_bytes(f"the bound on the certificate of a simulated run of {parties} parties over "
                    f"{base.iterations} iterations", bound_bytes(parties, base.iterations, bound_settings))


def simulate_runs(
    parties: int,
    base: IncaConfig,
    seeds: np.ndarray,
    *,
    rho: float,
    observed_fraction: float | None,
    solver: str = "auto",
    nominal: tuple[float, float] | None = None,
    bound_settings: BoundSettings | None = None,
    progress: Callable[[int, int], None] | None = None,
    quantile: float | None = None,
) -> list[_Run]:
    """Draw ``len(seeds)`` executions (trace seed, view seed) and the sensitivity profile of each.

    ``nominal`` (unit-sensitivity sigmas) is where bound profiles are tightest; exact profiles ignore it.
    ``quantile`` (with ``nominal``): the share of runs the calibration will cover. The sigma_delta it picks
    is set by the ``k = R - ceil(quantile R) + 1`` runs that need the most, so a bound is not tightened
    below :data:`CHARGED_MARGIN` times the k-th largest maximum mu (at the nominal sigmas) of the runs
    before it (``charged_mu`` of :func:`~flwr_inca.privacy.bound.bound_profile`): a run below that level is
    rarely among them, and :func:`calibrate` bounds again alone any that is (docs/privacy.md, "Charging
    across runs"). Every bound stays sound. None: every run tightened alone.
    """
    check_runs_fit(parties, base, solver, bound_settings)
    runs = len(seeds)
    if quantile is not None:
        quantile = check_probability("quantile", quantile, zero=False)
    out: list[_Run] = []
    k = runs - covered_runs(quantile, runs) + 1 if quantile is not None and nominal is not None else 0
    maxima: list[float] = []  # each run's largest mu at the nominal sigmas
    for r in range(runs):
        trace = sample_trace(parties, base, int(seeds[r, 0]))
        if observed_fraction is None:
            view = random_collusion(trace, rho, int(seeds[r, 1]))
        else:
            view = random_eavesdrop(trace, observed_fraction, int(seeds[r, 1]))
        b, a = output_coefficients(trace)
        total = float(b.sum())
        lost = float(np.sum((b / total - 1.0 / parties) ** 2)) if total > 0 else math.inf
        finals = np.zeros(parties, dtype=bool)
        finals[trace.steps[-1].online] = True
        s_star, s_delta = nominal if nominal is not None else (None, None)
        charged = CHARGED_MARGIN * sorted(maxima)[-k] if k and len(maxima) >= k else None
        prof = profile(trace, view, solver=solver, sigma_star=s_star, sigma_delta=s_delta,
                       bound_settings=bound_settings, charged_mu=charged)
        if k:
            top = float(prof.mu(s_star, s_delta).max(initial=0.0))
            if math.isfinite(top):  # an unbounded mu (a party the view exposes whatever the sigmas) sets no level
                maxima.append(top)
        out.append(_Run(prof, trace, view, float(b @ b), float(np.sum(a * a)), total, lost,
                        int(finals[view.honest].sum()), charged if prof.method in ("bound", "cascade") else None))
        if progress is not None:
            progress(r + 1, runs)
    return out


def alpha_grid(
    sims: Sequence[SimulatedRun],
    procedure: str,
    mu_target: float,
    quantile: float,
    *,
    paper_n_o: float | None,
    alphas: tuple[float, ...] | None,
    min_alpha: float,
) -> tuple[list[float], float]:
    """``(candidate alphas, n_O)``: the paper's single alpha = 1.3 with ``n_O = paper_n_o``, the paper's
    ``n (1 - gamma - rho)`` (required by ``"paper"``), or the exact procedure's grid (given, or
    :data:`DEFAULT_ALPHAS` above the floor plus multiples of the floor) with n_O = the mean number of honest
    parties whose values reach the output (IncA: the honest finalists)."""
    if procedure == "paper":
        if paper_n_o is None:
            raise ValueError("the paper's procedure needs paper_n_o = n (1 - gamma - rho)")
        if not paper_n_o > 0:
            raise ValueError(f"n_O = n (1 - gamma - rho) = {paper_n_o:g} must be > 0")
        return [PAPER_ALPHA], float(paper_n_o)
    n_o = float(np.mean([s.honest_outputs for s in sims]))
    if n_o <= 0:
        raise ValueError("no honest party's value reaches the output in the simulated runs; nothing can be "
                         "calibrated")
    return alpha_candidates([s.profile for s in sims], mu_target, n_o, quantile, alphas=alphas,
                            min_alpha=min_alpha), n_o


def evaluate_alpha(
    alpha: float,
    sims: Sequence[SimulatedRun],
    *,
    procedure: str,
    mu_target: float,
    n_o: float,
    quantile: float,
    value_sensitivity: float,
    value_variance: float,
) -> dict[str, float]:
    """The sigmas one alpha needs (sigma_delta covering the required share of runs), the share of runs
    it certifies and the mean predicted MSE, in value units."""
    s_star = math.sqrt(alpha / (n_o * mu_target**2))  # unit sensitivity
    # the paper's procedure covers every feasible run; the exact one the required share of all runs
    s_delta, success = required_sigma_delta([s.profile for s in sims], s_star, mu_target,
                                            quantile=quantile if procedure == "exact" else 1.0,
                                            every_run=procedure == "exact")
    mse = (float(np.mean([s.expected_mse(s_star * value_sensitivity, s_delta * value_sensitivity, value_variance)
                          for s in sims])) if math.isfinite(s_delta) else math.inf)
    return {"alpha": alpha, "sigma_star": s_star * value_sensitivity,
            "sigma_delta": s_delta * value_sensitivity, "success_fraction": success, "predicted_mse": mse}


def pick_alpha(
    rows: list[dict[str, float]],
    procedure: str,
    quantile: float,
    *,
    runs: int,
    epsilon: float,
    delta: float,
    local_dp_sigma: float | None,
) -> tuple[dict[str, float], list[str]]:
    """The chosen row and notes: the paper's single alpha, or the most accurate alpha reaching the
    required share (else the most successful, then the most accurate). ``local_dp_sigma``: the local-DP
    noise level, to note a sigma_star that reaches it (None: no such note)."""
    notes: list[str] = []
    if procedure == "paper":
        best = rows[0]
        if best["success_fraction"] == 0:
            raise ValueError(
                f"impossible target for the paper's procedure: with sigma_star = {best['sigma_star']:.4g} "
                f"no sigma_delta makes any of the {runs} simulated runs ({epsilon:g}, {delta:g})-DP; the "
                "adversary observes too many messages (more iterations or a smaller collusion help), or "
                "use procedure='exact', which raises sigma_star as needed"
            )
        if best["success_fraction"] < 1:
            notes.append(f"{(1 - best['success_fraction']) * runs:.0f} of {runs} runs cannot be made private "
                         "at this sigma_star; sigma_delta covers the others")
    else:
        feasible = [row for row in rows
                    if row["success_fraction"] >= quantile - 1e-12 and math.isfinite(row["predicted_mse"])]
        if feasible:
            best = min(feasible, key=lambda row: row["predicted_mse"])
        else:
            best = max(rows, key=lambda row: (row["success_fraction"], -row["predicted_mse"]))
    if local_dp_sigma is not None and best["sigma_star"] >= 0.5 * local_dp_sigma:
        # as a ratio, so that the note holds when the calibration is rescaled (NoiseCalibrator)
        notes.append(f"sigma_star is {best['sigma_star'] / local_dp_sigma:.2f} x the local-DP level: "
                     "some party's messages are (almost) all observed; more iterations, fewer neighbours "
                     "or a smaller collusion fraction help")
    return best, notes


@dataclass(frozen=True)
class AlphaSelection:
    """How alpha is picked on simulated runs (:func:`alpha_grid`, :func:`evaluate_alpha`, :func:`pick_alpha`):
    the one selection of :func:`calibrate` and of the baselines'
    :func:`~flwr_inca.baselines.calibrate_samples`.

    ``paper_n_o``: the paper's ``n (1 - gamma - rho)``, required by ``"paper"`` (:func:`calibrate` derives
    gamma from its dropout model, a baseline has its own). ``local_dp_note``: note a sigma_star at the
    local-DP level ``value_sensitivity / mu_target``, with advice on IncA's iterations and neighbours; the
    baselines leave it out, as local DP and the gossip protocols sit at that level by design.
    """

    procedure: str
    mu_target: float
    quantile: float
    epsilon: float
    delta: float
    value_sensitivity: float
    value_variance: float
    alphas: tuple[float, ...] | None = None
    min_alpha: float = 1.0
    paper_n_o: float | None = None
    local_dp_note: bool = True

    def choose(self, sims: Sequence[SimulatedRun]) -> tuple[dict[str, float], list[dict[str, float]], list[str]]:
        """``(chosen row, every alpha's row, notes)``; rows in value units (:func:`evaluate_alpha`)."""
        candidates, n_o = alpha_grid(sims, self.procedure, self.mu_target, self.quantile, paper_n_o=self.paper_n_o,
                                     alphas=self.alphas, min_alpha=self.min_alpha)
        rows = [evaluate_alpha(a, sims, procedure=self.procedure, mu_target=self.mu_target, n_o=n_o,
                               quantile=self.quantile, value_sensitivity=self.value_sensitivity,
                               value_variance=self.value_variance) for a in candidates]
        local_dp_sigma = self.value_sensitivity / self.mu_target if self.local_dp_note else None
        best, notes = pick_alpha(rows, self.procedure, self.quantile, runs=len(sims), epsilon=self.epsilon,
                                 delta=self.delta, local_dp_sigma=local_dp_sigma)
        return best, rows, notes


def calibrate(
    epsilon: float,
    delta: float,
    parties: int,
    *,
    iterations: int = 20,
    neighbors: int = 1,
    collusion: float | None = 0.1,
    observed_fraction: float | None = None,
    dropout: DropoutModel | None = None,
    topology: str | Topology = "random",
    schedule: str | InjectionSchedule = "incremental",
    runs: int = 100,
    seed: int | None = 0,
    procedure: str = "exact",
    alphas: tuple[float, ...] | None = None,
    value_sensitivity: float = 1.0,
    value_variance: float = 1.0 / 12.0,
    target_success: float = 1.0,
    min_alpha: float = 1.0,
    progress: Callable[[int, int], None] | None = None,
    solver: str = "auto",
    bound_settings: BoundSettings | None = None,
    bound_passes: int = 1,
    tight_runs: bool = False,
    run_cache: dict | None = None,
) -> Calibration:
    """Find sigma_star and sigma_delta for (epsilon, delta)-DP of every honest party.

    Args:
        epsilon, delta: the target, per execution.
        parties: n.
        iterations, neighbors, topology, schedule, dropout: the protocol as it will run.
        collusion: fraction rho of corrupted parties (Collusion DP); ignored if ``observed_fraction``.
        observed_fraction: fraction of messages intercepted per iteration (Eavesdrop DP).
        runs: R, the number of simulated executions.
        procedure: ``"exact"`` (improved) or ``"paper"``.
        alphas: grid for the exact procedure, sigma_star^2 in units of 1 / (n_O mu^2)
            (default: :data:`DEFAULT_ALPHAS` above the floor, plus multiples of the floor).
        value_sensitivity: size of a change of one value (1 for [0, 1]; 2C for an L2 ball of radius C).
        value_variance: variance of one value coordinate, for the predicted MSE (1/12: U[0, 1]).
        target_success: share of runs that must meet the target (exact procedure; paper uses all).
        min_alpha: smallest alpha the exact procedure may pick. The default 1 keeps sigma_star^2 at
            least at the central-DP level 1/(n_O mu^2), so the guarantee never relies on other parties
            dropping out (with permanent dropouts, uncancelled noise alone can protect everyone in the
            simulated runs, and smaller alphas then give a lower MSE; set 0 to allow them).
        progress: called as ``progress(r, R)`` after each simulated run.
        solver: how each run is certified: ``"auto"`` (exact when affordable, else a sound bound),
            ``"exact"``, ``"bound"`` or ``"cascade"`` (:func:`~flwr_inca.privacy.certificate.certify`).
        bound_settings: work budget of the bound.
        bound_passes: 1 (default): each run certified with a bound is bounded once, near the central-DP
            level (its bound holds at every pair of sigmas); 2: bounded again at the sigmas the first
            pass chose (slightly less noise, twice the cost).
        tight_runs: False (default): a run's bound is tightened only above the level the runs before it
            already charge (:func:`simulate_runs`' ``quantile``; at n = 10,000 most runs then need no global
            solve), and a charged run that sets sigma_delta at the chosen sigma_star (or cannot be made
            private there) is bounded again alone; the sigmas may differ slightly from those of tight runs
            (docs/privacy.md, "Charging across runs"); True: every run's bound is tightened on its own (its
            largest mu as tight as a lone ``certify``'s; slower). ``bound_passes=2`` bounds every run alone.
        run_cache: a dict kept between calls: runs certified exactly (they do not depend on the target)
            are kept in it and reused by a call with the same protocol, threat, parties, runs, seed and
            solver at another target (docs/privacy.md, "Calibrating again at another target").
    """
    start = time.perf_counter()
    epsilon, delta, parties, runs, target_success, value_sensitivity, value_variance, min_alpha, alphas = (
        _checked(procedure, epsilon, delta, parties, runs, target_success, value_sensitivity, value_variance,
                 min_alpha, alphas, solver, bound_settings))
    bound_passes = check_int("bound_passes", bound_passes, 1, 2)
    tight_runs = check_bool("tight_runs", tight_runs)
    rho, threat = _threat(collusion, observed_fraction)
    # the paper's classic bound raises for epsilon >= 1
    mu_target = classic_mu(epsilon, delta) if procedure == "paper" else mu_for_epsilon(epsilon, delta)

    base = IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=iterations, neighbors=neighbors,
                      schedule=schedule, topology=topology, dropout=dropout)
    seeds = simulation_seeds(seed, runs)
    quantile = 1.0 if procedure == "paper" else float(target_success)
    # bound profiles are tightest near their nominal sigmas: start near the central-DP level
    guess_star = math.sqrt(1.0 / (max(parties * (1.0 - rho), 1.0) * mu_target**2))
    nominal = (guess_star, BOUND_NOMINAL_RATIO * guess_star)
    sims = _kept(run_cache, (parties, repr(base), rho, observed_fraction, runs, seed, solver), lambda: (
        simulate_runs(parties, base, seeds, rho=rho, observed_fraction=observed_fraction, solver=solver,
                      nominal=nominal, bound_settings=bound_settings, progress=progress,
                      quantile=None if tight_runs or bound_passes == 2 else quantile)))
    paper_n_o = parties * (1.0 - _dropout_fraction(dropout, sims, parties, rho) - rho)  # the paper's n_O
    selection = AlphaSelection(procedure, mu_target, quantile, epsilon, delta, value_sensitivity, value_variance,
                               alphas, min_alpha, paper_n_o)
    best, rows, notes = _choose(sims, selection, nominal, bound_settings, bound_passes, solver)
    return Calibration(
        procedure=procedure, epsilon=float(epsilon), delta=float(delta), mu_target=float(mu_target),
        sigma_star=best["sigma_star"], sigma_delta=best["sigma_delta"], alpha=best["alpha"],
        success_fraction=best["success_fraction"], predicted_mse=best["predicted_mse"], runs=runs,
        parties=int(parties), iterations=int(iterations), neighbors=int(neighbors), threat=threat,
        value_sensitivity=float(value_sensitivity), seconds=time.perf_counter() - start, alternatives=rows,
        run_seeds=[(int(a), int(b)) for a, b in seeds], notes=notes, value_variance=float(value_variance),
        mse_terms=_mse_terms(sims))


def _mse_terms(sims: Sequence[SimulatedRun]) -> dict[str, float]:
    """The predicted MSE's terms (:attr:`Calibration.mse_terms`), each a mean over the runs: a run's closed
    form is linear in the value variance and in the two noise variances."""
    return {"lost": float(np.mean([s.expected_mse(0.0, 0.0, 1.0) for s in sims])),
            "star": float(np.mean([s.expected_mse(1.0, 0.0, 0.0) for s in sims])),
            "delta": float(np.mean([s.expected_mse(0.0, 1.0, 0.0) for s in sims]))}


def _mse(terms: dict[str, float], sigma_star: float, sigma_delta: float, value_variance: float) -> float:
    """:attr:`Calibration.mse_terms` at these sigmas and value variance; inf where a sigma or a term is (a term
    of coefficient 0, e.g. sigma_delta's without dropouts, adds nothing whatever its factor)."""
    if set(terms) != {"lost", "star", "delta"}:
        raise ValueError("this calibration has no mse_terms (lost, star, delta): only calibrate() and "
                         "NoiseCalibrator make them")
    total = 0.0
    for factor, term in ((value_variance, terms["lost"]), (sigma_star * sigma_star, terms["star"]),
                         (sigma_delta * sigma_delta, terms["delta"])):
        if term != 0:
            total += factor * term
    return total if math.isfinite(total) else math.inf


def _kept(run_cache: dict | None, key: tuple, simulate: Callable[[], list[_Run]]) -> list[_Run]:
    """The runs kept in ``run_cache`` under ``key``, else ``simulate()``'s, kept there when every one was
    certified exactly (a bound depends on the target it was tightened for)."""
    sims = run_cache.get(key) if run_cache is not None else None
    if sims is None:
        sims = simulate()
        if run_cache is not None and all(isinstance(run.profile, SensitivityProfile) for run in sims):
            run_cache[key] = sims
    return sims


def _checked(procedure, epsilon, delta, parties, runs, target_success, value_sensitivity, value_variance,
             min_alpha, alphas, solver, bound_settings) -> tuple:
    """:func:`calibrate`'s arguments, each checked (``ValueError`` naming it) and normalized."""
    if procedure not in ("exact", "paper"):
        raise ValueError(f"procedure must be 'exact' or 'paper', got {procedure!r}")
    if alphas is not None:
        alphas = tuple(alpha_candidates([], 1.0, 1.0, 1.0, alphas=alphas))  # each checked
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    if bound_settings is not None and not isinstance(bound_settings, BoundSettings):
        raise ValueError(f"bound_settings must be a BoundSettings or None, got {type(bound_settings).__name__}")
    return (check_epsilon("epsilon", epsilon), check_delta("delta", delta), check_parties("parties", parties),
            check_runs("runs", runs), check_probability("target_success", target_success, zero=False),
            check_scale("value_sensitivity", value_sensitivity, zero=False),
            check_real("value_variance", value_variance, 0.0, MAX_SCALE),
            check_real("min_alpha", min_alpha, 0.0, MAX_ALPHA), alphas)


def _choose(sims: list[_Run], selection: AlphaSelection, nominal: tuple[float, float],
            bound_settings: BoundSettings | None, bound_passes: int, solver: str) -> tuple[dict, list, list[str]]:
    """:func:`calibrate`'s choice on its runs (:func:`_choose_charged`); with ``bound_passes=2`` the runs
    certified with a bound are bounded again at the chosen sigmas and the choice is made again. Returns
    ``(best, rows, notes)``, the notes saying how the runs were certified."""
    best, rows, notes, charged, rebounded = _choose_charged(sims, selection, nominal, bound_settings)
    runs = len(sims)
    bounded = [r for r, s in enumerate(sims) if s.profile.method in ("bound", "cascade")]
    passes = 1
    if bounded and bound_passes == 2 and math.isfinite(best["sigma_delta"]):
        passes = 2
        # second pass: bound those runs again where they are used, at the chosen (unit) sigmas
        at = (best["sigma_star"] / selection.value_sensitivity, best["sigma_delta"] / selection.value_sensitivity)
        for r in bounded:
            _bound_again(sims[r], at, bound_settings)
        best, rows, notes = selection.choose(sims)
    if bounded:
        notes.append(f"{len(bounded)} of {runs} runs certified with the sound bound (solver={solver!r}, "
                     f"bounded {'twice' if passes == 2 else 'once'})")
    if charged:
        notes.append(f"{charged} of {runs} runs bounded only above {CHARGED_MARGIN:g} x the level the runs before "
                     f"them charge (tight_runs=False); {rebounded} of them bounded again alone, as they set "
                     "sigma_delta")
    return best, rows, notes


def _choose_charged(sims: list[_Run], selection: AlphaSelection, nominal: tuple[float, float],
                    bound_settings: BoundSettings | None) -> tuple[dict, list, list[str], int, int]:
    """The choice on runs some of which were charged (bounded only above a level): those that set sigma_delta
    at the chosen sigma_star, or cannot be made private there, are bounded again alone and the choice is made
    again (each pass at least one run: at most R passes). If no choice can be made (the paper's alpha, every
    run infeasible), all of them are. Returns ``(best, rows, notes, charged runs, runs bounded again)``."""
    charged = sum(s.charged is not None for s in sims)
    rebounded = 0
    while True:
        try:
            best, rows, notes = selection.choose(sims)
        except ValueError:
            again = [r for r, s in enumerate(sims) if s.charged is not None]
            if not again:
                raise
        else:
            again = _loose_and_binding(sims, best, selection.mu_target, selection.value_sensitivity)
        if not again:
            return best, rows, notes, charged, rebounded
        for r in again:
            _bound_again(sims[r], nominal, bound_settings)
        rebounded += len(again)


def _bound_again(run: _Run, nominal: tuple[float, float], bound_settings: BoundSettings | None) -> None:
    """Bound ``run`` again on its own (no ``charged_mu``), tightest at ``nominal`` (unit sensitivity)."""
    run.profile = profile(run.trace, run.view, solver=run.profile.method, sigma_star=nominal[0],
                          sigma_delta=nominal[1], bound_settings=bound_settings)
    run.charged = None


def _loose_and_binding(sims: list[_Run], best: dict[str, float], mu_target: float,
                       value_sensitivity: float) -> list[int]:
    """The charged runs that need at least the chosen sigma_delta at the chosen sigma_star (those that set
    it), or that no sigma_delta makes private there: their bound may be looser than alone."""
    s_star, s_delta = best["sigma_star"] / value_sensitivity, best["sigma_delta"] / value_sensitivity
    out = []
    for r, s in enumerate(sims):
        if s.charged is None:
            continue
        need = s.profile.min_sigma_delta(s_star, mu_target)
        if need == math.inf or need >= s_delta * (1 - 1e-9) > 0:
            out.append(r)
    return out


def _dropout_fraction(dropout: DropoutModel | None, sims: list[_Run], n: int, rho: float) -> float:
    """gamma of the paper's n_O = n (1 - gamma - rho)."""
    if dropout is None or isinstance(dropout, NoDropout):
        return 0.0
    if isinstance(dropout, PermanentDropout):
        return dropout.gamma
    # other models: the observed share of honest parties missing at the end
    honest = n * (1.0 - rho)
    return float(1.0 - np.mean([s.honest_outputs for s in sims]) / honest) if honest > 0 else 0.0


def _rescaled(base: Calibration, n: int, scale: float, mu_target: float, delta: float,
              value_sensitivity: float) -> Calibration:
    """``base`` for ``n`` parties with both sigmas times ``scale`` (:class:`NoiseCalibrator`), sigma_star also
    times ``sqrt(n_base / n)``, for ``mu_target`` and ``value_sensitivity``; every row's predicted MSE at its
    new sigmas. At another party count each MSE term is extrapolated by ``n_base / n`` (each is a mean over
    about n parties: 1/n of the central noise's variance, and of the dropouts' share). The row chosen is
    ``base``'s: at ``n_base`` still the most accurate (every noise term scales alike); at another count
    not chosen again (the terms scale unlike there)."""
    ratio = base.parties / n
    terms = {key: value * ratio for key, value in base.mse_terms.items()}

    def row(r: dict[str, float]) -> dict[str, float]:
        star, dlt = r["sigma_star"] * scale * math.sqrt(ratio), r["sigma_delta"] * scale
        return {**r, "sigma_star": star, "sigma_delta": dlt,
                "predicted_mse": _mse(terms, star, dlt, base.value_variance)}

    best = row({"sigma_star": base.sigma_star, "sigma_delta": base.sigma_delta})
    notes = list(base.notes)
    if n != base.parties:
        notes.append(f"calibrated for {base.parties} parties and scaled to {n}: sigma_star x sqrt({base.parties} / "
                     f"{n}), the predicted MSE's terms x {base.parties} / {n}")
    return replace(base, sigma_star=best["sigma_star"], sigma_delta=best["sigma_delta"],
                   predicted_mse=best["predicted_mse"],
                   # the paper's procedure calibrates for its classic mu (base's: at this target)
                   mu_target=mu_target if base.procedure == "exact" else base.mu_target,
                   epsilon=epsilon_for_delta(mu_target, delta), value_sensitivity=value_sensitivity, parties=n,
                   alternatives=[row(r) for r in base.alternatives], mse_terms=terms, notes=notes,
                   calibrated_parties=base.parties)


REUSE_WITHIN = 0.25  # a calibration serves every party count within 25% of the one it was made for


class NoiseCalibrator:
    """The calibrated noise of a training's rounds, for any number of parties and any target.

    One rule for every driver (``IncaStrategy``, the simulator, the study): the noise for ``n`` parties
    and a per-round target ``mu`` is :func:`calibrate`'s, made once per party count and reused:

    * for every target and value sensitivity: the exact procedure is scale-free (a view's certificate is
      proportional to S / sigma when both sigmas scale together, and the predicted MSE's choice of alpha
      does not depend on the scale), so one calibration at unit sensitivity and a reference target serves
      every (mu, S) by scaling both sigmas by ``S * mu_ref / mu``. The paper's procedure (the classic
      bound, not scale-free) is calibrated per target;
    * for party counts within :data:`REUSE_WITHIN` of one already calibrated: sigma_star is scaled by
      ``sqrt(n_cal / n)`` (it protects through the sum of n values), sigma_delta is kept. The paper's
      procedure, at a new target, is calibrated again at that party count, on the runs it simulated
      there (kept: exact certificates do not depend on the target), so a new target simulates nothing.

    Calibration is a choice of noise, not a guarantee: every round is certified on the execution that
    happened and charged that certificate.

    Args:
        iterations, neighbors, topology, schedule, dropout: the protocol as it will run.
        collusion, observed_fraction: the threat (see :func:`calibrate`).
        runs: simulated executions per calibration.
        seed: the calibration's seed; each party count derives its own from it.
        procedure, target_success: as in :func:`calibrate`.
    """

    REFERENCE_MU = 0.05  # the unit-sensitivity target the exact procedure is calibrated at

    def __init__(self, *, iterations: int, neighbors: int = 1, collusion: float | None = 0.1,
                 observed_fraction: float | None = None, dropout: DropoutModel | None = None,
                 topology: str | Topology = "random", schedule: str | InjectionSchedule = "incremental",
                 runs: int = 20, seed: int = 0, procedure: str = "exact", target_success: float = 1.0,
                 progress: Callable[[str], None] | None = None) -> None:
        if procedure not in ("exact", "paper"):
            raise ValueError(f"procedure must be 'exact' or 'paper', got {procedure!r}")
        self.settings = {"iterations": iterations, "neighbors": neighbors, "collusion": collusion,
                         "observed_fraction": observed_fraction, "dropout": dropout, "topology": topology,
                         "schedule": schedule, "runs": check_int("runs (calibration_runs)", runs, 1),
                         "procedure": procedure,
                         "target_success": check_probability("target_success", target_success, zero=False)}
        self.seed = check_int("seed", seed, 0)
        self.progress = progress
        self.calibrations: dict[tuple[int, float, float], Calibration] = {}  # (n, reference mu, delta), S = 1
        self._screens: dict[int, NoiseCalibrator] = {}  # screening(runs), kept with the calibrator it screens
        self._runs: dict = {}  # calibrate()'s run_cache: the paper's procedure recalibrates on the same runs
        self.seconds = 0.0

    def calibration(self, n: int, mu_target: float, delta: float, value_sensitivity: float) -> Calibration:
        """The calibration for ``n`` parties, per-round GDP target ``mu_target`` at ``delta`` (the epsilon it
        reports), and value sensitivity ``value_sensitivity`` (sigmas in value units)."""
        n = check_int("parties", n, 2)
        mu_target = check_real("mu_target", mu_target, 0.0, low_open=True)
        exact = self.settings["procedure"] == "exact"
        ref = self.REFERENCE_MU if exact else mu_target
        n_cal = self._nearest(n, ref, delta)
        if n_cal is not None:
            base = self.calibrations[(n_cal, ref, delta)]
        else:
            # a party count already calibrated within reach (at another target: the paper's procedure) has
            # its simulated runs kept, so calibrating it again at this target simulates nothing
            n_cal = self._nearest(n)
            n_cal = n if n_cal is None else n_cal
            base = self._calibrate(n_cal, ref, delta)
        return _rescaled(base, n, value_sensitivity * ref / mu_target, mu_target, delta, value_sensitivity)

    def sigmas(self, n: int, mu_target: float, delta: float, value_sensitivity: float) -> tuple[float, float]:
        """``(sigma_star, sigma_delta)`` in value units of :meth:`calibration`."""
        cal = self.calibration(n, mu_target, delta, value_sensitivity)
        return cal.sigma_star, cal.sigma_delta

    def has_calibration(self, n: int, mu_target: float, delta: float) -> bool:
        """Whether :meth:`calibration` for ``n`` parties at ``mu_target`` and ``delta`` is already made (no
        simulated run needed)."""
        ref = self.REFERENCE_MU if self.settings["procedure"] == "exact" else mu_target
        return self._nearest(int(n), ref, delta) is not None

    def screening(self, runs: int) -> NoiseCalibrator:
        """A calibrator like this one over only the first ``runs`` of its simulated runs (the same executions
        and adversaries): a cheap look at the noise this one will need. Its worst case is over a subset of
        this one's runs, so it asks for no more noise in practice (the chosen alpha is an argmin, so this is
        not a theorem: use it to rule out, not to certify)."""
        runs = min(check_int("runs", runs, 1), self.settings["runs"])
        if runs not in self._screens:  # kept: a calibrator shared between trainings is screened once
            s = {key: value for key, value in self.settings.items() if key != "runs"}
            self._screens[runs] = NoiseCalibrator(**s, runs=runs, seed=self.seed)
        return self._screens[runs]

    def _nearest(self, n: int, ref: float | None = None, delta: float | None = None) -> int | None:
        """The calibrated party count nearest ``n`` within :data:`REUSE_WITHIN` of it (calibrated at ``ref``
        and ``delta``; without them, at any), or None."""
        near = [(abs(m - n), m) for (m, r, d) in self.calibrations
                if (ref is None or (r == ref and d == delta)) and abs(m - n) <= REUSE_WITHIN * m]
        return min(near)[1] if near else None

    def seed_for(self, n: int) -> int:
        """The seed of the simulated runs of ``n`` parties (each party count derives its own from ``seed``):
        :func:`calibrate` with it simulates the same executions."""
        return int(np.random.SeedSequence(self.seed, spawn_key=(check_int("parties", n, 2),))
                   .generate_state(1, dtype=np.uint64)[0])

    def _calibrate(self, n: int, ref: float, delta: float) -> Calibration:
        if self.progress is not None:
            self.progress(f"calibrating the noise for n = {n} parties over {self.settings['runs']} simulated runs")
        start = time.perf_counter()
        s = self.settings
        seed = self.seed_for(n)
        cal = calibrate(epsilon_for_delta(ref, delta), delta, n, iterations=s["iterations"],
                        neighbors=min(s["neighbors"], n - 1), collusion=s["collusion"],
                        observed_fraction=s["observed_fraction"], dropout=s["dropout"], topology=s["topology"],
                        schedule=s["schedule"], runs=s["runs"], seed=seed, procedure=s["procedure"],
                        target_success=s["target_success"], value_sensitivity=1.0, run_cache=self._runs)
        self.seconds += time.perf_counter() - start
        self.calibrations[(n, ref, delta)] = cal
        return cal

