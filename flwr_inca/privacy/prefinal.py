"""What a round costs if it is stopped before its final messages (the pre-final rule).

A round's trace up to iteration T (who was online, who sent what weight to whom) is known before any
final message is revealed, and observing more messages can only raise mu. So a deployment certifies
the round with every final observed (the pre-final certificate, an upper bound on the round's cost
whatever finals then arrive) *before* collecting them, and collects them only if that fits the budget;
otherwise it stops the round and charges what was observed without the finals.

That no-finals cost has a ceiling known before the round starts: :func:`no_finals_bound`. Observing
every message before the finals (the most any adversary can see without them) is equivalent to
observing each party's injected terms ``z_i^(t)``, t < T (subtract the known mix of the messages of
t - 1), which depend only on the party's own value and noise; a party online at every t < T injects
rows 0..T-1 of the schedule (paper Sec. 3.2, Algorithm 2), a party offline at some of them a prefix of
those rows. So no execution, dropout pattern or adversary gives any party a larger mu without the
finals than one party observed at all of its T first injections. A check of the budget against this
ceiling before a round starts makes ``max_epsilon`` a hard limit also for a round stopped before its
finals.
"""

from __future__ import annotations

import numpy as np

from ..protocol.schedules import InjectionSchedule
from ..protocol.topology import Messages
from ..protocol.trace import ExecutionTrace, TraceStep
from .certificate import certify
from .views import AdversaryView

__all__ = ["no_finals_bound"]


def no_finals_bound(schedule: InjectionSchedule, sigma_star: float, sigma_delta: float,
                    value_sensitivity: float = 1.0) -> float:
    """The largest mu of any party, on any execution with this schedule and these sigmas, against an
    adversary that observes every message except the final ones (see the module docstring).

    Computed exactly with :func:`flwr_inca.privacy.certify` on two parties that exchange nothing and
    are both observed at iterations 0..T-1.
    """
    T = schedule.iterations
    nothing = Messages(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    trace = ExecutionTrace(2, T, schedule, float(sigma_star), float(sigma_delta),
                           [TraceStep(np.arange(2), nothing) for _ in range(T)])
    observed = np.ones((T + 1, 2), dtype=bool)
    observed[T] = False  # no final message
    view = AdversaryView("eavesdrop", np.zeros(0, dtype=np.int64), observed)
    return float(certify(trace, view, value_sensitivity=value_sensitivity).max_mu)
