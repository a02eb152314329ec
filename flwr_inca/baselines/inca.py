"""IncA behind the baselines' interface, so that it is calibrated and measured exactly like them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..privacy.certificate import exact_bytes
from ..privacy.linear_system import ObservationModel, build_model
from ..privacy.views import AdversaryView, random_collusion, random_eavesdrop
from ..protocol.config import IncaConfig
from ..protocol.engine import replay, run_inca, sample_trace
from ..protocol.trace import ExecutionTrace
from ..protocol.utility import output_coefficients
from .base import BaselineResult, LinearGaussianBaseline, OutputWeights, Threat

__all__ = ["IncaBaseline"]


@dataclass(frozen=True)
class IncaBaseline(LinearGaussianBaseline):
    """IncA (paper Algorithms 1 and 2) with the parameters of ``config``; an execution is its
    :class:`~flwr_inca.protocol.trace.ExecutionTrace` and the adversary an
    :class:`~flwr_inca.privacy.views.AdversaryView`."""

    config: IncaConfig
    name: ClassVar[str] = "IncA"

    def __post_init__(self) -> None:
        if not isinstance(self.config, IncaConfig):
            raise ValueError(f"config must be an IncaConfig, got {type(self.config).__name__}")

    @property
    def sigma_star(self) -> float:  # type: ignore[override]
        return float(self.config.sigma_star)

    @property
    def sigma_delta(self) -> float:  # type: ignore[override]
        return float(self.config.sigma_delta)

    def with_sigmas(self, sigma_star: float, sigma_delta: float) -> IncaBaseline:
        return IncaBaseline(dataclasses.replace(self.config, sigma_star=float(sigma_star),
                                                sigma_delta=float(sigma_delta)))

    def run(self, x: Any, seed: int | None = None) -> BaselineResult:
        r = run_inca(x, self.config, seed)
        return BaselineResult(r.estimate, r.finalists, r.party_estimates, details={"trace": r.trace})

    def sample_execution(self, n: int, seed: int | None = None) -> ExecutionTrace:
        return sample_trace(n, self.config, seed)

    def execute(self, x: Any, execution: ExecutionTrace, seed: int | None = None) -> BaselineResult:
        trace = dataclasses.replace(execution, sigma_star=self.sigma_star, sigma_delta=self.sigma_delta)
        r = replay(trace, x, seed, dissemination=self.config.dissemination)
        return BaselineResult(r.estimate, r.finalists, r.party_estimates, details={"trace": r.trace})

    def adversary(self, execution: ExecutionTrace, threat: Threat, seed: int | None = None) -> AdversaryView:
        if threat.kind == "collusion":
            return random_collusion(execution, threat.fraction, seed)
        return random_eavesdrop(execution, threat.fraction, seed)

    def _view_size(self, execution: ExecutionTrace, view: AdversaryView) -> tuple[int, int]:
        return int(view.honest_observed().sum()), int(view.honest.size)

    def _builder_bytes(self, execution: ExecutionTrace, rows: int, honest: int) -> float:
        return exact_bytes(execution.parties, honest, rows, execution.iterations)

    def _observation_model(self, execution: ExecutionTrace, view: AdversaryView) -> ObservationModel:
        return build_model(execution, view)

    def output_weights(self, execution: ExecutionTrace) -> OutputWeights:
        b, a = output_coefficients(execution)
        return OutputWeights(b, float(np.sum(a * a)), float(b.sum()))

    def honest_outputs(self, execution: ExecutionTrace, view: AdversaryView) -> int:
        finals = np.zeros(execution.parties, dtype=bool)
        finals[execution.steps[-1].online] = True
        return int(finals[view.honest].sum())
