"""JSON with infinities: the package's files and ``--json`` outputs write ``"inf"`` for an unbounded
value (a party without a privacy guarantee has ``mu = inf``), never the non-standard ``Infinity``.

Write with :func:`dumps` (or ``json.dumps(obj, cls=InfinityEncoder)``); read numbers back with
:func:`float_from_json`.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

__all__ = ["InfinityEncoder", "dumps", "float_from_json", "jsonable", "loads"]

_SPELLING = {math.inf: "inf", -math.inf: "-inf"}
_READING = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def jsonable(obj: Any) -> Any:
    """``obj`` with every non-finite float spelled ``"inf"``, ``"-inf"`` or ``"nan"``, NumPy scalars and
    arrays as Python numbers and lists, tuples as lists (dicts, lists and other values are walked)."""
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if math.isfinite(v) else _SPELLING.get(v, "nan")
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


class InfinityEncoder(json.JSONEncoder):
    """``json.JSONEncoder`` that writes non-finite floats as strings (see :func:`jsonable`)."""

    def iterencode(self, o: Any, _one_shot: bool = False):  # type: ignore[override]
        return super().iterencode(jsonable(o), _one_shot)


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` with :class:`InfinityEncoder` (and ``allow_nan=False``: nothing non-standard)."""
    return json.dumps(obj, cls=InfinityEncoder, allow_nan=False, **kwargs)


def loads(text: str | bytes, what: str) -> Any:
    """``json.loads`` whose every failure is a one-line ``ValueError`` starting with ``what`` (e.g. the
    file's name): invalid JSON, and nesting too deep for the parser (a crafted file of ``[[[[...``
    would otherwise raise ``RecursionError``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{what}: not valid JSON (nested too deeply)") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what}: not valid JSON (not UTF-8: {exc.reason} at byte {exc.start})") from None


def float_from_json(value: Any, name: str) -> float:
    """A number written by :func:`dumps` back as a float; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, str) and value in _READING:
        return _READING[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number or 'inf', got {value!r}")
    return float(value)
