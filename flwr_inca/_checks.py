"""Argument checks shared by the whole package: one wording for every "must be" error.

Each check returns the value converted to a plain Python ``int`` or ``float`` and raises
``ValueError`` naming the argument and the allowed range, e.g. ``iterations must be an integer >= 1,
got 0``. ``bool`` is never accepted as a number (``True`` is an ``int`` in Python, but never what a
caller meant).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_bool", "check_int", "check_probability", "check_real"]


def check_int(name: str, value: Any, minimum: int | None = 1, maximum: int | None = None) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]`` (either bound may be None: unbounded)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            allowed = f"an integer in [{minimum}, {maximum}]"
        elif minimum is not None:
            allowed = f"an integer >= {minimum}"
        elif maximum is not None:
            allowed = f"an integer <= {maximum}"
        else:
            allowed = "an integer"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return int(value)


def check_real(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
) -> float:
    """``value`` as a ``float`` in the interval from ``low`` to ``high`` (None: unbounded; closed
    unless ``low_open``/``high_open``). NaN is always refused; infinities unless ``finite=False``."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real)
    v = float(value) if ok else math.nan
    ok = ok and not math.isnan(v) and (math.isfinite(v) or not finite)
    if ok and low is not None:
        ok = v > low if low_open else v >= low
    if ok and high is not None:
        ok = v < high if high_open else v <= high
    if not ok:
        raise ValueError(f"{name} must be {_describe(low, high, low_open, high_open, finite)}, got {value!r}")
    return v


def check_bool(name: str, value: Any) -> bool:
    """A flag: ``True`` or ``False`` only (not 0/1, not a string such as ``"no"``, which is truthy)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")  # noqa: TRY004 - one error type for bad arguments
    return value


def check_probability(name: str, value: Any, *, zero: bool = True, one: bool = True) -> float:
    """A probability or fraction in [0, 1]; ``zero=False`` / ``one=False`` exclude the ends."""
    return check_real(name, value, 0.0, 1.0, low_open=not zero, high_open=not one)


def _describe(low: float | None, high: float | None, low_open: bool, high_open: bool, finite: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    what = "a finite number " if finite else ""
    if low is not None:
        return f"{what}{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{what}{'<' if high_open else '<='} {high:g}"
    return "a finite number" if finite else "a number"
