"""Nodes that deviated from the protocol, across rounds, and the nodes barred from later rounds.

Within a round the relay excludes a node whose messages are invalid (:attr:`RoundRelay.offenders
<flwr_inca.flower.relay.RoundRelay.offenders>`). Across rounds, :class:`Offenders` keeps those offences
by node id; a node with ``max_offences`` of them is *barred*: the strategy no longer samples it. Every
offence and every barring is logged with the node id and the reason.

An offence is what only a deviating (or broken) node does: an invalid reply, one side of a dispute over
a refused payload (the relay cannot tell which side lied, so both are counted), or, in a round that then
failed, a final message lost after the node took part in the last iteration (withholding it is how one
node can make a round fail). Nodes a deviating node left waiting, and ordinary dropouts (errors,
timeouts, a lost final in a round that succeeded), are not offences.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING

from flwr.supercore import log

from .._checks import check_int
from .relay import RoundRelay

__all__ = ["Offence", "Offenders", "LOST_FINAL"]

LOST_FINAL = "its final message was lost and the round failed"


@dataclass(frozen=True)
class Offence:
    """One round's offence of one node."""

    round: int
    reason: str


class Offenders:
    """Offences by node id, over a training; nodes with ``max_offences`` offences are barred.

    Args:
        max_offences: offences (in distinct rounds) after which a node is barred from later rounds;
            None: never bar (offences are still recorded and logged).
    """

    def __init__(self, max_offences: int | None = 2) -> None:
        self.max_offences = (None if max_offences is None
                             else check_int("max_offences (or None)", max_offences, 1))
        self.offences: dict[int, list[Offence]] = {}
        self._barred: dict[int, int] = {}  # node id -> the round whose offence barred it

    @property
    def barred(self) -> frozenset[int]:
        """Node ids barred from later rounds."""
        return frozenset(self._barred)

    def count(self, node: int) -> int:
        """Offences recorded for ``node``."""
        return len(self.offences.get(int(node), []))

    def record(self, server_round: int, offences: Mapping[int, str]) -> list[int]:
        """Record round ``server_round``'s offences (node id -> reason), one per node; returns the node ids
        they bar (each logged)."""
        newly = []
        for node, reason in sorted(offences.items()):
            node = int(node)
            history = self.offences.setdefault(node, [])
            if any(o.round == server_round for o in history):
                continue  # one offence per node and round
            history.append(Offence(server_round, reason))
            limit = "" if self.max_offences is None else f" of {self.max_offences}"
            log(WARNING, "IncA round %d: node %d deviated from the protocol (offence %d%s): %s", server_round,
                node, len(history), limit, reason)
            barring = self.max_offences is not None and len(history) >= self.max_offences
            if barring and node not in self._barred:
                self._barred[node] = server_round
                newly.append(node)
                log(WARNING, "IncA: node %d is barred from later rounds after %d offences (rounds %s)", node,
                    len(history), ", ".join(str(o.round) for o in history))
        return newly

    def record_round(self, server_round: int, roster: Sequence[int], relay: RoundRelay,
                     failed: bool) -> dict[int, str]:
        """Record the offences of a round mixed on ``relay`` (party i is node ``roster[i]``): the relay's
        offenders and, if the round ``failed`` (not refused by the budget), the nodes whose final message
        was lost. Nodes excluded without an offence are logged. Returns the offences by node id."""
        offences = {roster[i]: why for i, why in relay.offenders.items()}
        if failed:
            for i in relay.missing_finals():
                if i not in relay.excluded:
                    offences[roster[i]] = LOST_FINAL
        for i, why in sorted(relay.excluded.items()):
            if i not in relay.offenders:
                log(INFO, "IncA round %d: node %d excluded from the rest of the round: %s", server_round,
                    roster[i], why)
        self.record(server_round, offences)
        return offences

    def admit(self, server_round: int, nodes: Iterable[int]) -> list[int]:
        """``nodes`` (node ids, e.g. those sampled for round ``server_round``) without the barred ones; each
        node left out is logged."""
        admitted = []
        for node in nodes:
            if int(node) in self._barred:
                log(INFO, "IncA round %d: node %d not sampled: barred since round %d (%d offences)",
                    server_round, node, self._barred[int(node)], self.count(node))
            else:
                admitted.append(node)
        return admitted
