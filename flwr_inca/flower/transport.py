"""The ServerApp's message transport for IncA: joins, relayed mixing exchanges, the end of a run.

Everything here speaks Flower's Message API (``Grid.push_messages`` / ``pull_messages``) and nothing
here decides about privacy: :class:`~flwr_inca.flower.strategy.IncaStrategy` asks the round session
before each exchange is made. The relay's bookkeeping (which payload goes where, who is online) is
:mod:`flwr_inca.flower.relay`, free of Flower types.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from .crypto import check_public_key
from .relay import Reply, Request
from .shared import END_ACTION, INCA_KEY, MIX_ACTION, RoundParams
from .wire import FIELD, decode_reply, encode_request

__all__ = ["Joined", "MixingExchange", "end_run", "error_summary", "join_round", "send_and_receive"]

PayloadHook = Callable[[int, int, int, int, bytes], bytes]  # (round, sender, receiver, iteration, payload)


# an exchange's next poll waits this share of the time the exchange has taken so far (at least the relay's
# poll_interval, at most its max_poll_interval): a reply is seen at most this share late, and an exchange of
# duration D polls about 1 / share + log(D * share / poll_interval) / log(1 + share) times (41 for 2 s at
# 0.01 s) instead of D / poll_interval (200)
POLL_BACKOFF_SHARE = 0.1


def poll_wait(elapsed: float, poll_interval: float, max_poll_interval: float) -> float:
    """Seconds to wait before the next poll of an exchange that started ``elapsed`` seconds ago."""
    return max(poll_interval, min(max_poll_interval, POLL_BACKOFF_SHARE * elapsed))


def send_and_receive(grid: Grid, messages: list[Message], timeout: float, poll_interval: float,
                     max_poll_interval: float) -> list[Message]:
    """``Grid.send_and_receive`` polling with a backoff (:func:`poll_wait`; same semantics: replies in
    arrival order; nodes that did not answer within ``timeout`` seconds are simply absent)."""
    pending = set(grid.push_messages(messages))
    started = time.monotonic()
    deadline = started + timeout
    replies: list[Message] = []
    while pending:
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        now = time.monotonic()
        if not pending or now >= deadline:
            break
        time.sleep(min(poll_wait(now - started, poll_interval, max_poll_interval), deadline - now))
    return replies


@dataclass
class Joined:
    """The nodes that joined a round: their public keys and metrics (by node id), and the sampled nodes
    that did not join, with the reason."""

    keys: dict[int, bytes] = field(default_factory=dict)
    metrics: dict[int, MetricRecord] = field(default_factory=dict)
    excluded: dict[int, str] = field(default_factory=dict)

    @property
    def roster(self) -> list[int]:
        return sorted(self.keys)


def join_round(server_round: int, replies: list[Message], d: int, forward_metrics: bool) -> Joined:
    """The nodes that joined: a reply with a valid X25519 public key and a value of the model's dimension
    ``d``. Any other reply excludes its node from the round (logged by node id), never the round: a node
    cannot stop training or break the roster for the others."""
    joined = Joined()
    for msg in replies:
        node = int(msg.metadata.src_node_id)
        if msg.has_error():
            joined.excluded[node] = "error: " + error_summary(msg.error.reason, msg.error.code)
            log(INFO, "\t> node %d did not join round %d: %s", node, server_round, joined.excluded[node])
            continue
        recs = msg.content.config_records
        if INCA_KEY not in recs:
            joined.excluded[node] = "no IncA data in its reply"
            log(WARNING, "\t> node %d replied without IncA data: is its train function registered with "
                "IncaClient.train()?", node)
            continue
        why = _join_problem(recs[INCA_KEY], d)
        if why:
            joined.excluded[node] = why
            log(WARNING, "\t> node %d excluded from round %d: %s", node, server_round, why)
            continue
        joined.keys[node] = recs[INCA_KEY]["public-key"]
        if forward_metrics:
            for rec in msg.content.metric_records.values():
                joined.metrics[node] = rec
    by_key: dict[bytes, list[int]] = {}
    for node, key in joined.keys.items():
        by_key.setdefault(key, []).append(node)
    for nodes in (v for v in by_key.values() if len(v) > 1):  # a copied key: who is the culprit?
        for node in nodes:
            joined.excluded[node] = f"its public key is also the key of node(s) {[m for m in nodes if m != node]}"
            log(WARNING, "\t> node %d excluded from round %d: %s", node, server_round, joined.excluded[node])
            del joined.keys[node]
            joined.metrics.pop(node, None)
    return joined


class MixingExchange:
    """One round's relayed exchanges: each call sends the relay's requests to the roster's nodes
    (end-to-end encrypted payloads the server cannot read) and returns the parsed replies that arrived
    in time, by party index. ``counters`` counts errors, malformed replies and timeouts."""

    def __init__(self, grid: Grid, params: RoundParams, *, timeout: float, poll_interval: float,
                 max_poll_interval: float, payload_hook: PayloadHook | None = None) -> None:
        self.grid, self.params = grid, params
        self.timeout, self.poll_interval, self.max_poll_interval = timeout, poll_interval, max_poll_interval
        self.payload_hook = payload_hook
        self.counters = {"errors": 0, "malformed": 0, "timeouts": 0}
        self.has_roster: set[int] = set()  # nodes that keep the roster: their requests omit it
        self.index = {node: i for i, node in enumerate(params.roster)}

    def __call__(self, commit: int, requests: list[Request]) -> dict[int, Reply]:
        messages = [self._message(req) for req in requests]
        replies: dict[int, Reply] = {}
        arrived = 0
        for msg in send_and_receive(self.grid, messages, self.timeout, self.poll_interval,
                                    self.max_poll_interval):
            i = self.index.get(int(msg.metadata.src_node_id))
            if i is None:
                continue
            arrived += 1
            if msg.has_error():
                self.counters["errors"] += 1
                continue
            record = msg.content.config_records.get(INCA_KEY)
            if record is None or record.get("need-roster"):
                self.has_roster.discard(i)
                continue
            try:
                replies[i], keeps_roster = decode_reply(record[FIELD], i)
            except (KeyError, ValueError) as exc:
                self.counters["malformed"] += 1
                replies[i] = Reply(i, invalid=f"malformed reply: {exc}")  # an offence: the relay excludes it
                continue
            if keeps_roster:
                self.has_roster.add(i)
        self.counters["timeouts"] += len(requests) - arrived
        return replies

    def _message(self, req: Request) -> Message:
        params = self.params
        incoming = req.incoming
        if self.payload_hook is not None:
            incoming = [replace(m, payload=self.payload_hook(params.round, m.sender, m.receiver, m.iteration,
                                                             m.payload)) for m in incoming]
        data = encode_request(replace(req, incoming=incoming), params, with_roster=req.party not in self.has_roster)
        content = RecordDict({INCA_KEY: ConfigRecord({FIELD: data})})
        return Message(content, dst_node_id=params.roster[req.party],
                       message_type=f"{MessageType.TRAIN}.{MIX_ACTION}")


def end_run(grid: Grid, nodes: list[int], timeout: float, poll_interval: float, max_poll_interval: float) -> None:
    """Tell ``nodes`` that the run is over, so that they remove its data. Best effort: a node that does not
    answer removes the data later (``IncaClient(stale_after=...)``)."""
    if not nodes:
        return
    content = RecordDict({INCA_KEY: ConfigRecord({"end": True})})
    messages = [Message(content, dst_node_id=node, message_type=f"{MessageType.QUERY}.{END_ACTION}")
                for node in nodes]
    try:
        replies = send_and_receive(grid, messages, timeout, poll_interval, max_poll_interval)
    except Exception as exc:  # noqa: BLE001 - the run is over; the nodes clean up later instead
        log(WARNING, "IncA: could not tell the nodes that the run is over: %s", exc)
        return
    done = sum(1 for r in replies if not r.has_error())
    log(INFO, "IncA: run over: %d/%d node(s) removed their round data", done, len(nodes))


def error_summary(reason: str | None, code: int) -> str:
    """One line of a node's error reply. Flower writes ``<class 'ValueError'>:<'message'>``, and wraps an
    exception in the train function as ``... ClientAppException occurred. Message: message`` (after the
    Ray traceback, in a simulation): the message is what says what went wrong."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", reason or "")
    wrapped = re.findall(r"occurred\. Message: ([^\n]*)", text)
    plain = re.match(r"<class '([\w.]+)'>:<'([^\n]*)", text)
    if wrapped:
        line = wrapped[-1]
    elif plain:
        line = f"{plain.group(1).rsplit('.', 1)[-1]}: {plain.group(2)}"
    else:
        line = next((x.strip() for x in text.splitlines() if x.strip()), f"error code {code}")
    line = line.removesuffix("'>")
    return line[:300]


def _join_problem(reply: ConfigRecord, d: int) -> str:
    """Why a join reply is unusable ("" if it is fine): a missing or invalid public key, or a value whose
    dimension is not the model's."""
    if "public-key" not in reply:
        return "its join reply has no public key"
    try:
        check_public_key(reply["public-key"])
    except ValueError as exc:
        return str(exc)
    dim = reply.get("dim")
    if isinstance(dim, bool) or not isinstance(dim, int):
        return f"its join reply has no integer 'dim', got {dim!r}"
    if dim != d:
        return f"it reports a value of dimension {dim}, the model has {d}"
    return ""
