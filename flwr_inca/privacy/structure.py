"""Cheap structural pre-checks and explanations (paper Sec. 4.3-4.4: Lemma 4.4, Thms 4.5, 4.8, 4.9).

The certificate (:func:`~flwr_inca.privacy.certificate.certify`) subsumes these; they explain *why* a
party is weak and run in near-linear time (n = 100,000 parties and T = 20 in about a second).

* Theorem 4.5 (rank condition): the vectors ``a^(i,t) ~ W^O_{t+1}[H, i] - e_i`` of Lemma 4.4, one per
  unseen honest message ``(i, t)``, must span at least ``n_H - 1`` dimensions. When each vector has two
  nonzeros (k = 1: one honest receiver) they are weighted edges of the graph of unseen honest-to-honest
  messages (Eq. (15)), and the rank is ``n_H`` minus its number of connected components (Thm 4.8);
  otherwise a numerical rank is computed (up to :data:`DENSE_RANK_LIMIT` honest parties).
* Theorem 4.9 (negative condition): with static neighbours and two honest parties whose every message
  is observed, no bounded sigma_star gives DP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from ..protocol.schedules import adapted_rows
from ..protocol.trace import ExecutionTrace
from .views import AdversaryView

__all__ = [
    "PartyExposure",
    "StructureReport",
    "UnseenMessages",
    "analyze_structure",
    "is_static",
    "party_exposure",
    "rank_condition",
    "unseen_messages",
]

DENSE_RANK_LIMIT = 3000


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
    rank_exact: bool = True  # False: too many honest parties for a numerical rank (k >= 2); see rank

    def summary(self) -> str:
        if self.rank_exact:
            cond = (f"Thm 4.5 rank condition: rank {self.rank} {'>=' if self.rank_condition else '<'} "
                    f"n_H - 1 = {self.honest - 1} -> {'holds' if self.rank_condition else 'FAILS'}")
        else:
            cond = (f"Thm 4.5 rank condition: not checked ({self.honest} honest parties and messages with "
                    f"several receivers; rank <= {self.rank})")
        lines = [f"honest parties: {self.honest}; unseen honest messages: {self.unseen_vectors}", cond]
        if self.connected is not None:
            lines.append(f"unseen honest-to-honest graph: {self.components} component(s)")
        if self.negative_condition:
            lines.append(
                "Thm 4.9: static neighbours and honest parties "
                f"{self.fully_observed[:2]} fully observed -> no bounded sigma_star gives DP"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class UnseenMessages:
    """The unseen honest messages ``(i, t)`` of Lemma 4.4 and their deliveries.

    Vector v (one per unseen ``(i, t)``, i online at t+1 with at least one delivery) has sender
    ``sender[v]``; delivery d goes from ``vector_of[d]`` to honest ``receiver[d]`` with ``weight[d]``.
    """

    sender: np.ndarray  # (V,) party
    step: np.ndarray  # (V,) t
    vector_of: np.ndarray  # (D,) index into the vectors
    receiver: np.ndarray  # (D,) party
    weight: np.ndarray  # (D,)

    @property
    def support_two(self) -> bool:
        """Every vector has exactly two nonzeros (its sender and one receiver)."""
        counts = np.bincount(self.vector_of, minlength=self.sender.size)
        return bool(np.all(counts == 1))


def unseen_messages(trace: ExecutionTrace, view: AdversaryView) -> UnseenMessages:
    """Lemma 4.4's unseen honest messages: honest i, y_i^(t) not observed, delivered at t+1 (t < T)."""
    is_h = np.zeros(trace.parties, dtype=bool)
    is_h[view.honest] = True
    senders, steps, vec_of, receivers, weights = [], [], [], [], []
    count = 0
    for t in range(trace.iterations):
        m = trace.steps[t].messages
        keep = is_h[m.senders] & ~view.observed[t, m.senders]
        seen_by_corrupted = m.senders[keep & ~is_h[m.receivers]]  # cannot happen in a consistent view
        keep &= ~np.isin(m.senders, seen_by_corrupted)
        s, r, w = m.senders[keep], m.receivers[keep], m.weights[keep]
        uniq, inv = np.unique(s, return_inverse=True)
        senders.append(uniq)
        steps.append(np.full(uniq.size, t, dtype=np.int64))
        vec_of.append(count + inv.ravel())
        receivers.append(r)
        weights.append(w)
        count += uniq.size
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dtype=dt))
    return UnseenMessages(cat(senders, np.int64), cat(steps, np.int64), cat(vec_of, np.int64),
                          cat(receivers, np.int64), cat(weights, float))


def rank_condition(unseen: UnseenMessages, honest: np.ndarray, n: int) -> tuple[int, bool, np.ndarray | None]:
    """Rank of Lemma 4.4's vectors, whether it is exact, and the component label of every party (or
    None) in the support-two case. Support two: ``n_H - #components`` of the unseen honest graph."""
    nH = honest.size
    if unseen.sender.size == 0:
        return 0, True, np.arange(n) if nH else None
    if unseen.support_two:
        a = unseen.sender[unseen.vector_of]
        graph = sp.coo_matrix((np.ones(a.size), (a, unseen.receiver)), shape=(n, n))
        _, labels = connected_components(graph, directed=False)
        components = np.unique(labels[honest]).size
        return int(nH - components), True, labels
    pos = np.full(n, -1, dtype=np.int64)
    pos[honest] = np.arange(nH)
    V = unseen.sender.size
    if nH > DENSE_RANK_LIMIT:
        return int(min(V, nH)), False, None
    mat = np.zeros((V, nH))
    np.add.at(mat, (unseen.vector_of, pos[unseen.receiver]), unseen.weight)
    np.add.at(mat, (np.arange(V), pos[unseen.sender]), -np.bincount(unseen.vector_of, unseen.weight, V))
    return int(np.linalg.matrix_rank(mat)), True, None


def is_static(trace: ExecutionTrace) -> bool:
    """Every iteration has the same online parties and the same delivered messages (Thm 4.9)."""
    first = trace.steps[0]
    return all(
        np.array_equal(s.online, first.online)
        and np.array_equal(s.messages.senders, first.messages.senders)
        and np.array_equal(s.messages.receivers, first.messages.receivers)
        and np.array_equal(s.messages.weights, first.messages.weights)
        for s in trace.steps[1:]
    )


def party_exposure(trace: ExecutionTrace, view: AdversaryView, unseen: UnseenMessages,
                   labels: np.ndarray | None) -> dict[int, PartyExposure]:
    """:class:`PartyExposure` of every honest party."""
    T = trace.iterations
    honest = view.honest
    online = trace.online_mask()
    c_o, _ = adapted_rows(trace.schedule, online)
    injected = c_o.sum(axis=0)
    observed = view.observed[:, honest].sum(axis=0)
    steps_on = online[:, honest].sum(axis=0)
    last_on = T - np.argmax(online[::-1, :], axis=0)  # last online step of every party
    unseen_count = np.bincount(unseen.sender[unseen.vector_of], minlength=trace.parties)
    sizes = None
    if labels is not None:
        sizes = np.bincount(labels[honest], minlength=labels.max() + 1)[labels]
    out = {}
    for k, i in enumerate(honest.tolist()):
        dropped = int(last_on[i] + 1) if not online[T, i] else None
        out[i] = PartyExposure(
            party=i,
            observed_messages=int(observed[k]),
            online_steps=int(steps_on[k]),
            dropped_at=dropped,
            injected_weight=float(injected[i]),
            unseen_honest_messages=int(unseen_count[i]),
            component_size=None if sizes is None else int(sizes[i]),
        )
    return out


def analyze_structure(trace: ExecutionTrace, view: AdversaryView) -> StructureReport:
    """Run the Theorem 4.5 / 4.9 pre-checks and collect each honest party's exposure."""
    honest = view.honest
    nH = int(honest.size)
    unseen = unseen_messages(trace, view)
    rank, exact, labels = rank_condition(unseen, honest, trace.parties)
    components = None if labels is None else int(np.unique(labels[honest]).size)
    static = is_static(trace)
    fully = [int(i) for i in honest[view.observed[:, honest].all(axis=0)]]
    return StructureReport(
        honest=nH,
        unseen_vectors=int(unseen.sender.size),
        rank=int(rank),
        rank_condition=bool(rank >= nH - 1),
        connected=None if components is None else components == 1,
        components=components,
        static=bool(static),
        fully_observed=fully,
        negative_condition=bool(static and len(fully) >= 2),
        exposure=party_exposure(trace, view, unseen, labels),
        rank_exact=exact,
    )
