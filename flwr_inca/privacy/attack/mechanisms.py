"""The mechanisms an attack can audit, each run by its own code: IncA's engine, GOPA, CorDP-DME, local DP.

An audited mechanism is linear in the values and the noise. What the attack needs from it, for a batch
of B runs at once (one run per column), is only what an adversary can compute or observe:

* :meth:`LinearMechanism.observe`: the messages the adversary observes, (m, B), from a run with fresh
  noise drawn from a seed (every party's noise, the honest parties' and the colluders');
* :meth:`LinearMechanism.known`: what the adversary can compute itself from what it knows: the same
  mechanism on the values it knows, with the colluders' own noise (the same draws) and no honest noise;
* :meth:`LinearMechanism.unit_noise` and :meth:`LinearMechanism.unit_values`: the messages caused by
  one unit of one honest noise variable, or of one party's value (the public structure an adversary
  derives from the protocol and the execution: Kerckhoffs' principle).

For IncA everything is computed by the engine itself (:func:`flwr_inca.protocol.replay` with an
``observer``), never from the accountant's matrices, so that the attack is independent evidence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from ...protocol.engine import replay
from ...protocol.noise import NoiseSource, SeededNoise
from ...protocol.trace import ExecutionTrace
from ..views import AdversaryView

__all__ = ["IncaMechanism", "LinearMechanism", "LocalDPMechanism", "PairwiseMechanism", "baseline_mechanism"]


class LinearMechanism(ABC):
    """A mechanism and an adversary, as the attack sees them (module docstring).

    Attributes:
        parties: n.
        corrupted: (|C|,) the colluders (their values and noise are known to the adversary).
        rows: m, the number of observed messages (one scalar each, per run).
        noise_variables: p, the number of honest unit noise variables :meth:`unit_noise` indexes.
        label: the mechanism's name, for reports.
    """

    parties: int
    corrupted: np.ndarray
    rows: int
    noise_variables: int
    label: str

    @property
    def honest(self) -> np.ndarray:
        mask = np.ones(self.parties, dtype=bool)
        mask[self.corrupted] = False
        return np.flatnonzero(mask)

    @abstractmethod
    def observe(self, values: np.ndarray, seed: int) -> np.ndarray:
        """(m, B): the observed messages of B runs on ``values`` (n, B), all noise drawn from ``seed``."""

    @abstractmethod
    def known(self, values: np.ndarray, seed: int) -> np.ndarray:
        """(m, B): the mechanism on ``values`` with the colluders' noise of ``seed`` and no honest noise."""

    @abstractmethod
    def unit_noise(self, start: int, stop: int) -> np.ndarray:
        """(m, stop - start): the messages caused by honest noise variables ``start..stop-1`` (one unit
        each, in the mechanism's own scaling: sigma_star or sigma_delta), values and other noise 0."""

    @abstractmethod
    def unit_values(self, parties: np.ndarray) -> np.ndarray:
        """(m, len(parties)): the messages caused by a unit value of each party, without noise."""


# ------------------------------------------------------------------------------------------------ IncA
class _BasisNoise(NoiseSource):
    """Unit draws that are 1 for one noise variable per column: ``column[j, k]`` (or -1) is the column in
    which party j's term k is 1 (k = 0: ``eta*``). No column at all: no noise."""

    def __init__(self, column: np.ndarray) -> None:
        self.column = column  # (n, T+1) int

    def _rows(self, parties: np.ndarray, k: Any, d: int, dtype: Any) -> np.ndarray:
        cols = self.column[parties, np.asarray(k)]
        out = np.zeros((len(parties), d), dtype=dtype)
        hit = np.flatnonzero(cols >= 0)
        out[hit, cols[hit]] = 1.0
        return out

    def star(self, n, d, dtype):
        return self._rows(np.arange(n), 0, d, dtype)

    def fresh(self, parties, k, t, d, dtype, out=None):
        draws = self._rows(np.asarray(parties), k, d, dtype)
        if out is not None:
            out[...] = draws
            return out
        return draws

    def term(self, parties, k, n, d, dtype):
        return self._rows(np.asarray(parties), int(k), d, dtype)


class _KnownNoise(NoiseSource):
    """``base``'s draws for the parties in ``keep`` (the colluders), zero for everyone else."""

    def __init__(self, base: NoiseSource, keep: np.ndarray) -> None:
        self.base, self.keep = base, keep
        self.anyone = bool(keep.any())

    def _mask(self, draws: np.ndarray, parties: np.ndarray) -> np.ndarray:
        draws[~self.keep[parties]] = 0.0
        return draws

    def star(self, n, d, dtype):
        if not self.anyone:
            return np.zeros((n, d), dtype=dtype)
        return self._mask(self.base.star(n, d, dtype), np.arange(n))

    def fresh(self, parties, k, t, d, dtype, out=None):
        if not self.anyone:
            draws = np.zeros((len(parties), d), dtype=dtype) if out is None else out
            draws[...] = 0.0
            return draws
        return self._mask(self.base.fresh(parties, k, t, d, dtype, out=out), np.asarray(parties))

    def term(self, parties, k, n, d, dtype):
        if not self.anyone:
            return np.zeros((len(parties), d), dtype=dtype)
        return self._mask(self.base.term(parties, k, n, d, dtype), np.asarray(parties))


class IncaMechanism(LinearMechanism):
    """IncA on a recorded execution: the engine replays ``trace``; the adversary observes ``y_j^(t)``
    wherever ``view.observed[t, j]`` (the colluders' own messages included) and knows the colluders'
    values and noise. Honest noise variable ``v`` is term ``v % (T+1)`` (0: ``eta*``) of honest party
    ``honest[v // (T+1)]``."""

    def __init__(self, trace: ExecutionTrace, view: AdversaryView) -> None:
        if view.parties != trace.parties or view.observed.shape[0] != trace.iterations + 1:
            raise ValueError("adversary view does not match the trace (parties or iterations differ)")
        self.trace, self.view = trace, view
        self.parties, self.corrupted = trace.parties, np.asarray(view.corrupted, dtype=np.int64)
        self.label = "IncA"
        self._per_t = [np.flatnonzero(view.observed[t]) for t in range(trace.iterations + 1)]
        self._offsets = np.concatenate([[0], np.cumsum([p.size for p in self._per_t])]).astype(np.int64)
        self.rows = int(self._offsets[-1])
        self.noise_variables = self.honest.size * (trace.iterations + 1)
        self._is_corrupted = np.zeros(self.parties, dtype=bool)
        self._is_corrupted[self.corrupted] = True

    def _run(self, values: np.ndarray, noise: NoiseSource) -> np.ndarray:
        out = np.empty((self.rows, values.shape[1]))

        def collect(t: int, y: np.ndarray) -> None:
            out[self._offsets[t]:self._offsets[t + 1]] = y[self._per_t[t]]

        # the seed only drives gossip dissemination, unused here: the noise is given
        replay(self.trace, values, 0, noise=noise, observer=collect)
        return out

    def observe(self, values: np.ndarray, seed: int) -> np.ndarray:
        return self._run(values, SeededNoise(seed))

    def known(self, values: np.ndarray, seed: int) -> np.ndarray:
        return self._run(values, _KnownNoise(SeededNoise(seed), self._is_corrupted))

    def unit_noise(self, start: int, stop: int) -> np.ndarray:
        terms = self.trace.iterations + 1
        column = np.full((self.parties, terms), -1, dtype=np.int64)
        v = np.arange(start, stop)
        column[self.honest[v // terms], v % terms] = v - start
        return self._run(np.zeros((self.parties, stop - start)), _BasisNoise(column))

    def unit_values(self, parties: np.ndarray) -> np.ndarray:
        parties = np.asarray(parties, dtype=np.int64)
        values = np.zeros((self.parties, parties.size))
        values[parties, np.arange(parties.size)] = 1.0
        return self._run(values, _BasisNoise(np.full((self.parties, self.trace.iterations + 1), -1)))


# ------------------------------------------------------------------------------------------- baselines
class PairwiseMechanism(LinearMechanism):
    """GOPA or CorDP-DME (:mod:`flwr_inca.baselines.pairwise`) on one execution: the adversary observes
    every published masked value and every term revealed in the roll-back, and knows the colluders'
    values, their ``eta*`` and every pairwise term with a colluder at one end. Honest noise variables:
    the ``eta*`` of each honest party, then the terms of the edges between two honest parties."""

    def __init__(self, baseline: Any, execution: Any, corrupted: np.ndarray) -> None:
        from ...baselines.pairwise import pairwise_masked_values

        self._masked = pairwise_masked_values
        self.baseline, self.execution = baseline, execution
        self.parties, self.label = int(execution.parties), str(baseline.name)
        self.corrupted = np.unique(np.asarray(corrupted, dtype=np.int64))
        n = self.parties
        self._is_corrupted = np.zeros(n, dtype=bool)
        self._is_corrupted[self.corrupted] = True
        self._published = np.flatnonzero(execution.published)
        self._revealed = np.flatnonzero(execution.edge_status()[0])
        edges = execution.edges
        self._known_edge = self._is_corrupted[edges[:, 0]] | self._is_corrupted[edges[:, 1]]
        self._honest_edges = np.flatnonzero(~self._known_edge)
        self.rows = self._published.size + self._revealed.size
        self.noise_variables = self.honest.size + self._honest_edges.size

    def _messages(self, values: np.ndarray, star: np.ndarray, pair: np.ndarray) -> np.ndarray:
        """Published masked values, then revealed terms: (m, B). ``star`` (n, B), ``pair`` (E, B) unit."""
        x_tilde = values + self.baseline.sigma_star * star
        terms = self.baseline.sigma_delta * pair
        masked = self._masked(x_tilde, self.execution.edges, terms)
        return np.concatenate([masked[self._published], terms[self._revealed]])

    def _draws(self, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([seed, 0xA77AC])
        return (rng.standard_normal((self.parties, batch)),
                rng.standard_normal((self.execution.edges.shape[0], batch)))

    def observe(self, values: np.ndarray, seed: int) -> np.ndarray:
        return self._messages(values, *self._draws(values.shape[1], seed))

    def known(self, values: np.ndarray, seed: int) -> np.ndarray:
        star, pair = self._draws(values.shape[1], seed)
        star[~self._is_corrupted] = 0.0
        pair[~self._known_edge] = 0.0
        return self._messages(values, star, pair)

    def unit_noise(self, start: int, stop: int) -> np.ndarray:
        width = stop - start
        star = np.zeros((self.parties, width))
        pair = np.zeros((self.execution.edges.shape[0], width))
        v = np.arange(start, stop)
        nh = self.honest.size
        is_star = v < nh
        star[self.honest[v[is_star]], np.flatnonzero(is_star)] = 1.0
        pair[self._honest_edges[v[~is_star] - nh], np.flatnonzero(~is_star)] = 1.0
        return self._messages(np.zeros((self.parties, width)), star, pair)

    def unit_values(self, parties: np.ndarray) -> np.ndarray:
        parties = np.asarray(parties, dtype=np.int64)
        values = np.zeros((self.parties, parties.size))
        values[parties, np.arange(parties.size)] = 1.0
        zeros = np.zeros((self.execution.edges.shape[0], parties.size))
        return self._messages(values, np.zeros_like(values), zeros)


class LocalDPMechanism(LinearMechanism):
    """Local DP (:class:`flwr_inca.baselines.LocalDP`): every party publishes ``x_i + sigma_star eta_i``;
    the adversary observes all of it and knows the colluders' noise."""

    def __init__(self, baseline: Any, parties: int, corrupted: np.ndarray) -> None:
        self.baseline, self.parties, self.label = baseline, int(parties), str(baseline.name)
        self.corrupted = np.unique(np.asarray(corrupted, dtype=np.int64))
        self._is_corrupted = np.zeros(self.parties, dtype=bool)
        self._is_corrupted[self.corrupted] = True
        self.rows = self.parties
        self.noise_variables = self.honest.size

    def _draws(self, batch: int, seed: int) -> np.ndarray:
        return np.random.default_rng([seed, 0xA77AC]).standard_normal((self.parties, batch))

    def observe(self, values: np.ndarray, seed: int) -> np.ndarray:
        return values + self.baseline.sigma_star * self._draws(values.shape[1], seed)

    def known(self, values: np.ndarray, seed: int) -> np.ndarray:
        noise = self._draws(values.shape[1], seed)
        noise[~self._is_corrupted] = 0.0
        return values + self.baseline.sigma_star * noise

    def unit_noise(self, start: int, stop: int) -> np.ndarray:
        out = np.zeros((self.parties, stop - start))
        v = np.arange(start, stop)
        out[self.honest[v], v - start] = self.baseline.sigma_star
        return out

    def unit_values(self, parties: np.ndarray) -> np.ndarray:
        parties = np.asarray(parties, dtype=np.int64)
        out = np.zeros((self.parties, parties.size))
        out[parties, np.arange(parties.size)] = 1.0
        return out


def baseline_mechanism(baseline: Any, execution: Any, corrupted: Any) -> LinearMechanism:
    """The :class:`LinearMechanism` of a baseline with a linear-Gaussian view: GOPA, CorDP-DME (pairwise
    executions) or local DP. Other baselines (the gossip protocols, IncA through
    :class:`~flwr_inca.baselines.IncaBaseline`) are not covered: audit IncA on its trace instead."""
    from ...baselines.gaussian import LocalDP
    from ...baselines.pairwise import GOPA, CorDPDME

    if isinstance(baseline, (GOPA, CorDPDME)):
        return PairwiseMechanism(baseline, execution, corrupted)
    if isinstance(baseline, LocalDP):
        return LocalDPMechanism(baseline, execution, corrupted)
    raise ValueError(f"attacks cover GOPA, CorDP-DME and local DP among the baselines, got "
                     f"{type(baseline).__name__}")
