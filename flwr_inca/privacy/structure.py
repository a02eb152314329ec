"""Cheap structural pre-checks and explanations (paper Sec. 4.3-4.4, SPEC §4).

The exact certificate subsumes these; they explain *why* a party is weak and run in near-linear time.

* Theorem 4.5 (rank condition): the vectors ``a^(i,t) ~ W^O_{t+1}[H, i] - e_i`` over the unseen honest
  messages ``(i, t)`` must span at least ``n_H - 1`` dimensions. When each vector has two nonzeros
  (k = 1: one honest receiver) this is "the graph of unseen honest-to-honest messages is connected",
  decided with union-find; otherwise a numerical rank is computed.
* Theorem 4.9 (negative condition): with static neighbours and two honest parties whose every message
  is observed, no bounded sigma_star gives DP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..protocol.schedules import adapted_rows
from ..protocol.trace import ExecutionTrace
from .views import AdversaryView

__all__ = ["PartyExposure", "StructureReport", "analyze_structure"]


@dataclass(frozen=True)
class PartyExposure:
    """Facts about one honest party that drive its privacy."""

    party: int
    observed_messages: int  # of its T+1 message versions, how many the adversary sees
    online_steps: int  # steps 0..T it was online
    dropped_at: int | None  # first iteration of a permanent dropout, else None
    injected_weight: float  # w_i: share of x_i + eta*_i it injected (Eq. (9))
    unseen_honest_messages: int  # its messages delivered only to honest parties
    component_size: int | None  # size of its component in the unseen honest graph (support-2 case)

    def explain(self, iterations: int) -> str:
        parts = [f"{self.observed_messages} of {iterations + 1} messages observed"]
        if self.dropped_at is not None:
            parts.append(f"dropped out permanently at iteration {self.dropped_at}")
        elif self.online_steps < iterations + 1:
            parts.append(f"offline at {iterations + 1 - self.online_steps} iterations")
        parts.append(f"{self.unseen_honest_messages} unseen messages to honest parties")
        if self.component_size is not None:
            parts.append(f"unseen-message component of size {self.component_size}")
        return "; ".join(parts)


@dataclass
class StructureReport:
    """Outcome of the structural pre-checks for one view of one execution."""

    honest: int
    unseen_vectors: int
    rank: int
    rank_condition: bool  # Thm 4.5 precondition: rank >= n_H - 1
    connected: bool | None  # unseen honest graph connected (support-2 case), else None
    components: int | None
    static: bool
    fully_observed: list[int]  # honest parties with every message observed
    negative_condition: bool  # Thm 4.9 applies: no bounded sigma_star
    exposure: dict[int, PartyExposure] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [
            f"honest parties: {self.honest}; unseen honest messages: {self.unseen_vectors}",
            f"Thm 4.5 rank condition: rank {self.rank} {'>=' if self.rank_condition else '<'} "
            f"n_H - 1 = {self.honest - 1} -> {'holds' if self.rank_condition else 'FAILS'}",
        ]
        if self.connected is not None:
            lines.append(f"unseen honest-to-honest graph: {self.components} component(s)")
        if self.negative_condition:
            lines.append(
                "Thm 4.9: static neighbours and honest parties "
                f"{self.fully_observed[:2]} fully observed -> no bounded sigma_star gives DP"
            )
        return "\n".join(lines)


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = np.arange(n)

    def find(self, a: int) -> int:
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:
            self.parent[a], a = root, self.parent[a]
        return int(root)

    def union(self, a: int, b: int) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        self.parent[ra] = rb
        return True


def analyze_structure(trace: ExecutionTrace, view: AdversaryView) -> StructureReport:
    """Run the Theorem 4.5 / 4.9 pre-checks and collect each honest party's exposure."""
    n, T = trace.parties, trace.iterations
    honest = view.honest
    nH = honest.size
    pos = np.full(n, -1)
    pos[honest] = np.arange(nH)
    observed = view.observed
    online = trace.online_mask()

    # unseen (i, t), t < T: honest i online at t+1 whose y_i^(t) reached only honest parties
    vectors: list[dict[int, float]] = []
    unseen_count = np.zeros(n, dtype=np.int64)
    for t in range(T):
        step = trace.steps[t]
        m = step.messages
        keep = 1.0 - np.bincount(m.senders, weights=m.weights, minlength=n)
        for i in honest:
            if observed[t, i] or not online[t + 1, i]:
                continue
            out = m.senders == i
            if not out.any():
                continue
            vec = {int(pos[i]): keep[i] - 1.0}
            for r, w in zip(m.receivers[out], m.weights[out]):
                vec[int(pos[r])] = vec.get(int(pos[r]), 0.0) + float(w)
            vectors.append(vec)
            unseen_count[i] += int(out.sum())

    support2 = all(len(v) == 2 for v in vectors)
    connected: bool | None = None
    components: int | None = None
    comp_size = np.full(n, -1)
    if support2:
        uf = _UnionFind(nH)
        rank = 0
        for v in vectors:
            a, b = v.keys()
            rank += uf.union(a, b)
        roots = np.array([uf.find(j) for j in range(nH)])
        _, inverse, counts = np.unique(roots, return_inverse=True, return_counts=True)
        components = int(counts.size)
        connected = components == 1
        comp_size[honest] = counts[inverse]
    elif vectors:
        mat = np.zeros((len(vectors), nH))
        for row, v in enumerate(vectors):
            for j, val in v.items():
                mat[row, j] = val
        rank = int(np.linalg.matrix_rank(mat))
    else:
        rank = 0

    first = trace.steps[0]
    static = all(
        np.array_equal(s.online, first.online)
        and np.array_equal(s.messages.senders, first.messages.senders)
        and np.array_equal(s.messages.receivers, first.messages.receivers)
        and np.array_equal(s.messages.weights, first.messages.weights)
        for s in trace.steps[1:]
    )
    fully = [int(i) for i in honest if observed[:, i].all()]
    c_o, _ = adapted_rows(trace.schedule, online)
    injected = c_o.sum(axis=0)
    exposure = {}
    for i in honest:
        off_after = np.flatnonzero(~online[:, i])
        dropped = None
        if not online[T, i]:
            on_idx = np.flatnonzero(online[:, i])
            dropped = int(on_idx.max() + 1)
        exposure[int(i)] = PartyExposure(
            party=int(i),
            observed_messages=int(observed[:, i].sum()),
            online_steps=int(online[:, i].sum()),
            dropped_at=dropped if off_after.size else None,
            injected_weight=float(injected[i]),
            unseen_honest_messages=int(unseen_count[i]),
            component_size=int(comp_size[i]) if support2 else None,
        )
    return StructureReport(
        honest=int(nH),
        unseen_vectors=len(vectors),
        rank=int(rank),
        rank_condition=bool(rank >= nH - 1),
        connected=connected,
        components=components,
        static=bool(static),
        fully_observed=fully,
        negative_condition=bool(static and len(fully) >= 2),
        exposure=exposure,
    )
