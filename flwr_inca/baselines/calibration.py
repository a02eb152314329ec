"""One calibration for every linear-Gaussian baseline, and the accuracy they then reach.

:func:`calibrate_baseline` simulates R executions of a baseline, each against a random adversary,
computes each one's exact :class:`~flwr_inca.privacy.certificate.SensitivityProfile` once, and runs
both procedures of :func:`flwr_inca.privacy.calibrate` on the same simulated views:

* ``"paper"`` (Sec. 5.2): ``sigma_star^2 = 1.3 * 2 ln(1.25/delta) / (n_O epsilon^2)`` with
  ``n_O = n (1 - gamma - rho)``; per run the smallest sigma_delta whose exact check meets the classic
  threshold ``mu <= epsilon / c``; the worst case over the runs.
* ``"exact"`` (improved): the tight analytic-Gaussian threshold and the alpha (sigma_star^2 in units of
  ``1 / (n_O mu^2)``, n_O the mean number of honest outputs) that minimises the predicted MSE.

So IncA, GOPA and CorDP-DME are calibrated by one check for the same kind of execution, not each by its
own loose bound. The selection (the grid of alphas, the sigma_delta each needs by a running maximum over
the runs, the predicted MSE, the choice) is :func:`flwr_inca.privacy.calibrate`'s own
(:class:`~flwr_inca.privacy.calibration.AlphaSelection`): for IncA the result is exactly
``privacy.calibrate``'s (same seeds, same numbers; tested). Two things differ, by design: the paper's
``n_O = n (1 - gamma - rho)`` takes a baseline's own gamma (:func:`paper_dropout_fraction`), and the
note on a sigma_star at the local-DP level (advice on IncA's iterations and neighbours) is left out.

:func:`measure_mse` then runs fresh executions on values drawn i.i.d. from U[0, 1] and reports the
empirical mean squared error against the true mean, as the paper's second experiment does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .._json import jsonable
from ..privacy.calibration import AlphaSelection, simulation_seeds
from ..privacy.certificate import SensitivityProfile
from ..privacy.conversions import classic_mu, mu_for_epsilon
from ..protocol.dropout import NoDropout, PermanentDropout
from ..protocol.noise import resolve_seed
from .base import LinearGaussianBaseline, OutputWeights, Threat, check_positive_int

__all__ = [
    "MseMeasurement",
    "NoiseCalibration",
    "ViewSample",
    "calibrate_baseline",
    "calibrate_samples",
    "measure_mse",
    "paper_dropout_fraction",
    "sample_views",
]

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ViewSample:
    """One simulated execution seen by one adversary: its exact certificate and its output."""

    profile: SensitivityProfile
    weights: OutputWeights
    honest_outputs: int

    def expected_mse(self, sigma_star: float, sigma_delta: float, value_variance: float) -> float:
        """Predicted per-coordinate MSE of this execution's estimate (:meth:`OutputWeights.expected_mse`)."""
        return self.weights.expected_mse(sigma_star, sigma_delta, value_variance)


@dataclass
class NoiseCalibration:
    """Noise levels (value units) for a target (epsilon, delta), with their predicted accuracy.

    ``success_fraction``: share of the simulated runs whose every honest party meets the target at
    these sigmas (exact check); ``predicted_mse``: mean over the runs of the closed-form MSE for values
    of variance ``value_variance``; ``alternatives``: every alpha tried.
    """

    baseline: str
    procedure: str
    epsilon: float
    delta: float
    mu_target: float
    sigma_star: float
    sigma_delta: float
    alpha: float
    n_o: float
    success_fraction: float
    predicted_mse: float
    runs: int
    seconds: float
    alternatives: list[dict[str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def apply(self, baseline: LinearGaussianBaseline) -> LinearGaussianBaseline:
        """``baseline`` with these sigmas."""
        if not (math.isfinite(self.sigma_star) and math.isfinite(self.sigma_delta)):
            raise ValueError(f"{self.baseline} ({self.procedure}): no finite noise meets the target")
        return baseline.with_sigmas(self.sigma_star, self.sigma_delta)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record (``flwr_inca._json``: an infinite sigma is written ``"inf"``)."""
        return jsonable(asdict(self))


def sample_views(baseline: LinearGaussianBaseline, n: int, threat: Threat, runs: int, seed: int | None = 0,
                 progress: Progress | None = None) -> list[ViewSample]:
    """Simulate ``runs`` executions of ``baseline`` among n parties, each against a random adversary."""
    runs = check_positive_int("runs", runs)
    samples = []
    for r, (s_exec, s_view) in enumerate(simulation_seeds(seed, runs)):
        execution = baseline.sample_execution(n, int(s_exec))
        view = baseline.adversary(execution, threat, int(s_view))
        samples.append(ViewSample(baseline.sensitivity_profile(execution, view), baseline.output_weights(execution),
                                  baseline.honest_outputs(execution, view)))
        if progress is not None:
            progress(r + 1, runs)
    return samples


def calibrate_samples(
    samples: Sequence[ViewSample],
    epsilon: float,
    delta: float,
    *,
    procedure: str = "exact",
    paper_n_o: float | None = None,
    alphas: Sequence[float] | None = None,
    value_sensitivity: float = 1.0,
    value_variance: float = 1.0 / 12.0,
    target_success: float = 1.0,
    min_alpha: float = 1.0,
    baseline: str = "",
) -> NoiseCalibration:
    """Both procedures of :func:`flwr_inca.privacy.calibrate` on already simulated views (see the
    module docstring), by its selection (:class:`~flwr_inca.privacy.calibration.AlphaSelection`);
    ``paper_n_o`` is the paper's ``n (1 - gamma - rho)``, required by ``"paper"``."""
    start = time.perf_counter()
    if procedure not in ("exact", "paper"):
        raise ValueError(f"procedure must be 'exact' or 'paper', got {procedure!r}")
    if not samples:
        raise ValueError("samples must hold at least one simulated view")
    if not (0 < target_success <= 1):
        raise ValueError(f"target_success must be in (0, 1], got {target_success!r}")
    if not (math.isfinite(value_sensitivity) and value_sensitivity > 0):
        raise ValueError(f"value_sensitivity must be > 0, got {value_sensitivity!r}")
    # the paper's classic bound raises for epsilon >= 1
    mu_target = classic_mu(epsilon, delta) if procedure == "paper" else mu_for_epsilon(epsilon, delta)
    selection = AlphaSelection(
        procedure, mu_target, 1.0 if procedure == "paper" else float(target_success), epsilon, delta,
        value_sensitivity, value_variance, None if alphas is None else tuple(alphas), min_alpha, paper_n_o,
        local_dp_note=False)
    try:
        best, rows, notes = selection.choose(samples)
    except ValueError as exc:
        raise ValueError(f"{baseline or 'baseline'}: {exc}") from None
    n_o = float(paper_n_o) if procedure == "paper" else float(np.mean([s.honest_outputs for s in samples]))
    return NoiseCalibration(
        baseline=baseline, procedure=procedure, epsilon=float(epsilon), delta=float(delta),
        mu_target=float(mu_target), sigma_star=best["sigma_star"], sigma_delta=best["sigma_delta"],
        alpha=best["alpha"], n_o=n_o, success_fraction=best["success_fraction"],
        predicted_mse=best["predicted_mse"], runs=len(samples), seconds=time.perf_counter() - start,
        alternatives=rows, notes=notes,
    )


def paper_dropout_fraction(baseline: LinearGaussianBaseline) -> float:
    """gamma of the paper's ``n_O = n (1 - gamma - rho)`` for a baseline: its ``gamma`` attribute, or
    the ``PermanentDropout`` of an IncA config (0 without dropouts)."""
    if hasattr(baseline, "gamma"):
        return float(baseline.gamma)
    dropout = getattr(getattr(baseline, "config", None), "dropout", None)
    if dropout is None or isinstance(dropout, NoDropout):
        return 0.0
    if isinstance(dropout, PermanentDropout):
        return dropout.gamma
    raise ValueError(f"the paper's n_O needs a permanent dropout fraction; got {dropout!r}")


def calibrate_baseline(
    baseline: LinearGaussianBaseline,
    n: int,
    epsilon: float,
    delta: float,
    threat: Threat,
    *,
    runs: int = 100,
    seed: int | None = 0,
    procedures: Sequence[str] = ("paper", "exact"),
    progress: Progress | None = None,
    **options: Any,
) -> dict[str, NoiseCalibration]:
    """Calibrate ``baseline`` for n parties, (epsilon, delta) and ``threat`` with each procedure, on
    one shared set of ``runs`` simulated views. ``options`` go to :func:`calibrate_samples`."""
    for p in procedures:
        if p not in ("exact", "paper"):
            raise ValueError(f"procedures must be 'exact' and/or 'paper', got {p!r}")
    samples = sample_views(baseline, n, threat, runs, seed, progress)
    rho = threat.fraction if threat.kind == "collusion" else 0.0
    paper_n_o = n * (1.0 - paper_dropout_fraction(baseline) - rho)
    return {p: calibrate_samples(samples, epsilon, delta, procedure=p, paper_n_o=paper_n_o,
                                 baseline=baseline.name, **options) for p in procedures}


@dataclass
class MseMeasurement:
    """Empirical MSE over ``runs`` executions: the mean of ``(estimate - mean(x))^2`` per coordinate,
    with its standard error."""

    mse: float
    stderr: float
    runs: int
    details: dict[str, float] = field(default_factory=dict)


def measure_mse(baseline: Any, n: int, runs: int, seed: int | None = 0, dim: int = 1,
                progress: Progress | None = None) -> MseMeasurement:
    """Run ``baseline`` ``runs`` times on fresh values ``x ~ U[0, 1]^(n x dim)`` (fresh executions)."""
    runs = check_positive_int("runs", runs)
    dim = check_positive_int("dim", dim)
    root = np.random.SeedSequence([resolve_seed(seed), 0x4D5345])
    errors = np.empty(runs)
    party_errors = np.full(runs, np.nan)
    outputs = np.empty(runs)
    for r, child in enumerate(root.spawn(runs)):
        s_values, s_run = child.generate_state(2, dtype=np.uint64)
        x = np.random.default_rng(int(s_values)).random((n, dim))
        res = baseline.run(x, int(s_run))
        errors[r] = float(np.mean((np.asarray(res.estimate, dtype=np.float64).reshape(-1) - x.mean(axis=0)) ** 2))
        if res.party_estimates is not None:
            party_errors[r] = float(np.mean((np.asarray(res.party_estimates, dtype=np.float64).reshape(n, -1)
                                             - x.mean(axis=0)) ** 2))
        outputs[r] = len(res.outputs)
        if progress is not None:
            progress(r + 1, runs)
    stderr = float(errors.std(ddof=1) / math.sqrt(runs)) if runs > 1 else math.inf
    details = {"mean_outputs": float(outputs.mean())}
    if not np.isnan(party_errors).any():
        details["party_mse"] = float(party_errors.mean())  # each party's own estimate (gossip)
    return MseMeasurement(float(errors.mean()), stderr, runs, details)
