"""Argument checks shared by the whole package: one wording for every "must be" error.

Each check returns the value converted to a plain Python ``int`` or ``float`` and raises
``ValueError`` naming the argument and the allowed range, e.g. ``iterations must be an integer >= 1,
got 0``. ``bool`` is never accepted as a number (``True`` is an ``int`` in Python, but never what a
caller meant).

Resource limits. A size is checked against its limit *before* anything of that size is allocated, and the
error names the limit. The limits are far above any real run and far below what would exhaust a machine:

==========================  ===========  =============================================================
limit                       value        why
==========================  ===========  =============================================================
:data:`MAX_PARTIES`         10^7         parties n of an execution, a trace, a calibration, a simulation
:data:`MAX_ITERATIONS`      1000         mixing iterations T: a schedule holds (T+1) x T floats and a
                                         certificate (T+1) x n x T (real runs: T = 10 - 100)
:data:`MAX_ROUNDS`          10^5         training rounds: the PRV accountant's grid grows with
                                         sqrt(rounds) (10^9 rounds asked for 205 TiB)
:data:`MAX_RUNS`            10^5         simulated runs of a calibration or a figure (the paper: 10^3,
                                         Fig. 2: 10^5); each run's profile is kept in memory
:data:`MAX_SCALE`           1e100        sigmas, sensitivities, clip norms: their squares, summed over
                                         any run, stay finite (1e308 overflowed)
:data:`MIN_EPSILON`         1e-6         the smallest target epsilon: its noise (about
                                         1 / (sqrt(n) epsilon) value ranges) would swamp any value
:data:`MAX_EPSILON`         1e6          the largest target epsilon (no guarantee left long before)
:data:`MAX_LOCAL_STEPS`     10^5         local SGD steps or epochs per round (each one is a pass of work)
:data:`MAX_BATCH_SIZE`      10^6         examples in a client's batch
:data:`MAX_WORKERS`         10^4         actors, threads, threat draws per round
:func:`memory_limit`        half the     the bytes one dense computation (a certificate's matrices,
                            memory       IncA's or a baseline's; a complete graph's pairs; a demo's
                                         values) may take; ``FLWR_INCA_MAX_BYTES`` sets it
==========================  ===========  =============================================================
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

__all__ = [
    "MAX_BATCH_SIZE", "MAX_EPSILON", "MAX_ITERATIONS", "MAX_LOCAL_STEPS", "MAX_PARTIES", "MAX_ROUNDS",
    "MAX_RUNS", "MAX_SCALE", "MAX_WORKERS", "MEMORY_ENV", "MIN_EPSILON",
    "check_batch_size", "check_bool", "check_bytes", "check_delta", "check_epsilon", "check_int",
    "check_iterations", "check_local_steps", "check_parties", "check_probability", "check_real", "check_rounds",
    "check_runs", "check_scale", "check_workers", "format_bytes", "memory_limit",
]

MAX_PARTIES = 10**7
MAX_ITERATIONS = 1000
MAX_ROUNDS = 10**5
MAX_RUNS = 10**5
MAX_SCALE = 1e100
MIN_EPSILON = 1e-6
MAX_EPSILON = 1e6
MAX_LOCAL_STEPS = 10**5
MAX_BATCH_SIZE = 10**6
MAX_WORKERS = 10**4
# the memory limit when the machine's memory cannot be read (e.g. not Linux, macOS): 8 GiB
_FALLBACK_MEMORY = 8 * 2**30
MEMORY_ENV = "FLWR_INCA_MAX_BYTES"


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


# ---------------------------------------------------------------------------------------- domain checks
def check_parties(name: str, value: Any, minimum: int = 2) -> int:
    """A number of parties (clients) in ``[minimum, MAX_PARTIES]``."""
    return check_int(name, value, minimum, MAX_PARTIES)


def check_iterations(name: str, value: Any) -> int:
    """A number of mixing iterations T in ``[1, MAX_ITERATIONS]``."""
    return check_int(name, value, 1, MAX_ITERATIONS)


def check_rounds(name: str, value: Any) -> int:
    """A number of training rounds in ``[1, MAX_ROUNDS]``."""
    return check_int(name, value, 1, MAX_ROUNDS)


def check_runs(name: str, value: Any) -> int:
    """A number of simulated runs in ``[1, MAX_RUNS]``."""
    return check_int(name, value, 1, MAX_RUNS)


def check_local_steps(name: str, value: Any) -> int:
    """Local SGD steps or epochs per round, in ``[1, MAX_LOCAL_STEPS]``."""
    return check_int(name, value, 1, MAX_LOCAL_STEPS)


def check_batch_size(name: str, value: Any) -> int:
    """A batch size (examples), in ``[1, MAX_BATCH_SIZE]``."""
    return check_int(name, value, 1, MAX_BATCH_SIZE)


def check_workers(name: str, value: Any) -> int:
    """A number of actors, threads or draws done side by side or per round, in ``[1, MAX_WORKERS]``."""
    return check_int(name, value, 1, MAX_WORKERS)


def check_scale(name: str, value: Any, *, zero: bool = True) -> float:
    """A noise std, sensitivity or norm in ``[0, MAX_SCALE]`` (``(0, MAX_SCALE]`` unless ``zero``)."""
    return check_real(name, value, 0.0, MAX_SCALE, low_open=not zero)


def check_epsilon(name: str, value: Any) -> float:
    """A target epsilon in ``[MIN_EPSILON, MAX_EPSILON]``."""
    return check_real(name, value, MIN_EPSILON, MAX_EPSILON)


def check_delta(name: str, value: Any) -> float:
    """A target delta in ``(0, 1)``."""
    return check_real(name, value, 0.0, 1.0, low_open=True, high_open=True)


# ---------------------------------------------------------------------------------------- memory
def memory_limit() -> int:
    """Bytes one dense computation may allocate: ``$FLWR_INCA_MAX_BYTES`` if set (an integer > 0), else half
    of this machine's physical memory (8 GiB where it cannot be read)."""
    text = os.environ.get(MEMORY_ENV, "").strip()
    if text:
        try:
            value = int(float(text))
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError(f"{MEMORY_ENV} must be a number of bytes > 0, got {text!r}")
        return value
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2
    except (ValueError, OSError, AttributeError):
        return _FALLBACK_MEMORY


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit below it: ``6.5 GiB``, ``655 TiB``."""
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def check_bytes(what: str, nbytes: float, advice: str = "") -> None:
    """Raise ``ValueError`` if ``what`` would allocate more than :func:`memory_limit` bytes: one line naming
    the size, the limit and ``advice`` (what to do instead)."""
    limit = memory_limit()
    if nbytes > limit:
        source = f"set by {MEMORY_ENV}" if os.environ.get(MEMORY_ENV, "").strip() else \
            f"half this machine's memory; {MEMORY_ENV} changes it"
        raise ValueError(f"{what} would need about {format_bytes(nbytes)} of memory, over the limit of "
                         f"{format_bytes(limit)} ({source})" + (f"; {advice}" if advice else ""))
