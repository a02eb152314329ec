"""The search that finds how much of a privacy budget a round may take, in one place.

The ledger's composition (Opacus's PRV) costs 0.05-0.5 s a query, and the budget's checks ask it for the
largest of an ordered set of costs that still fits: the per-round share of what is left (a grid of mu),
the furthest step of a round whose ceiling may be reserved at once. Both answers move little from one
round to the next, so the search starts from the last one: a bracket grown 1, 2, 4, ... indices from it
towards the sign change of the excess ``log(epsilon) - log(budget)``, then regula falsi (Illinois) inside
it. An answer that did not move costs two compositions, where a bisection takes five to eight.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["last_fitting"]


def last_fitting(excess: Callable[[int], float], start: int, lower: int, upper: int, *,
                 stride: int = 1) -> int | None:
    """The largest ``i`` in ``[lower, upper]`` with ``excess(i) <= 0`` (None if ``excess(lower) > 0``), for
    an ``excess`` increasing in ``i``; the search starts at ``start`` (clamped into the range; the last
    answer is a good start) with a first stride of ``stride`` indices.

    The bracket grows geometrically from ``start`` until the excess changes sign (or the range ends), then
    each step probes the index where the line through the bracket's ends crosses zero (clamped inside it;
    the end that stayed put twice in a row has its value halved, so both ends move); an end whose excess
    is infinite (a cost no finite epsilon covers) makes that step a bisection. No index is probed twice.
    With a non-monotone ``excess`` the index returned still has ``excess <= 0`` (it was probed) and the
    next one does not."""
    if not lower <= upper or stride < 1:
        raise ValueError(f"last_fitting needs lower <= upper and stride >= 1, got lower = {lower}, "
                         f"upper = {upper}, stride = {stride}")
    x = min(max(start, lower), upper)
    fx = excess(x)
    direction = 1 if fx <= 0 else -1
    while True:  # grow the bracket towards the sign change
        if x == (upper if direction == 1 else lower):
            return x if fx <= 0 else None
        y = min(max(x + direction * stride, lower), upper)
        fy = excess(y)
        if (fx <= 0) != (fy <= 0):
            break
        stride *= 2
        x, fx = y, fy
    (low, f_low), (high, f_high) = sorted(((x, fx), (y, fy)))
    side = 0
    while high - low > 1:
        if math.isfinite(f_high) and math.isfinite(f_low):
            mid = min(max(round(high - f_high * (high - low) / (f_high - f_low)), low + 1), high - 1)
        else:
            mid = (low + high) // 2
        f_mid = excess(mid)
        if f_mid <= 0:
            low, f_low = mid, f_mid
            if side == -1:
                f_high /= 2  # Illinois: the stale end's weight halved
            side = -1
        else:
            high, f_high = mid, f_mid
            if side == 1:
                f_low /= 2
            side = 1
    return low
