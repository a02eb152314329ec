"""What the ServerApp (``IncaStrategy``) and the ClientApp (``IncaClient``) share: the names in their
messages, the model as one vector, clipping, and the protocol parameters of a round."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord

from ..protocol.schedules import InjectionSchedule

__all__ = ["INCA_KEY", "MIX_ACTION", "END_ACTION", "ArraySpec", "RoundParams", "clip", "flatten_arrays",
           "unflatten_arrays"]

INCA_KEY = "inca"  # the ConfigRecord holding IncA's part of a message
MIX_ACTION = "inca_mix"  # message type "train.inca_mix": one mixing exchange
END_ACTION = "inca_end"  # message type "query.inca_end": the run is over, remove its node data

ArraySpec = list[tuple[str, tuple[int, ...], str]]  # (key, shape, dtype) of each array of a record


@dataclass(frozen=True)
class RoundParams:
    """Protocol parameters of a round, sent by the relay with every mixing request."""

    round: int
    iterations: int
    neighbors: int
    sigma_star: float
    sigma_delta: float
    schedule: InjectionSchedule
    roster: list[int]  # node ids; the party index is the position
    public_keys: list[bytes]
    precision: str = "float64"  # of messages and states: "float32" or "float64"


def flatten_arrays(record: ArrayRecord) -> tuple[np.ndarray, ArraySpec]:
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


def unflatten_arrays(vector: np.ndarray, spec: ArraySpec, keep: ArrayRecord | None = None) -> ArrayRecord:
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
