"""``IncaConfig``: the parameters of one IncA execution."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import check_int, check_real
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
        schedule: ``"incremental"`` (D_Inc, default), ``"early"`` (D_EI) or an ``InjectionSchedule``.
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
        for name in ("iterations", "neighbors"):
            check_int(name, getattr(self, name))
        for name in ("sigma_star", "sigma_delta"):
            check_real(name, getattr(self, name), 0.0)
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
        """Raise ``ValueError`` if the config cannot run with ``n`` parties."""
        check_int("number of parties n", n, 2)
        if self.topology in ("random", "random-fresh") or isinstance(self.topology, RandomNeighbors):
            k = self.topology.k if isinstance(self.topology, RandomNeighbors) else self.neighbors
            if k >= n:
                raise ValueError(f"neighbors must be in [1, n-1] = [1, {n - 1}], got {k}")
