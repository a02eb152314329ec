"""argparse ``type`` converters shared by the command lines (``flwr-inca`` and ``flwr-inca study``): each
turns one argument into a checked value or raises ``argparse.ArgumentTypeError`` with the allowed range
(the parsers print it as one line that names the option)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

from ._checks import MAX_EPSILON, MAX_ITERATIONS, MIN_EPSILON, check_int, check_real

__all__ = ["comma_separated", "dropout_rate", "epsilon", "int_in", "iterations", "iterations_or_auto", "real_in"]

T = TypeVar("T")


def int_in(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer in ``[minimum, maximum]`` (checked by ``_checks.check_int``)."""
    def convert(text: str) -> int:
        try:
            value: Any = int(text)
        except ValueError:  # not an integer (e.g. 1e9, x, a number of 5000 digits): the same message
            value = text
        try:
            return check_int("value", value, minimum, maximum)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value ")) from None

    return convert


def real_in(low: float | None, high: float | None = None, *, low_open: bool = False,
            high_open: bool = False) -> Callable[[str], float]:
    """A finite number in the interval (checked by ``_checks.check_real``)."""
    def convert(text: str) -> float:
        try:
            value: Any = float(text)
        except ValueError:
            value = text
        try:
            return check_real("value", value, low, high, low_open=low_open, high_open=high_open)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value ")) from None

    return convert


iterations = int_in(1, MAX_ITERATIONS)  # IncA's mixing iterations T (also a bound on them: --max-iterations)
epsilon = real_in(MIN_EPSILON, MAX_EPSILON)  # a target or tuning epsilon
dropout_rate = real_in(0.0, 1.0, high_open=True)  # gamma, a share of parties dropping out, in [0, 1)


def iterations_or_auto(text: str) -> int | str:
    """IncA's mixing iterations T: 'auto' or an integer in [1, MAX_ITERATIONS]."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return iterations(text)
    except argparse.ArgumentTypeError as exc:
        got = str(exc).rpartition(", got ")[2]
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer in [1, {MAX_ITERATIONS}], got {got}") from None


def comma_separated(convert: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """A comma-separated list (``1,3,8``), each item converted by ``convert`` (an ``int_in``/``real_in``);
    an item that fails names itself: ``must be a number in ..., got 'abc' (item 2 of '1,abc')``."""
    def convert_all(text: str) -> tuple[T, ...]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        values = []
        for position, item in enumerate(items, 1):
            try:
                values.append(convert(item))
            except argparse.ArgumentTypeError as exc:
                where = f" (item {position} of {text!r})" if len(items) > 1 else ""
                raise argparse.ArgumentTypeError(f"{exc}{where}") from None
        return tuple(values)

    return convert_all
