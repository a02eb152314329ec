"""Client side: make an existing Flower ClientApp IncA-capable in two lines.

    app = ClientApp()
    inca = IncaClient(app)          # registers the "train.inca_mix" handler

    @inca.train()                   # instead of @app.train(): your function is unchanged
    def train(msg, context): ...    # returns {"arrays": new model, "metrics": {...}} as for FedAvg

``@inca.train(action, mods=...)`` takes the arguments of ``@app.train`` and registers your function
with them, behind :meth:`IncaClient.join_mod`: a Flower mod, which you may also list yourself
(``@app.train(mods=[inca.join_mod])``). For a message of an IncA round the mod runs your train function,
turns its model into an update (new - global), clips it to the L2 norm set by the strategy, and keeps it
on the node, with the round's unit noise drawn ahead. The update never leaves the node in the clear: the
reply carries only a fresh public key. The node then takes part in the relayed mixing. A message of a
plain FedAvg round passes through unchanged.

Flower's ``fixedclipping_mod`` and ``LocalDpMod`` cannot be combined with IncA: both rewrite the model
in the reply to a train message (clip it, and for ``LocalDpMod`` add local-DP noise), and an IncA reply
carries no model, only a public key; both also read the legacy ``fit`` layout of a message, not the
Message API's ``"arrays"`` record (``fixedclipping_mod`` moreover needs the clipping norm that Flower's
``DifferentialPrivacyClientSideFixedClipping`` sends). IncA needs neither: the node clips its update to
the strategy's ``clip_norm`` itself, and the noise IncA adds and cancels gives central-DP accuracy,
certified per round, where ``LocalDpMod`` would add n times the variance, unaccounted by the strategy.

Round data (the update, the roster, the states computed during mixing, the noise drawn ahead) lives in
node-local storage: ``<root>/run-<run id>/node-<node id>``, where the root is ``state_dir``, else the
environment variable ``FLWR_INCA_STATE_DIR``, else ``<temp dir>/flwr-inca-<uid>``. Directories are 0700
and files 0600; a root that belongs to another user or that others can write to is refused. Joining a
round replaces the node's data of earlier rounds; the strategy tells the nodes when a run is over
(a ``query.inca_end`` message), and they remove that run's data; data of runs that ended without a word
(killed) is removed when the node joins another run and it is older than ``stale_after``. The round's
secrets live in the node's ``context.state``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from logging import INFO, WARNING

import numpy as np

from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.supercore import log

from .._checks import check_int, check_real
from .node import RoundSecrets, draw_noise_ahead, handle_exchange
from .shared import END_ACTION, INCA_KEY, MIX_ACTION, clip, flatten_arrays
from .storage import DirectoryStore, check_private_root, remove_stale_runs
from .wire import FIELD, MissingRoster, decode_request, encode_reply, pack_roster, unpack_roster

__all__ = ["IncaClient"]

_STATE_SECRETS = "inca-secrets"
_DEFAULT_ACTION = "default"  # Flower's action of a plain ``@app.train()``
STATE_DIR_ENV = "FLWR_INCA_STATE_DIR"

TrainFn = Callable[[Message, Context], Message]


class IncaClient:
    """Registers IncA's handlers on ``app`` and wraps your train function.

    Args:
        app: the ClientApp.
        state_dir: node-local directory for round data (default: ``$FLWR_INCA_STATE_DIR``, else
            ``<tmp>/flwr-inca-<uid>``); each node uses ``<state_dir>/run-<run id>/node-<node id>``. It must
            belong to this user and not be writable by others.
        insecure_fixed_seed: derive every secret from this seed instead of the OS CSPRNG. Makes runs
            reproducible for tests; never use it in a deployment (anyone knowing it knows the noise).
        noise_ahead_bytes: draw the round's unit noise ((T + 1) * d float64 values) into node storage
            while joining, beside local training, when it takes at most this many bytes; otherwise
            (or with 0) each mixing step draws its own. Same numbers either way.
        stale_after: seconds; when the node joins a round, the data of *other* runs under the root that
            has not changed for this long is removed (runs that ended without telling the node). Runs
            that end normally are removed at once.
    """

    def __init__(self, app: ClientApp, *, state_dir: str | os.PathLike[str] | None = None,
                 insecure_fixed_seed: int | None = None, noise_ahead_bytes: int = 64 * 2**20,
                 stale_after: float = 24 * 3600.0) -> None:
        self.noise_ahead_bytes = check_int("noise_ahead_bytes", noise_ahead_bytes, 0)
        self.stale_after = check_real("stale_after (seconds)", stale_after, 0.0, finite=False)
        self.app = app
        self.fixed_seed = insecure_fixed_seed
        self.state_dir = os.fspath(state_dir) if state_dir is not None else None
        app.train(MIX_ACTION)(self._mix)
        app.query(END_ACTION)(self._end)

    @property
    def state_root(self) -> str:
        """Where the nodes of this ClientApp keep their data (see ``state_dir``)."""
        return (self.state_dir or os.environ.get(STATE_DIR_ENV)
                or os.path.join(tempfile.gettempdir(), f"flwr-inca-{os.getuid()}"))

    def store(self, context: Context) -> DirectoryStore:
        """This node's storage for the current run (its root checked: private to this user)."""
        root = self.state_root
        check_private_root(root, default=not (self.state_dir or os.environ.get(STATE_DIR_ENV)))
        node = f"node-{int(context.node_id) % 2**64}"
        return DirectoryStore(os.path.join(root, f"run-{context.run_id}", node))

    def train(self, action: str = _DEFAULT_ACTION, *, mods: list[Mod] | None = None
              ) -> Callable[[TrainFn], TrainFn]:
        """Decorator replacing ``@app.train(action, mods=mods)`` for your train function.

        Registers the function unchanged, with :meth:`join_mod` outside your ``mods``: they see the
        train function's own reply (the new model), as with ``@app.train``.
        """
        return self.app.train(action, mods=[self.join_mod, *(mods or [])])

    def join_mod(self, msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        """Flower mod: run the train function, then, for a message of an IncA round, keep the clipped
        update on the node and answer with a public key only (see the module docstring)."""
        reply = call_next(msg, context)
        if not msg.metadata.message_type.startswith(MessageType.TRAIN) \
                or msg.metadata.message_type.endswith(f".{MIX_ACTION}") \
                or INCA_KEY not in msg.content.config_records:
            return reply  # not a join: a plain FedAvg round behaves exactly as before
        if reply.has_error():
            return reply
        return self._join_round(msg, context, reply)

    # ------------------------------------------------------------------------------ handlers
    def _join_round(self, msg: Message, context: Context, reply: Message) -> Message:
        cfg = msg.content.config_records[INCA_KEY]
        round_ = int(cfg["round"])
        arrays = reply.content.array_records
        if len(arrays) != 1:
            raise ValueError("the train function must reply with exactly one ArrayRecord (the new model)")
        new, spec_new = flatten_arrays(next(iter(arrays.values())))
        old, spec_old = flatten_arrays(msg.content.array_records[str(cfg["arrays-key"])])
        if [s[:2] for s in spec_new] != [s[:2] for s in spec_old]:
            raise ValueError("the returned model does not have the shapes of the global model")
        if not np.all(np.isfinite(new)):  # it would poison every message of the round: do not join
            model = next(iter(arrays.values()))
            bad = [key for key, arr in model.items()
                   if arr.numpy().dtype.kind == "f" and not np.all(np.isfinite(arr.numpy()))]
            raise ValueError(f"the train function returned a model with NaN or infinite values (in "
                             f"{', '.join(map(repr, bad))}): this node does not join round {round_}")
        value = clip(new - old, float(cfg["clip-norm"]))
        secrets = RoundSecrets.generate(round_, self.fixed_seed, node=int(context.node_id) % 2**64)
        store = self.store(context)
        removed = remove_stale_runs(self.state_root, f"run-{context.run_id}", self.stale_after)
        if removed:
            log(INFO, "IncA: removed the node data of %d run(s) idle for over %.0f s under %s", len(removed),
                self.stale_after, self.state_root)
        store.save_value(round_, value)
        iterations = int(cfg.get("iterations", 0))
        if 0 < (iterations + 1) * value.size * 8 <= self.noise_ahead_bytes:
            draw_noise_ahead(store, secrets, iterations, value.size)
        context.state[_STATE_SECRETS] = ConfigRecord({
            "round": round_, "noise-secret": secrets.noise_secret, "private-key": secrets.private_key,
        })
        joined = ConfigRecord({"public-key": secrets.public_key, "dim": int(value.size)})
        content = RecordDict({INCA_KEY: joined})
        if bool(cfg.get("forward-metrics", False)):
            for key, rec in reply.content.metric_records.items():
                content[key] = MetricRecord(dict(rec))
        return Message(content, reply_to=msg)

    def _mix(self, msg: Message, context: Context) -> Message:
        stored = context.state.config_records.get(_STATE_SECRETS)
        if stored is None:
            raise RuntimeError("this node did not join the IncA round")
        round_ = int(stored["round"])
        store = self.store(context)
        kept = _kept_roster(store.load_blob(round_, "roster"))
        try:
            req, params = decode_request(msg.content.config_records[INCA_KEY][FIELD], kept)
        except MissingRoster:  # lost (should not happen): ask the relay to send it again
            return Message(RecordDict({INCA_KEY: ConfigRecord({"need-roster": True})}), reply_to=msg)
        if params.round != round_:
            raise RuntimeError(f"this node joined round {round_}, the request is for round {params.round}")
        if kept != (params.roster, params.public_keys):  # write-once for the round
            store.save_blob(round_, "roster", pack_roster(params.roster, params.public_keys))
        secrets = RoundSecrets(round_, stored["noise-secret"], stored["private-key"])
        if params.roster[req.party] != int(context.node_id) % 2**64:
            raise RuntimeError("request addressed to another party")
        reply = handle_exchange(req, params, req.party, secrets, store)
        return Message(RecordDict({INCA_KEY: ConfigRecord({FIELD: encode_reply(reply, has_roster=True)})}),
                       reply_to=msg)


    def _end(self, msg: Message, context: Context) -> Message:
        """The run is over: remove this node's data of the run and forget the round's secrets."""
        try:
            store = self.store(context)
        except OSError as exc:  # nothing of ours can be there
            log(WARNING, "IncA: end of run %s: %s", context.run_id, exc)
        else:
            store.remove()
            try:
                os.rmdir(store.root.parent)  # the run's directory, once its last node is gone
            except OSError:
                pass
        if _STATE_SECRETS in context.state.config_records:
            del context.state[_STATE_SECRETS]
        return Message(RecordDict({INCA_KEY: ConfigRecord({"removed": True})}), reply_to=msg)


def _kept_roster(blob: bytes | None) -> tuple[list[int], list[bytes]] | None:
    """The roster this node stored for the round, if it has a readable one."""
    if blob is None:
        return None
    try:
        return unpack_roster(blob)
    except ValueError:  # damaged: as good as lost, the relay sends it again
        return None
