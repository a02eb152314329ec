"""The vectorized IncA engine: Initialization, Mixing and Dissemination (paper Algorithms 1 and 2).

All parties are simulated at once on an (n, d) array; the hot path has no Python loop over parties:
mixing is one sparse product per iteration (k+1 nonzeros per column of ``W^O_t``) and noise is drawn
in batches. Memory is O(n d): beside the messages, each party keeps only ``S_i``, the sum of the
noise it has injected and not yet cancelled (for D_Inc this is the single outstanding term).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import IncaConfig
from .dissemination import Dissemination, resolve_dissemination
from .dropout import resolve_dropout
from .noise import (
    _TAG_DISSEMINATION,
    _TAG_DROPOUT,
    _TAG_TOPOLOGY,
    ExplicitNoise,
    NoiseSource,
    SeededNoise,
    resolve_seed,
    stream,
)
from .topology import Messages, check_column_stochastic
from .trace import ExecutionTrace, TraceStep

try:  # y += W @ x without a temporary; private SciPy kernel, with a public fallback
    from scipy.sparse._sparsetools import csr_matvecs as _csr_matvecs
except ImportError:  # pragma: no cover
    _csr_matvecs = None

__all__ = ["IncaResult", "run_inca", "replay", "sample_trace"]

Progress = Callable[[int, int], None]


@dataclass
class IncaResult:
    """Outcome of one run.

    Attributes:
        estimate: the output, ``sum(y_i^(T)) / sum(omega_i^(T))`` over parties online at T (exact
            dissemination) or the mean of the finalists' push-sum estimates (gossip); shape (d,),
            or () for scalar values. NaN if every party dropped out.
        final_messages: (n, d) ``y^(T)``; rows of parties offline at T hold their last message.
        weights: (n,) tracked weights ``omega^(T)`` (share of injected values each message carries).
        injected: (n,) ``w_i``, the share of ``x_i + eta*_i`` party i injected (Eq. (9)).
        finalists: indices of the parties online at T.
        party_estimates: (len(finalists), d) local estimates after gossip, else None.
        trace: the execution trace (no private value).
        seed: the run's seed (secret: it determines all noise).
    """

    estimate: np.ndarray
    final_messages: np.ndarray
    weights: np.ndarray
    injected: np.ndarray
    finalists: np.ndarray
    party_estimates: np.ndarray | None
    trace: ExecutionTrace
    seed: int


def run_inca(
    x: Any,
    config: IncaConfig,
    seed: int | None = None,
    *,
    noise: NoiseSource | None = None,
    progress: Progress | None = None,
) -> IncaResult:
    """Run IncA on the values ``x`` of n parties.

    Args:
        x: (n, d) array (or (n,) for scalars): row i is party i's value. float32 and float64 are
            kept; other numeric types become float64. Torch CPU tensors are accepted.
        config: protocol parameters.
        seed: makes the run (topology, dropouts, noise, gossip) deterministic; None = OS entropy.
        noise: override the noise draws (e.g. ``ExplicitNoise``); default ``SeededNoise(seed)``.
        progress: called as ``progress(t, T)`` after each mixing iteration.

    Returns:
        An :class:`IncaResult` with the estimate and the execution trace.
    """
    if not isinstance(config, IncaConfig):
        raise ValueError(f"config must be an IncaConfig, got {type(config).__name__}")
    values, scalar = _as_values(x)
    seed = resolve_seed(seed)
    trace = sample_trace(values.shape[0], config, seed)
    return _execute(values, scalar, trace, noise or SeededNoise(seed), seed,
                    resolve_dissemination(config.dissemination), progress)


def sample_trace(n: int, config: IncaConfig, seed: int | None = None) -> ExecutionTrace:
    """Draw what would happen in a run of ``n`` parties (topology and dropouts), without values.

    ``run_inca(x, config, seed)`` records exactly this trace; the accountant's calibration uses it
    to simulate executions cheaply.
    """
    config.check(n)
    seed = resolve_seed(seed)
    T = config.iterations
    topo_rng = stream(seed, _TAG_TOPOLOGY)
    topology = config.resolved_topology(n, seed=int(topo_rng.integers(2**63)))
    online = resolve_dropout(config.dropout).sample(n, T, stream(seed, _TAG_DROPOUT))
    if online.shape != (T + 1, n) or online.dtype != bool or not online[0].all():
        raise ValueError("dropout model returned an invalid online mask")
    steps = []
    for t, attempted in enumerate(topology.iterate(n, T, topo_rng), start=1):
        check_column_stochastic(attempted, n, where=f"W_{t}")
        on = online[t]
        keep = on[attempted.senders] & on[attempted.receivers]
        delivered = Messages(attempted.senders[keep], attempted.receivers[keep], attempted.weights[keep])
        steps.append(TraceStep(np.flatnonzero(on), delivered))
    if len(steps) != T:
        raise ValueError(f"topology produced {len(steps)} iterations, expected {T}")
    return ExecutionTrace(n, T, config.resolved_schedule(), float(config.sigma_star),
                          float(config.sigma_delta), steps)


def replay(
    trace: ExecutionTrace,
    x: Any,
    seed: int,
    *,
    dissemination: str | Dissemination = "exact",
    noise: NoiseSource | None = None,
    progress: Progress | None = None,
    finalists: Sequence[int] | None = None,
) -> IncaResult:
    """Re-run the recorded execution ``trace`` on values ``x``.

    With the same values, seed (or noise) and dissemination as the original run, the result is
    bit-for-bit identical: the engine itself mixes from the trace's steps. ``finalists`` restricts the
    output to the final messages that were actually disseminated (default: every party online at T;
    a deployment records the others as lost in ``trace.meta["finalists"]``).
    """
    trace.validate()
    values, scalar = _as_values(x)
    if values.shape[0] != trace.parties:
        raise ValueError(f"x has {values.shape[0]} rows but the trace has {trace.parties} parties")
    seed = resolve_seed(seed)
    chosen = None
    if finalists is not None:
        chosen = np.unique(np.asarray(list(finalists), dtype=np.int64))
        if not np.isin(chosen, trace.steps[-1].online).all():
            raise ValueError("finalists must be parties online at the last iteration")
    return _execute(values, scalar, trace, noise or SeededNoise(seed), seed,
                    resolve_dissemination(dissemination), progress, finalists=chosen)


# ---------------------------------------------------------------------------------------- core
def _execute(
    values: np.ndarray,
    scalar: bool,
    trace: ExecutionTrace,
    noise: NoiseSource,
    seed: int,
    dissemination: Dissemination,
    progress: Progress | None,
    force_general: bool = False,
    finalists: np.ndarray | None = None,
) -> IncaResult:
    n, d = values.shape
    dtype = values.dtype
    T = trace.iterations
    schedule = trace.schedule
    s_star, s_delta = trace.sigma_star, trace.sigma_delta
    if isinstance(noise, ExplicitNoise):
        if noise.eta.shape[1] != T:
            raise ValueError(f"ExplicitNoise: eta must have T = {T} terms per party, got {noise.eta.shape[1]}")

    x_tilde = values.copy()  # x + eta*
    if s_star > 0:
        x_tilde += dtype.type(s_star) * noise.star(n, d, dtype)
    incremental = schedule.is_incremental_pattern and not force_general
    c_const = bool(np.all(schedule.c == schedule.c[0]))

    y = np.zeros((n, d), dtype=dtype)
    outstanding = np.zeros((n, d), dtype=dtype)  # S_i: injected, not yet cancelled noise
    omega = np.zeros(n)
    injected = np.zeros(n)
    slot = np.zeros(n, dtype=np.int64)  # online steps used so far (row of (c, Z) to use next)

    def inject(t: int, on: np.ndarray, target: np.ndarray) -> None:
        """Add ``z_{i,t}`` of the online parties ``on`` to ``target`` (D^O, SPEC §2)."""
        final = t == T
        r = slot[on]
        coef = schedule.c[r]
        omega[on] += coef
        injected[on] += coef
        full = on.size == n
        if full and c_const:
            target += dtype.type(coef[0]) * x_tilde
        else:
            target[on] += coef.astype(dtype)[:, None] * x_tilde[on]
        if final:  # cancel everything still outstanding
            if full:
                target -= outstanding
                outstanding[...] = 0
            else:
                target[on] -= outstanding[on]
                outstanding[on] = 0
            return
        if s_delta > 0:
            if incremental:  # row r adds eta_{r+1} and cancels eta_r (= S_i)
                new = noise.fresh(on, r + 1, t, d, dtype) * dtype.type(s_delta)
                if full:
                    target += new
                    target -= outstanding
                    outstanding[...] = new
                else:
                    target[on] += new - outstanding[on]
                    outstanding[on] = new
            else:
                rows = schedule.Z[r]  # (len(on), T)
                for k in np.flatnonzero(np.any(rows != 0, axis=0)) + 1:
                    sel = rows[:, k - 1] != 0
                    who = on[sel]
                    term = noise.term(who, int(k), n, d, dtype) * dtype.type(s_delta)
                    term *= rows[sel, k - 1].astype(dtype)[:, None]
                    target[who] += term
                    outstanding[who] += term
        slot[on] += 1

    inject(0, np.arange(n), y)
    y_next = np.empty_like(y)
    for t in range(1, T + 1):
        step = trace.steps[t - 1]
        W64 = step.matrix(n)
        W = W64 if dtype == np.float64 else W64.astype(dtype)
        omega = W64 @ omega
        if step.online.size == n and incremental and c_const and s_delta > 0 and _csr_matvecs is not None:
            c = schedule.c[0]
            _fast_incremental_step(t, T, W, y, y_next, x_tilde, outstanding, noise, c, s_delta, slot + 1)
            omega += c
            injected += c
            if t < T:
                slot += 1
            y, y_next = y_next, y
        else:
            y = W @ y
            inject(t, step.online, y)
        if progress is not None:
            progress(t, T)

    if finalists is None:
        finalists = trace.steps[-1].online
    if finalists.size == 0:
        warnings.warn("every party dropped out: IncA produced no output (estimate is NaN)", stacklevel=3)
        estimate = np.full(d, np.nan)
        party_estimates = None
    else:
        diss_rng = stream(seed, _TAG_DISSEMINATION)
        estimate, party_estimates = dissemination.disseminate(y[finalists], omega[finalists], diss_rng)
    estimate = np.asarray(estimate, dtype=dtype)
    if party_estimates is not None:
        party_estimates = np.asarray(party_estimates, dtype=dtype)
    if scalar:
        estimate = estimate.reshape(())
    return IncaResult(estimate, y, omega, injected, finalists.copy(), party_estimates, trace, seed)


def _fast_incremental_step(t, T, W, y, y_next, x_tilde, outstanding, noise, c, s_delta, terms):
    """One D_Inc iteration with everybody online, in 3 passes over (n, d) beside the draws:
    ``y_next = c x~ - S; S = sigma_delta * fresh; y_next += S; y_next += W y``.
    ``terms[i]`` is the index k of party i's new noise term."""
    n, d = y.shape
    dtype = y.dtype
    np.multiply(x_tilde, dtype.type(c), out=y_next)
    y_next -= outstanding
    if t < T:
        noise.fresh(np.arange(n), terms, t, d, dtype, out=outstanding)
        outstanding *= dtype.type(s_delta)
        y_next += outstanding
    else:
        outstanding[...] = 0
    _csr_matvecs(n, n, d, W.indptr, W.indices, W.data, y.reshape(-1), y_next.reshape(-1))


def _as_values(x: Any) -> tuple[np.ndarray, bool]:
    """(n, d) float array from the input, and whether the input was (n,) scalars."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch tensor
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise ValueError(f"x must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim not in (1, 2):
        raise ValueError(f"x must have shape (n, d) or (n,), got {arr.shape}")
    scalar = arr.ndim == 1
    if arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float32 if arr.dtype == np.float16 else np.float64)
    arr = np.ascontiguousarray(arr.reshape(arr.shape[0], -1))
    if arr.shape[0] < 2:
        raise ValueError(f"x must have n >= 2 rows (parties), got {arr.shape[0]}")
    if arr.shape[1] < 1:
        raise ValueError("x must have d >= 1 columns")
    if not np.all(np.isfinite(arr)):
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise ValueError(f"x must be finite: x[{bad[0]}, {bad[1]}] is {arr[bad[0], bad[1]]}")
    return arr, scalar
