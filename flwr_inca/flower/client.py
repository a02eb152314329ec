"""Client side: make an existing Flower ClientApp IncA-capable in two lines.

    app = ClientApp()
    inca = IncaClient(app)          # registers the "train.inca_mix" handler

    @inca.train()                   # instead of @app.train(): your function is unchanged
    def train(msg, context): ...    # returns {"arrays": new model, "metrics": {...}} as for FedAvg

The wrapper runs your train function, turns its model into an update (new - global), clips it to
the L2 norm set by the strategy, and keeps it on the node, with the round's unit noise drawn ahead.
The update never leaves the node in the clear: the reply carries only a fresh public key. The node
then takes part in the relayed mixing.

Round data (the update, the roster, the states computed during mixing) lives in node-local storage,
by default a private directory under the system's temp dir (``state_dir`` to choose another); the
round's secrets live in the node's ``context.state``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .node import DirectoryStore, RoundSecrets, draw_noise_ahead, handle_exchange
from .wire import FIELD, decode_request, encode_reply

__all__ = ["IncaClient", "MIX_ACTION", "INCA_KEY", "flatten_arrays", "unflatten_arrays", "clip"]

MIX_ACTION = "inca_mix"
INCA_KEY = "inca"
_STATE_SECRETS = "inca-secrets"

TrainFn = Callable[[Message, Context], Message]


def flatten_arrays(record: ArrayRecord) -> tuple[np.ndarray, list[tuple[str, tuple[int, ...], str]]]:
    """The floating-point arrays of ``record`` as one float64 vector, with what is needed to undo it.

    Other arrays (integer counters such as BatchNorm's ``num_batches_tracked``) are left out: they
    are neither clipped nor averaged, and keep the global model's value (see :func:`unflatten_arrays`).
    """
    spec, parts = [], []
    for key, arr in record.items():
        a = arr.numpy()
        spec.append((key, tuple(a.shape), str(a.dtype)))
        if _averaged(a.dtype):
            parts.append(np.asarray(a, dtype=np.float64).reshape(-1))
    return (np.concatenate(parts) if parts else np.zeros(0)), spec


def unflatten_arrays(vector: np.ndarray, spec: list[tuple[str, tuple[int, ...], str]],
                     keep: ArrayRecord | None = None) -> ArrayRecord:
    """Inverse of :func:`flatten_arrays`; arrays it left out are copied from ``keep``."""
    out, offset = {}, 0
    for key, shape, dtype in spec:
        if not _averaged(np.dtype(dtype)):
            if keep is None or key not in keep:
                raise ValueError(f"array {key!r} ({dtype}) is not averaged: give the record to keep it from")
            out[key] = Array(np.array(keep[key].numpy()))
            continue
        size = int(np.prod(shape)) if shape else 1
        out[key] = Array(np.asarray(vector[offset:offset + size].reshape(shape), dtype=np.dtype(dtype)))
        offset += size
    if offset != vector.size:
        raise ValueError("vector size does not match the array spec")
    return ArrayRecord(out)


def _averaged(dtype: np.dtype) -> bool:
    return bool(np.issubdtype(dtype, np.floating))


def clip(update: np.ndarray, norm: float) -> np.ndarray:
    """``update`` scaled down to L2 norm at most ``norm`` (party-level sensitivity 2 * norm)."""
    size = float(np.linalg.norm(update))
    return update if size <= norm else update * (norm / size)


class IncaClient:
    """Registers IncA's handlers on ``app`` and wraps your train function.

    Args:
        app: the ClientApp.
        state_dir: node-local directory for round data (default: ``<tmp>/flwr-inca-<uid>``); each
            node uses ``<state_dir>/run-<run id>/node-<node id>``.
        insecure_fixed_seed: derive every secret from this seed instead of the OS CSPRNG. Makes runs
            reproducible for tests; never use it in a deployment (anyone knowing it knows the noise).
        noise_ahead_bytes: draw the round's unit noise ((T + 1) * d float64 values) into node storage
            while joining, beside local training, when it takes at most this many bytes; otherwise
            (or with 0) each mixing step draws its own. Same numbers either way.
    """

    def __init__(self, app: ClientApp, *, state_dir: str | os.PathLike[str] | None = None,
                 insecure_fixed_seed: int | None = None, noise_ahead_bytes: int = 64 * 2**20) -> None:
        if isinstance(noise_ahead_bytes, bool) or not isinstance(noise_ahead_bytes, int) \
                or noise_ahead_bytes < 0:
            raise ValueError(f"noise_ahead_bytes must be an integer >= 0, got {noise_ahead_bytes!r}")
        self.noise_ahead_bytes = noise_ahead_bytes
        self.app = app
        self.fixed_seed = insecure_fixed_seed
        self.state_dir = Path(state_dir) if state_dir is not None else None
        app.train(MIX_ACTION)(self._mix)

    def store(self, context: Context) -> DirectoryStore:
        """This node's storage for the current run."""
        root = (os.fspath(self.state_dir) if self.state_dir
                else os.path.join(tempfile.gettempdir(), f"flwr-inca-{os.getuid()}"))
        node = f"node-{int(context.node_id) % 2**64}"
        return DirectoryStore(os.path.join(root, f"run-{context.run_id}", node))

    def train(self) -> Callable[[TrainFn], TrainFn]:
        """Decorator replacing ``@app.train()`` for your train function."""

        def decorate(fn: TrainFn) -> TrainFn:
            def wrapped(msg: Message, context: Context) -> Message:
                reply = fn(msg, context)
                if INCA_KEY not in msg.content.config_records:
                    return reply  # a plain FedAvg round: behave exactly as before
                return self._join_round(msg, context, reply)

            wrapped.__name__ = getattr(fn, "__name__", "train")
            wrapped.__doc__ = fn.__doc__
            self.app.train()(wrapped)
            return fn

        return decorate

    # ------------------------------------------------------------------------------ handlers
    def _join_round(self, msg: Message, context: Context, reply: Message) -> Message:
        if reply.has_error():
            return reply
        cfg = msg.content.config_records[INCA_KEY]
        round_ = int(cfg["round"])
        arrays = reply.content.array_records
        if len(arrays) != 1:
            raise ValueError("the train function must reply with exactly one ArrayRecord (the new model)")
        new, spec_new = flatten_arrays(next(iter(arrays.values())))
        old, spec_old = flatten_arrays(msg.content.array_records[str(cfg["arrays-key"])])
        if [s[:2] for s in spec_new] != [s[:2] for s in spec_old]:
            raise ValueError("the returned model does not have the shapes of the global model")
        value = clip(new - old, float(cfg["clip-norm"]))
        secrets = RoundSecrets.generate(round_, self.fixed_seed, node=int(context.node_id) % 2**64)
        store = self.store(context)
        store.save_value(round_, value)
        iterations = int(cfg.get("iterations", 0))
        if 0 < (iterations + 1) * value.size * 8 <= self.noise_ahead_bytes:
            draw_noise_ahead(store, secrets, iterations, value.size)
        context.state[_STATE_SECRETS] = ConfigRecord({
            "round": round_, "noise-secret": secrets.noise_secret, "private-key": secrets.private_key,
        })
        content = RecordDict({INCA_KEY: ConfigRecord({"public-key": secrets.public_key, "dim": int(value.size)})})
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
        blob = store.load_blob(round_, "roster")
        kept = _unpack_roster(blob) if blob is not None and len(blob) % 40 == 0 else None
        try:
            req, params = decode_request(msg.content.config_records[INCA_KEY][FIELD], kept)
        except ValueError as exc:
            if "without roster" in str(exc):  # lost (should not happen): ask the relay to send it again
                return Message(RecordDict({INCA_KEY: ConfigRecord({"need-roster": True})}), reply_to=msg)
            raise
        if params.round != round_:
            raise RuntimeError(f"this node joined round {round_}, the request is for round {params.round}")
        if kept != (params.roster, params.public_keys):  # write-once for the round
            store.save_blob(round_, "roster", np.asarray(params.roster, dtype="<u8").tobytes()
                            + b"".join(params.public_keys))
        secrets = RoundSecrets(round_, stored["noise-secret"], stored["private-key"])
        if params.roster[req.party] != int(context.node_id) % 2**64:
            raise RuntimeError("request addressed to another party")
        reply = handle_exchange(req, params, req.party, secrets, store)
        return Message(RecordDict({INCA_KEY: ConfigRecord({FIELD: encode_reply(reply, has_roster=True)})}),
                       reply_to=msg)


def _unpack_roster(blob: bytes) -> tuple[list[int], list[bytes]]:
    n = len(blob) // 40
    ids = np.frombuffer(blob[: 8 * n], dtype="<u8").tolist()
    return [int(v) for v in ids], [blob[8 * n + 32 * j: 8 * n + 32 * (j + 1)] for j in range(n)]
