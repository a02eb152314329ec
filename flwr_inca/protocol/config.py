"""``IncaConfig``: the parameters of one IncA execution."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import MAX_PARTIES, check_bytes, check_int, check_iterations, check_parties, check_scale
from .dissemination import Dissemination, resolve_dissemination
from .dropout import DropoutModel, resolve_dropout
from .schedules import InjectionSchedule
from .topology import RandomNeighbors, Topology, resolve_topology

__all__ = ["IncaConfig"]


@dataclass(frozen=True, kw_only=True)
class IncaConfig:
    """Parameters of one IncA run (paper Algorithm 2).

    Attributes:
        sigma_star: std of the independent noise ``eta*_i`` each party adds to its value (the only
            noise left in the output; per coordinate, in value units).
        sigma_delta: std of each cancelling noise term ``eta_{i,k}`` (per coordinate, value units).
        iterations: number of mixing iterations T (messages per party when ``neighbors = 1``).
        neighbors: out-neighbours k per iteration for the random topologies; weights 1/(k+1).
        schedule: ``"incremental"`` (D_Inc, the paper's; default), ``"incremental:tail=L"``, ``"auto"`` (the
            drivers' default: :data:`~flwr_inca.protocol.schedules.RECOMMENDED_SCHEDULE`), ``"early"`` (D_EI) or an
            ``InjectionSchedule``.
        topology: ``"random"`` (k fresh random out-neighbours each iteration), ``"random-fresh"``
            (never the same neighbour twice), ``"ring"``, ``"hypercube"``, ``"complete"``,
            ``"erdos-renyi:<p>"``, or a ``Topology`` (e.g. ``StaticTopology`` from an edge list).
        dropout: a ``DropoutModel`` or None (nobody drops out).
        dissemination: ``"exact"`` (finals are public; exact weighted average), ``"gossip"``
            (push-sum, T_D = 20), ``"gossip:<T_D>"`` or a ``Dissemination``.

    Sigmas for a target (epsilon, delta) come from ``flwr_inca.privacy.calibrate``.
    """

    sigma_star: float
    sigma_delta: float
    iterations: int = 10
    neighbors: int = 1
    schedule: str | InjectionSchedule = "incremental"
    topology: str | Topology = "random"
    dropout: DropoutModel | None = None
    dissemination: str | Dissemination = "exact"

    def __post_init__(self) -> None:
        check_iterations("iterations", self.iterations)
        check_int("neighbors", self.neighbors, 1, MAX_PARTIES - 1)
        for name in ("sigma_star", "sigma_delta"):
            check_scale(name, getattr(self, name))
        InjectionSchedule.resolve(self.schedule, self.iterations)  # raises on a bad schedule
        resolve_dropout(self.dropout)
        resolve_dissemination(self.dissemination)
        if not isinstance(self.topology, (str, Topology)):
            raise ValueError(f"topology: expected a name or a Topology, got {self.topology!r}")

    def resolved_schedule(self) -> InjectionSchedule:
        return InjectionSchedule.resolve(self.schedule, self.iterations)

    def resolved_topology(self, n: int, seed: int | None = 0) -> Topology:
        topology = resolve_topology(self.topology, self.neighbors, n, seed)
        topology.check(n, self.iterations)
        return topology

    def check(self, n: int) -> None:
        """Raise ``ValueError`` if the config cannot run with ``n`` parties, or if its trace would not fit in
        memory (:func:`~flwr_inca._checks.memory_limit`; checked before anything of that size is drawn)."""
        check_parties("number of parties n", n)
        if self.topology in ("random", "random-fresh") or isinstance(self.topology, RandomNeighbors):
            k = self.topology.k if isinstance(self.topology, RandomNeighbors) else self.neighbors
            if k >= n:
                raise ValueError(f"neighbors must be in [1, n-1] = [1, {n - 1}], got {k}")
        check_bytes(f"the trace of {n} parties over {self.iterations} iterations", self.trace_bytes(n),
                    "fewer parties, iterations or neighbors")

    def trace_bytes(self, n: int) -> float:
        """Bytes of the trace of a run of ``n`` parties (about): per iteration and party, its messages (two
        int64 and a float64 each: ``neighbors`` of them, ``n - 1`` on the complete graph) and its online
        index, and the (T+1, n) online mask."""
        k = n - 1 if self.topology == "complete" else self.neighbors
        return float(self.iterations) * n * (24.0 * k + 8.0) + (self.iterations + 1.0) * n
