"""Calibrate-then-measure, the paper's two experiments (Sec. 5.2), for any linear-Gaussian baseline."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .._checks import check_bytes, check_delta, check_epsilon, check_int, check_parties, check_runs
from ..baselines.base import LinearGaussianBaseline, Threat
from ..baselines.calibration import (
    MseMeasurement,
    NoiseCalibration,
    calibrate_samples,
    measure_mse,
    paper_dropout_fraction,
    sample_views,
)
from .common import ProgressBar

__all__ = ["Calibrated", "calibrate_and_measure", "units"]


@dataclass
class Calibrated:
    """One procedure's calibration of one baseline and the MSE it then measured (None if infeasible)."""

    calibration: NoiseCalibration
    mse: MseMeasurement | None

    @property
    def measured(self) -> float:
        return self.mse.mse if self.mse is not None else math.inf


def units(runs: int, procedures: int = 2) -> int:
    """Progress units of one :func:`calibrate_and_measure`: the views, then the MSE runs."""
    return runs * (1 + procedures)


def calibrate_and_measure(
    baseline: LinearGaussianBaseline,
    n: int,
    epsilon: float,
    delta: float,
    threat: Threat,
    *,
    runs: int,
    seed: int,
    bar: ProgressBar,
    status: str,
    dim: int = 8,
    procedures: Sequence[str] = ("paper", "exact"),
) -> dict[str, Calibrated]:
    """First experiment: worst-case noise over ``runs`` simulated executions (shared by both procedures);
    second: ``runs`` fresh executions on values from U[0, 1] give the MSE per coordinate (``dim``
    independent coordinates per run, to average the estimate over more draws)."""
    n = check_parties("n", n)
    epsilon, delta = check_epsilon("epsilon", epsilon), check_delta("delta", delta)
    runs, seed = check_runs("runs", runs), check_int("seed", seed, 0)
    dim = check_int("dim", dim, 1)
    check_bytes(f"the values of {n} parties x {dim} coordinates", 8.0 * 8 * n * dim)
    bar.set_status(f"{status}: calibrating")
    samples = sample_views(baseline, n, threat, runs, seed, bar.callback())
    rho = threat.fraction if threat.kind == "collusion" else 0.0
    paper_n_o = n * (1.0 - paper_dropout_fraction(baseline) - rho)
    out = {}
    for p in procedures:
        cal = calibrate_samples(samples, epsilon, delta, procedure=p, paper_n_o=paper_n_o, baseline=baseline.name)
        bar.set_status(f"{status}: MSE ({p})")
        if math.isfinite(cal.sigma_star) and math.isfinite(cal.sigma_delta):
            mse = measure_mse(cal.apply(baseline), n, runs, seed=seed + 7919, dim=dim, progress=bar.callback())
        else:
            mse = None
            bar.advance(runs)
        out[p] = Calibrated(cal, mse)
    return out
