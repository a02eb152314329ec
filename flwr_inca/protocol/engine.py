"""The vectorized IncA engine: Initialization, Mixing and Dissemination (paper Algorithms 1 and 2).

All parties are simulated at once on an (n, d) array; the hot path has no Python loop over parties:
mixing is one sparse product per iteration (k+1 nonzeros per column of ``W^O_t``) and noise is drawn
in batches. Memory is O(n d): beside the messages, each party keeps only ``S_i``, the sum of the
noise it has injected and not yet cancelled (for D_Inc this is the single outstanding term).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import IncaConfig
from .dissemination import Dissemination, resolve_dissemination
from .dropout import resolve_dropout
from .noise import (
    TAG_DISSEMINATION,
    TAG_DROPOUT,
    TAG_TOPOLOGY,
    ExplicitNoise,
    NoiseSource,
    SeededNoise,
    resolve_seed,
    stream,
)
from .topology import Messages, check_column_stochastic
from .trace import ExecutionTrace, TraceStep


@functools.cache  # on first use, not at import: a ClientApp process (one per message) need not load SciPy
def _private_csr_matvecs():
    """SciPy's private ``csr_matvecs`` kernel (``y += A @ X`` in place, saving a temporary (n, d) array
    per iteration), if this SciPy has it with the expected behaviour; None otherwise, and
    :func:`_add_matvec` falls back to the public ``W @ y``."""
    try:
        from scipy.sparse import csr_matrix
        from scipy.sparse._sparsetools import csr_matvecs

        W = csr_matrix(np.array([[0.5, 0.0], [0.5, 1.0]]))
        x, out = np.array([[1.0, 2.0], [3.0, 4.0]]), np.ones((2, 2))
        csr_matvecs(2, 2, 2, W.indptr, W.indices, W.data, x.reshape(-1), out.reshape(-1))
        return csr_matvecs if np.array_equal(out, 1.0 + W @ x) else None
    except Exception:  # moved, renamed or changed: use the public API
        return None


__all__ = ["IncaResult", "run_inca", "replay", "sample_trace"]

Progress = Callable[[int, int], None]
# called with (t, y^(t)) after initialization (t = 0) and after each mixing iteration; y is the engine's
# (n, d) buffer, reused at the next iteration: copy what you keep
Observer = Callable[[int, np.ndarray], None]


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
    values, scalar = as_values(x)
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
    topo_rng = stream(seed, TAG_TOPOLOGY)
    topology = config.resolved_topology(n, seed=int(topo_rng.integers(2**63)))
    online = resolve_dropout(config.dropout).sample(n, T, stream(seed, TAG_DROPOUT))
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
    observer: Observer | None = None,
) -> IncaResult:
    """Re-run the recorded execution ``trace`` on values ``x``.

    With the same values, seed (or noise) and dissemination as the original run, the result is
    bit-for-bit identical: the engine itself mixes from the trace's steps. ``finalists`` restricts the
    output to the final messages that were actually disseminated (default: every party online at T;
    a deployment records the others as lost in ``trace.meta["finalists"]``). ``observer(t, y)`` sees every
    message ``y^(t)`` (an (n, d) array the engine reuses: copy what you keep), t = 0..T, e.g. to hand an
    auditing adversary the messages it observes (:mod:`flwr_inca.privacy.attack`).
    """
    trace.validate()
    values, scalar = as_values(x)
    if values.shape[0] != trace.parties:
        raise ValueError(f"x has {values.shape[0]} rows but the trace has {trace.parties} parties")
    seed = resolve_seed(seed)
    chosen = None
    if finalists is not None:
        chosen = np.unique(np.asarray(list(finalists), dtype=np.int64))
        if not np.isin(chosen, trace.steps[-1].online).all():
            raise ValueError("finalists must be parties online at the last iteration")
    return _execute(values, scalar, trace, noise or SeededNoise(seed), seed,
                    resolve_dissemination(dissemination), progress, finalists=chosen, observer=observer)


# ---------------------------------------------------------------------------------------- core
def _execute(
    values: np.ndarray,
    scalar: bool,
    trace: ExecutionTrace,
    noise: NoiseSource,
    seed: int,
    dissemination: Dissemination,
    progress: Progress | None,
    finalists: np.ndarray | None = None,
    observer: Observer | None = None,
) -> IncaResult:
    """Mix ``values`` along ``trace`` (Algorithm 2), then disseminate the finals."""
    T = trace.iterations
    if isinstance(noise, ExplicitNoise) and noise.eta.shape[1] != T:
        raise ValueError(f"ExplicitNoise: eta must have T = {T} terms per party, got {noise.eta.shape[1]}")
    mixing = _Mixing(values, trace, noise)
    if observer is not None:
        observer(0, mixing.y)
    for t in range(1, T + 1):
        mixing.step(t)
        if observer is not None:
            observer(t, mixing.y)
        if progress is not None:
            progress(t, T)
    if finalists is None:
        finalists = trace.steps[-1].online
    estimate, party_estimates = _disseminate(mixing, finalists, dissemination, seed)
    if scalar:
        estimate = estimate.reshape(())
    return IncaResult(estimate, mixing.y, mixing.omega, mixing.injected, finalists.copy(), party_estimates,
                      trace, seed)


class _Mixing:
    """The state of every party during one run, advanced one iteration at a time.

    ``y`` (n, d): the messages; ``outstanding`` (n, d): each party's ``S_i``, the noise it injected and has
    not cancelled yet; ``omega`` (n,): the tracked weights; ``injected`` (n,): ``w_i``; ``slot`` (n,): the
    online steps each party has used, i.e. the row of (c, Z) it uses next (the dropout-adapted schedule
    D^O of the paper's Sec. 3.2, read 0-based).
    """

    def __init__(self, values: np.ndarray, trace: ExecutionTrace, noise: NoiseSource) -> None:
        n, d = values.shape
        self.n, self.d, self.dtype = n, d, values.dtype
        self.trace, self.noise, self.schedule = trace, noise, trace.schedule
        self.T = trace.iterations
        self.s_delta = trace.sigma_delta
        self.x_tilde = values.copy()  # x + eta*
        if trace.sigma_star > 0:
            self.x_tilde += self.dtype.type(trace.sigma_star) * noise.star(n, d, self.dtype)
        self.incremental = self.schedule.is_incremental_pattern
        self.c_const = bool(np.all(self.schedule.c == self.schedule.c[0]))
        self.y = np.zeros((n, d), dtype=self.dtype)
        self.outstanding = np.zeros((n, d), dtype=self.dtype)
        self.omega = np.zeros(n)
        self.injected = np.zeros(n)
        self.slot = np.zeros(n, dtype=np.int64)
        self._spare = np.empty_like(self.y)
        self.inject(0, np.arange(n), self.y)  # y^(0) = z_0 (Algorithm 1, Initialization)

    def step(self, t: int) -> None:
        """Iteration t: ``y = W^O_t y + z_t`` over the parties online at t, ``omega = W^O_t omega + c``."""
        step = self.trace.steps[t - 1]
        W64 = step.matrix(self.n)
        W = W64 if self.dtype == np.float64 else W64.astype(self.dtype)
        self.omega = W64 @ self.omega
        # the fast path needs one c for everybody: a constant c, or equal slots (nobody was ever offline)
        if step.online.size == self.n and self.incremental and self.s_delta > 0 and (
                self.c_const or self.slot.min() == self.slot.max()):
            self._fast_incremental_step(t, W)
        else:
            self.y = W @ self.y
            self.inject(t, step.online, self.y)

    def inject(self, t: int, on: np.ndarray, target: np.ndarray) -> None:
        """Add ``z_{i,t}`` of the online parties ``on`` to ``target`` (D^O, paper Sec. 3.2)."""
        r = self.slot[on]
        coef = self.schedule.c[r]
        self.omega[on] += coef
        self.injected[on] += coef
        if on.size == self.n and self.c_const:
            target += self.dtype.type(coef[0]) * self.x_tilde
        else:
            target[on] += coef.astype(self.dtype)[:, None] * self.x_tilde[on]
        if t == self.T:
            self._cancel_outstanding(on, target)
            return
        if self.s_delta > 0:
            if self.incremental:
                self._inject_next_term(t, on, r, target)
            else:
                self._inject_schedule_rows(on, r, target)
        self.slot[on] += 1

    def _cancel_outstanding(self, on: np.ndarray, target: np.ndarray) -> None:
        """At t = T an online party cancels everything it still has outstanding."""
        if on.size == self.n:
            target -= self.outstanding
            self.outstanding[...] = 0
        else:
            target[on] -= self.outstanding[on]
            self.outstanding[on] = 0

    def _inject_next_term(self, t: int, on: np.ndarray, r: np.ndarray, target: np.ndarray) -> None:
        """D_Inc: row r adds ``eta_{r+1}`` and cancels ``eta_r`` (= S_i, the one term outstanding)."""
        new = self.noise.fresh(on, r + 1, t, self.d, self.dtype) * self.dtype.type(self.s_delta)
        if on.size == self.n:
            target += new
            target -= self.outstanding
            self.outstanding[...] = new
        else:
            target[on] += new - self.outstanding[on]
            self.outstanding[on] = new

    def _inject_schedule_rows(self, on: np.ndarray, r: np.ndarray, target: np.ndarray) -> None:
        """A general (c, Z) schedule: add ``sum_k Z[r, k] eta_k`` of each online party."""
        rows = self.schedule.Z[r]  # (len(on), T)
        for k in np.flatnonzero(np.any(rows != 0, axis=0)) + 1:
            sel = rows[:, k - 1] != 0
            who = on[sel]
            term = self.noise.term(who, int(k), self.n, self.d, self.dtype) * self.dtype.type(self.s_delta)
            term *= rows[sel, k - 1].astype(self.dtype)[:, None]
            target[who] += term
            self.outstanding[who] += term

    def _fast_incremental_step(self, t: int, W) -> None:
        """One D_Inc iteration with everybody online at a common slot (so one c), in 3 passes over (n, d)
        beside the draws: ``y' = c x~ - S; S = sigma_delta * fresh; y' += S; y' += W y`` (the numbers of
        :meth:`inject`, summed in another order)."""
        share = float(self.schedule.c[self.slot[0]])
        c = self.dtype.type(share)
        y_next = self._spare
        np.multiply(self.x_tilde, c, out=y_next)
        y_next -= self.outstanding
        if t < self.T:
            self.noise.fresh(np.arange(self.n), self.slot + 1, t, self.d, self.dtype, out=self.outstanding)
            self.outstanding *= self.dtype.type(self.s_delta)
            y_next += self.outstanding
        else:
            self.outstanding[...] = 0
        _add_matvec(W, self.y, y_next)
        self.omega += share
        self.injected += share
        if t < self.T:
            self.slot += 1
        self.y, self._spare = y_next, self.y


def _disseminate(mixing: _Mixing, finalists: np.ndarray, dissemination: Dissemination,
                 seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The estimate from the finalists' messages (NaN, with a warning, if there are none)."""
    if finalists.size == 0:
        warnings.warn("every party dropped out: IncA produced no output (estimate is NaN)", stacklevel=4)
        return np.full(mixing.d, np.nan, dtype=mixing.dtype), None
    estimate, party_estimates = dissemination.disseminate(
        mixing.y[finalists], mixing.omega[finalists], stream(seed, TAG_DISSEMINATION))
    if party_estimates is not None:
        party_estimates = np.asarray(party_estimates, dtype=mixing.dtype)
    return np.asarray(estimate, dtype=mixing.dtype), party_estimates


def _add_matvec(W, y: np.ndarray, out: np.ndarray) -> None:
    """``out += W @ y`` for a CSR matrix ``W`` and (n, d) arrays; without a temporary (n, d) array when
    SciPy's kernel is available (see :func:`_private_csr_matvecs`)."""
    kernel = _private_csr_matvecs()
    if kernel is not None:
        n, d = y.shape
        kernel(n, n, d, W.indptr, W.indices, W.data, y.reshape(-1), out.reshape(-1))
    else:
        out += W @ y


def as_values(x: Any) -> tuple[np.ndarray, bool]:
    """(n, d) float array from the input, and whether the input was (n,) scalars."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch tensor
        x = x.detach().cpu()
        try:
            x = x.numpy()
        except TypeError:  # a dtype NumPy lacks (bfloat16): float32 holds every such value exactly
            x = x.float().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise ValueError(f"x must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim not in (1, 2):
        raise ValueError(f"x must have shape (n, d) or (n,), got {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError(f"x is empty (shape {arr.shape}): give one row per party, n >= 2")
    scalar = arr.ndim == 1
    if arr.dtype not in (np.float32, np.float64):
        arr = arr.astype(np.float32 if arr.dtype == np.float16 else np.float64)
    if arr.shape[0] < 2:
        raise ValueError(f"x must have n >= 2 rows (parties), got {arr.shape[0]}")
    if arr.ndim == 2 and arr.shape[1] < 1:
        raise ValueError("x must have d >= 1 columns")
    arr = np.ascontiguousarray(arr.reshape(arr.shape[0], -1))
    if not np.all(np.isfinite(arr)):
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise ValueError(f"x must be finite: x[{bad[0]}, {bad[1]}] is {arr[bad[0], bad[1]]}")
    # every message is a combination of the values with weights in [0, 1], and the output sums the finals:
    # n * max|x| bounds what is ever summed
    n, largest = arr.shape[0], float(np.max(np.abs(arr)))
    limit = float(np.finfo(arr.dtype).max) / n
    if largest > limit:
        raise ValueError(f"x is too large to average in {arr.dtype}: values up to {largest:.3g} among "
                         f"n = {n} parties can overflow {arr.dtype} when summed (at most {limit:.3g}); "
                         "rescale them" + (" or pass float64" if arr.dtype == np.float32 else ""))
    return arr, scalar
