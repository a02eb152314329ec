"""A Flower ``Grid`` whose nodes are a real ``ClientApp`` run in this process: IncaStrategy's rounds end
to end through its public hooks (``start``, ``configure_train``, ``aggregate_train``) in about a second,
without Ray. The end-to-end tests through Flower's engines are tests/test_flower_e2e.py and
tests/test_deployment.py."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import SimpleNamespace

from flwr.app import Context, Message, RecordDict

from flwr_inca.flower.shared import INCA_KEY
from flwr_inca.flower.wire import FIELD, peek_request


class InProcessGrid:
    """``nodes`` nodes (ids 101, 102, ...; ``partition-id`` 0, 1, ... in their node config) answering with
    ``client_app``. ``drop(round, commit, party)``: mixing requests that are never answered (a node that
    times out); ``before_push(messages)``: called with every batch before it is delivered."""

    def __init__(self, client_app, nodes: int, *, drop: Callable[[int, int, int], bool] | None = None,
                 before_push: Callable[[list[Message]], None] | None = None, fab_id: str = "tests/inca") -> None:
        self.app, self.drop, self.before_push = client_app, drop, before_push
        self.node_ids = [101 + i for i in range(nodes)]
        self.contexts = {node: Context(run_id=1, node_id=node, node_config={"partition-id": i}, state=RecordDict(),
                                       run_config={}) for i, node in enumerate(self.node_ids)}
        self.run = SimpleNamespace(fab_id=fab_id, run_id=1)
        self.outbox: dict[str, Message] = {}
        self.pushed: list[Message] = []
        self._ids = itertools.count()

    def get_node_ids(self):
        return list(self.node_ids)

    def push_messages(self, messages):
        messages = list(messages)
        if self.before_push is not None:
            self.before_push(messages)
        ids = []
        for msg in messages:
            message_id = f"m{next(self._ids)}"
            msg.metadata.__dict__["_message_id"] = message_id
            ids.append(message_id)
            self.pushed.append(msg)
            if self._dropped(msg):
                continue
            self.outbox[message_id] = self.app(msg, self.contexts[msg.metadata.dst_node_id])
        return ids

    def pull_messages(self, message_ids):
        return [self.outbox.pop(i) for i in list(message_ids) if i in self.outbox]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))

    def _dropped(self, msg: Message) -> bool:
        record = msg.content.config_records.get(INCA_KEY) if msg.has_content() else None
        return (self.drop is not None and record is not None and FIELD in record
                and self.drop(*peek_request(record[FIELD])))

    def commits(self, round_: int) -> list[int]:
        """The commit of every mixing request of round ``round_`` pushed so far (T + 1: a final was asked)."""
        out = []
        for msg in self.pushed:
            record = msg.content.config_records.get(INCA_KEY) if msg.has_content() else None
            if record is not None and FIELD in record:
                rnd, commit, _ = peek_request(record[FIELD])
                if rnd == round_:
                    out.append(commit)
        return out


def context(node: int = 5, run_id: int = 1) -> Context:
    return Context(run_id=run_id, node_id=node, node_config={}, state=RecordDict(), run_config={})
