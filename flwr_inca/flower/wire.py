"""Encoding of relay requests and replies as flat dicts that fit a Flower ``ConfigRecord``.

Only ``int``, ``float``, ``bool``, ``bytes``, ``str`` and homogeneous lists of them are used, which
is what ``ConfigRecord`` accepts. Parsing validates types and raises ``ValueError`` on anything
malformed, so a broken reply is treated as a failed exchange, never as data.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..protocol.schedules import InjectionSchedule
from .node import RoundParams
from .relay import Outgoing, Reply, Request

__all__ = ["encode_request", "decode_request", "encode_reply", "decode_reply"]


def _ints(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueError(f"{name}: expected a list of ints")
    return v


def _floats(v: Any, name: str) -> list[float]:
    if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise ValueError(f"{name}: expected a list of numbers")
    return [float(x) for x in v]


def _blobs(v: Any, name: str) -> list[bytes]:
    if not isinstance(v, list) or not all(isinstance(x, bytes) for x in v):
        raise ValueError(f"{name}: expected a list of bytes")
    return v


def _int(v: Any, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{name}: expected an int")
    return v


def _float(v: Any, name: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError(f"{name}: expected a number")
    return float(v)


def encode_request(req: Request, params: RoundParams) -> dict[str, Any]:
    out: dict[str, Any] = {
        "round": params.round,
        "iterations": params.iterations,
        "neighbors": params.neighbors,
        "sigma-star": float(params.sigma_star),
        "sigma-delta": float(params.sigma_delta),
        "roster": [int(v) for v in params.roster],
        "public-keys": list(params.public_keys),
        "party": req.party,
        "commit": req.commit,
        "final": bool(req.final),
        "state": req.state,
        "task": req.task,
        "delivered-weight": float(req.delivered_weight),
        "in-senders": [m.sender for m in req.incoming],
        "in-weights": [float(m.weight) for m in req.incoming],
        "in-payloads": [m.payload for m in req.incoming],
        "rt-iterations": [u for u, _, _ in req.retransmit],
        "rt-receivers": [r for _, r, _ in req.retransmit],
        "rt-states": [b for _, _, b in req.retransmit],
    }
    name = params.schedule.name
    if name in ("incremental", "early"):
        out["schedule"] = name
    else:
        out["schedule"] = "custom"
        out["schedule-c"] = params.schedule.c.tolist()
        out["schedule-z"] = params.schedule.Z.reshape(-1).tolist()
    return out


def decode_request(data: dict[str, Any]) -> tuple[Request, RoundParams]:
    try:
        T = _int(data["iterations"], "iterations")
        if data["schedule"] == "custom":
            c = _floats(data["schedule-c"], "schedule-c")
            schedule = InjectionSchedule.custom(c, np.array(_floats(data["schedule-z"], "schedule-z")).reshape(T + 1, T))
        else:
            schedule = InjectionSchedule.resolve(str(data["schedule"]), T)
        params = RoundParams(
            round=_int(data["round"], "round"), iterations=T, neighbors=_int(data["neighbors"], "neighbors"),
            sigma_star=_float(data["sigma-star"], "sigma-star"), sigma_delta=_float(data["sigma-delta"], "sigma-delta"),
            schedule=schedule, roster=_ints(data["roster"], "roster"),
            public_keys=_blobs(data["public-keys"], "public-keys"),
        )
        task = _int(data["task"], "task")
        senders = _ints(data["in-senders"], "in-senders")
        weights = _floats(data["in-weights"], "in-weights")
        payloads = _blobs(data["in-payloads"], "in-payloads")
        rt_u = _ints(data["rt-iterations"], "rt-iterations")
        rt_r = _ints(data["rt-receivers"], "rt-receivers")
        rt_s = _blobs(data["rt-states"], "rt-states")
        state = data["state"]
        if not isinstance(state, bytes):
            raise ValueError("state: expected bytes")
    except KeyError as exc:
        raise ValueError(f"request is missing {exc}") from None
    if not (len(senders) == len(weights) == len(payloads)) or not (len(rt_u) == len(rt_r) == len(rt_s)):
        raise ValueError("request lists have different lengths")
    if len(params.roster) != len(params.public_keys):
        raise ValueError("roster and public keys differ in length")
    req = Request(
        party=_int(data["party"], "party"), commit=_int(data["commit"], "commit"), state=state, task=task,
        incoming=[Outgoing(s, -1, w, p, task) for s, w, p in zip(senders, weights, payloads)],
        delivered_weight=_float(data["delivered-weight"], "delivered-weight"),
        retransmit=list(zip(rt_u, rt_r, rt_s)), final=bool(data["final"]),
    )
    return req, params


def encode_reply(rep: Reply) -> dict[str, Any]:
    out: dict[str, Any] = {
        "computed": rep.computed,
        "state": rep.state,
        "rejected": list(rep.rejected),
        "out-receivers": [m.receiver for m in rep.outgoing],
        "out-weights": [float(m.weight) for m in rep.outgoing],
        "out-payloads": [m.payload for m in rep.outgoing],
        "out-iteration": rep.outgoing[0].iteration if rep.outgoing else -1,
        "rt-iterations": [m.iteration for m in rep.retransmissions],
        "rt-receivers": [m.receiver for m in rep.retransmissions],
        "rt-payloads": [m.payload for m in rep.retransmissions],
    }
    if rep.final is not None:
        out["final"] = np.ascontiguousarray(rep.final, dtype=np.float64).tobytes()
        out["final-omega"] = float(rep.final_omega)
    return out


def decode_reply(data: dict[str, Any], party: int) -> Reply:
    try:
        receivers = _ints(data["out-receivers"], "out-receivers")
        weights = _floats(data["out-weights"], "out-weights")
        payloads = _blobs(data["out-payloads"], "out-payloads")
        iteration = _int(data["out-iteration"], "out-iteration")
        rt_u = _ints(data["rt-iterations"], "rt-iterations")
        rt_r = _ints(data["rt-receivers"], "rt-receivers")
        rt_p = _blobs(data["rt-payloads"], "rt-payloads")
        state = data["state"]
        rep = Reply(party, computed=_int(data["computed"], "computed"),
                    state=state if isinstance(state, bytes) else b"",
                    rejected=_ints(data["rejected"], "rejected"))
    except KeyError as exc:
        raise ValueError(f"reply is missing {exc}") from None
    if not (len(receivers) == len(weights) == len(payloads)) or not (len(rt_u) == len(rt_r) == len(rt_p)):
        raise ValueError("reply lists have different lengths")
    rep.outgoing = [Outgoing(party, r, w, p, iteration) for r, w, p in zip(receivers, weights, payloads)]
    rep.retransmissions = [Outgoing(party, r, 0.0, p, u) for u, r, p in zip(rt_u, rt_r, rt_p)]
    if "final" in data:
        final = data["final"]
        if not isinstance(final, bytes) or len(final) % 8:
            raise ValueError("final: expected float64 bytes")
        rep.final = np.frombuffer(final, dtype=np.float64).copy()
        rep.final_omega = _float(data["final-omega"], "final-omega")
    return rep
