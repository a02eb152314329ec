"""``simulate``: the round loop.

Each round, in this order (charge first, then do anything that can fail):

1. who is available (across-round availability) and who takes part (``fraction`` of them);
2. the mixer's plan: for IncA a fresh execution trace (topology and in-round dropouts; it does not
   depend on any value) certified against the threat;
3. the ledger is charged the plan's cost; a round whose charge would exceed the budget releases
   nothing and is skipped (the model is unchanged), saying why. As in a deployment (IncaStrategy's
   pre-final rule and budget guard), IncA learns that only as the round runs: the round is charged what
   its mixing revealed until it stopped (``Mixer.stopped_cost``): before its final messages, or, when
   even that does not fit, before the first iteration whose messages would not fit
   (``reserve_stopped_round``, default), so the ledger never exceeds the budget. Training goes on with
   the next round's fresh execution; it stops after ``max_consecutive_refusals`` refused rounds in a
   row, when none of a refused round's messages was delivered (the budget left does not afford the
   first step of a round), or when the guard is off and the charge went past the budget. Before a
   refused round is charged, IncaStrategy's pre-round check (``flwr_inca.privacy.budget_check``) decides
   whether a deployment would have started it: if the round's *predicted* cost does not fit either,
   training stops before it and nothing of it is charged (``_pre_round_stop``);
4. the participants train locally from the current global model (Ray actors, vectorized);
5. the mixer computes the round's update, which is applied (released) and evaluated.

Steps 4 and 5 release nothing until the update is applied, so they overlap steps 2 and 3: training
starts on the actors before the driver certifies, and the charge (the accountant's composition) runs
in a thread beside the wait for training and the mix. The update is applied only after its charge
succeeded; a refused charge discards it.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .._progress import ProgressBar
from ..privacy.budget_check import check_round_budget
from ..privacy.ledger import BudgetExceededError, PrivacyLedger
from ..privacy.plan import PrivacyPlan, privacy_plan
from . import seeding
from .availability import AlwaysAvailable, AvailabilityTable, MarkovAvailability
from .backend import TrainingFailure, WorkPlanner, create_backend
from .config import SimulationConfig
from .history import History, RoundRecord
from .mixers import MixContext, Mixer, RoundPlan, create_mixer
from .partitions import Partitions
from .training import LossFn, ParamSpec, cross_entropy, evaluate

__all__ = ["simulate", "RoundContext", "charge_resolution"]

Progress = Callable[[RoundRecord, History], None]

DRIVER_BLAS_THREADS = 1  # BLAS threads of this process during the rounds (see _driver_blas_limit)


@dataclass
class RoundContext:
    """Handed to ``on_round`` after each round that trained: for analyses and tests."""

    round: int
    participants: np.ndarray  # client ids, ascending; row i of ``updates`` is participants[i]
    params_before: np.ndarray  # the global model the participants started from
    updates: np.ndarray  # (participants, d) clipped updates
    update: np.ndarray  # the released update (NaN if the round produced none)
    plan: RoundPlan


def charge_resolution(mu: float, resolution: float) -> float:
    """``mu`` rounded *up* to the grid ``(1 + resolution)^k`` (unchanged for 0, inf or resolution 0)."""
    if resolution <= 0 or mu <= 0 or not math.isfinite(mu):
        return float(mu)
    step = math.log1p(resolution)
    charged = math.exp(math.ceil(math.log(mu) / step - 1e-12) * step)
    while charged < mu:  # float safety: never charge less than the cost
        charged *= 1.0 + resolution
    return charged


def _expected_participants(config: SimulationConfig, clients: int) -> int:
    availability = config.availability
    share = 1.0
    if isinstance(availability, MarkovAvailability):
        share = availability.stationary
    elif isinstance(availability, AvailabilityTable):
        share = float(availability.table.mean())
    available = max(2, int(round(share * clients)))
    return min(clients, max(config.min_clients, int(config.fraction * available)))


class _StderrProgress:
    """One line per round on stderr, through the package's :class:`~flwr_inca._progress.ProgressBar`:
    rounds done / total, elapsed time and ETA, accuracy, epsilon, mu and seconds per round."""

    def __init__(self) -> None:
        self.bar: ProgressBar | None = None

    def __call__(self, record: RoundRecord, history: History) -> None:
        total = history.config["rounds"]
        if self.bar is None:  # the clock starts with the first report (the initial evaluation)
            self.bar = ProgressBar(total, "[flwr-inca simulate]", lines=True)
        if record.round == 0:
            acc = "n/a" if record.accuracy is None else f"{record.accuracy:.4f}"
            print(f"[flwr-inca simulate] {history.mixer}; {history.backend}; initial accuracy {acc}",
                  file=sys.stderr, flush=True)
            return
        if record.refused:
            status = (f"round {record.round:>4}/{total}  SKIPPED (refused by the budget; eps {record.epsilon:.4f}, "
                      f"charged mu {record.charged_mu:.4g} of {record.mu:.4g}): {record.failed}")
        elif record.failed:
            status = f"round {record.round:>4}/{total}  {record.failed}"
        else:
            acc = "   n/a" if record.accuracy is None else f"{record.accuracy:.4f}"
            eps = "inf" if not math.isfinite(record.epsilon) else f"{record.epsilon:.4f}"
            mark = "" if record.certified or not math.isfinite(record.mu) else "*"
            mu = "-" if not math.isfinite(record.mu) else f"{record.mu:.4g}{mark}"
            status = (f"round {record.round:>4}/{total}  acc {acc}  eps {eps}  mu {mu}  "
                      f"{record.participants} clients  {record.seconds:.2f} s/round "
                      f"(certify {record.seconds_plan:.2f} | train {record.seconds_train:.2f}, "
                      f"ledger {record.seconds_charge:.2f}, mix {record.seconds_mix:.2f})")
        self.bar.advance(max(record.round - self.bar.done, 0), status)


def simulate(
    model_fn: Callable[[], nn.Module],
    partitions: Partitions,
    test_set: tuple[np.ndarray, np.ndarray] | None,
    config: SimulationConfig | None = None,
    *,
    loss_fn: LossFn | None = None,
    mixer: Mixer | None = None,
    progress: bool | Progress = True,
    on_round: Callable[[RoundContext], None] | None = None,
    dataset: str = "",
) -> History:
    """Train ``model_fn()`` on ``partitions`` for ``config.rounds`` rounds of decentralized SGD.

    Args:
        model_fn: builds the model (a torch ``nn.Module`` with floating-point parameters); called once
            here under ``torch.manual_seed(config.seed)`` for the initial model, and once per trainer.
            It must be picklable for Ray (a function of an importable module, a ``functools.partial``,
            or a function defined in your script).
        partitions: the training data and each client's rows (``iid``, ``dirichlet``,
            ``from_indices``).
        test_set: ``(x_test, y_test)`` to evaluate the global model on, or None.
        config: a :class:`SimulationConfig` (default: its defaults).
        loss_fn: per-example loss ``loss_fn(outputs, targets) -> (batch,)`` (default cross-entropy).
        mixer: a :class:`Mixer` instance instead of ``config.mode`` (e.g. a custom mechanism).
        progress: True prints one line per round to stderr; a callable gets each ``RoundRecord``.
        on_round: called with a :class:`RoundContext` after each round that trained.
        dataset: a name for the data in the output.

    Returns:
        The :class:`History`; also written to ``config.output_dir`` after every round when set.
    """
    config = config if config is not None else SimulationConfig()
    if not isinstance(config, SimulationConfig):
        raise ValueError(f"config must be a SimulationConfig, got {type(config).__name__}")
    if not isinstance(partitions, Partitions):
        raise ValueError(
            "partitions must be a Partitions (see flwr_inca.simulation.iid / dirichlet / "
            f"from_indices), got {type(partitions).__name__}"
        )
    if not callable(model_fn):
        raise ValueError("model_fn must be a callable returning a torch nn.Module")
    if test_set is not None and (len(test_set) != 2 or len(test_set[0]) != len(test_set[1])):
        raise ValueError("test_set must be (x_test, y_test) with as many labels as rows, or None")
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model_fn must return a torch nn.Module, got {type(model).__name__}")
    spec = ParamSpec.of(model)
    params = spec.vector(model)
    # before anything is spent: a model that does not fit the data fails here, saying which data
    _check_fits(model, loss_fn, *partitions.client(0), "partitions (the training data)")
    if test_set is not None:
        _check_fits(model, loss_fn, test_set[0], test_set[1], "test_set")

    planned = config.budget_rounds or config.rounds
    try:
        plan = privacy_plan(
            config.privacy_unit,
            epsilon=config.epsilon,
            delta=config.delta,
            rounds=planned,
            clip_norm=config.clip_norm,
            lr=config.learning_rate,
            batch_size=config.batch_size,
            local_size=float(partitions.sizes().mean()),
            accountant=config.accountant,
        )
    except ValueError as exc:
        if "too low" not in str(exc):
            raise
        # Opacus's own message ("The privacy budget is too low.") names no parameter
        raise ValueError(
            f"epsilon = {config.epsilon:g} is too small for {planned} round(s) at delta = {config.delta:g}: no "
            f"noise multiplier Opacus can account reaches it ({exc}); raise epsilon, or plan fewer rounds "
            "(rounds / budget_rounds; record level: or a smaller batch_size)"
        ) from None
    mixer = mixer if mixer is not None else create_mixer(config)
    if not isinstance(mixer, Mixer):
        raise ValueError(f"mixer must be a Mixer, got {type(mixer).__name__}")
    if not mixer.private and config.epsilon is not None:
        raise ValueError(
            f"mode {mixer.name!r} adds no noise (its epsilon is infinite): run it with epsilon=None"
        )
    out_dir = Path(config.output_dir) if config.output_dir else None
    ledger = _open_ledger(config, plan, out_dir) if mixer.private else None

    clients = partitions.clients
    availability = config.availability or AlwaysAvailable()
    if isinstance(availability, AvailabilityTable) and availability.table.shape[0] < config.rounds:
        raise ValueError(
            f"availability: the table covers {availability.table.shape[0]} round(s), fewer than "
            f"rounds = {config.rounds}"
        )
    availability.reset(clients, seeding.stream(config.seed, seeding.AVAILABILITY, 0))
    # the ledger charges mu rounded up to the resolution: calibrate so that the rounded charge fits
    target = None if plan.mu_round is None else plan.mu_round / (1.0 + config.mu_resolution)
    mixer.prepare(
        MixContext(
            plan.value_sensitivity,
            target,
            plan.delta,
            _expected_participants(config, clients),
            spec.dimension,
            config.seed,
            config.precision,
        )
    )
    trainer_kwargs: dict[str, Any] = dict(
        unit=config.privacy_unit,
        lr=config.learning_rate,
        clip_norm=config.clip_norm,
        batch_size=config.batch_size,
        party_clip=plan.party_clip,
        loss_fn=loss_fn,
    )
    backend = create_backend(
        config.backend,
        model_fn,
        partitions,
        trainer_kwargs,
        num_actors=config.num_actors,
        address=config.ray_address,
    )
    planner = WorkPlanner(
        partitions,
        backend.cohorts,
        unit=config.privacy_unit,
        sample_rate=plan.sample_rate,
        batch_size=config.batch_size,
        local_steps=config.local_steps,
        local_epochs=config.local_epochs,
        seed=config.seed,
    )
    history = History(
        config.to_dict(), plan.to_dict(), mixer.describe(), backend.describe(), dataset or partitions.name
    )
    if ledger is not None and ledger.rounds:
        history.notes.append(
            f"resumed ledger {ledger.path}: {ledger.rounds} round(s) already spent, "
            f"epsilon = {ledger.epsilon():.4g}"
        )
    report = _StderrProgress() if progress is True else (progress or None)
    dtype = np.float64 if config.precision == "float64" else np.float32

    def evaluate_into(record: RoundRecord) -> None:
        if test_set is None:
            return
        start = time.perf_counter()
        record.loss, record.accuracy = evaluate(model, spec, params, test_set[0], test_set[1], loss_fn)
        if math.isnan(record.accuracy):
            record.accuracy = None
        record.seconds_eval = time.perf_counter() - start

    def save() -> None:
        if out_dir is not None:
            history.parameters = params
            history.save(out_dir, plot=False)

    charger = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inca-ledger")
    actors_replaced = 0
    refusals = 0  # rounds refused by the budget in a row (max_consecutive_refusals)
    resumed = ledger.rounds if ledger is not None else 0  # rounds charged before this run
    initial = RoundRecord(0, epsilon=ledger.epsilon() if ledger is not None else 0.0)
    evaluate_into(initial)
    history.records.append(initial)
    if report:
        report(initial, history)
    blas = _driver_blas_limit()
    try:
        for rnd in range(1, config.rounds + 1):
            start = time.perf_counter()
            record = RoundRecord(rnd)
            available = np.flatnonzero(
                availability.available(rnd, clients, seeding.stream(config.seed, seeding.AVAILABILITY, rnd))
            )
            record.available = int(available.size)
            if available.size < config.min_clients:
                record.failed = (
                    f"skipped: {available.size} client(s) available (min_clients = "
                    f"{config.min_clients}); the model is unchanged, nothing was spent"
                )
                record.epsilon = history.records[-1].epsilon
                record.seconds = time.perf_counter() - start
                history.records.append(record)
                if report:
                    report(record, history)
                continue
            count = min(available.size, max(config.min_clients, int(config.fraction * available.size)))
            participants = np.sort(
                seeding.stream(config.seed, seeding.SAMPLING, rnd).choice(
                    available, size=count, replace=False
                )
            )
            record.participants = int(count)

            # local training starts now on the actors: it releases nothing, so it may run while the
            # round is certified and charged; only the mixer's output is released, and only after
            t_train = time.perf_counter()
            collect = backend.submit(params, participants, planner.plan(rnd, participants))
            t = time.perf_counter()
            round_plan = mixer.plan(rnd, int(count))
            record.seconds_plan = time.perf_counter() - t
            record.mu, record.certified = float(round_plan.mu), bool(round_plan.certified)
            record.cost = str(round_plan.info.get("cost", "certified" if round_plan.certified else ""))
            record.finalists = round_plan.info.get("finalists")
            record.noise = {
                k: float(v)
                for k, v in round_plan.info.items()
                if k in ("sigma_star", "sigma_delta", "noise_multiplier", "noise_std")
            }

            # the charge runs beside the wait for training and the mix: the mix's output is released
            # (applied to the model) only once the charge has succeeded; a refused charge discards it
            charge = None
            if ledger is not None:
                record.charged_mu = charge_resolution(record.mu, config.mu_resolution)
                charge = charger.submit(
                    _charge, ledger, record.charged_mu, plan.sample_rate, f"round {rnd}: {record.cost}",
                    round_plan.info.get("method"), record.mu,
                )
            else:
                record.charged_mu, record.epsilon = math.inf, math.inf
            if out_dir is not None and config.save_traces and round_plan.trace is not None:
                round_plan.trace.meta["round"] = rnd
                round_plan.trace.save(out_dir / "traces" / f"round-{rnd:04d}.json")

            t = time.perf_counter()
            failure: BaseException | None = None
            try:
                updates = collect()
                record.seconds_train = time.perf_counter() - t_train
                record.seconds_train_wait = time.perf_counter() - t
                _zero_diverged(updates, participants, rnd, history)
                t = time.perf_counter()
                update = np.asarray(mixer.mix(updates.astype(dtype, copy=False), round_plan))
                record.seconds_mix = time.perf_counter() - t
            except BaseException as exc:  # noqa: BLE001  (re-raised once the charge is recorded)
                failure = exc
            refused = False  # the budget refused the round: it is skipped (charged what it revealed)
            if charge is not None:
                try:
                    record.epsilon, record.seconds_charge = charge.result()
                    refusals = 0
                except BudgetExceededError as exc:
                    mixer.abandon(round_plan)
                    # would a deployment have started it? (IncaStrategy's pre-round check; nothing charged if not)
                    history.stopped = _pre_round_stop(rnd, int(count), mixer, ledger, plan, config, resumed)
                    if not history.stopped:
                        refusals += 1
                        refused, history.stopped = _charge_refused(record, round_plan, mixer, ledger, plan,
                                                                   config, exc, refusals)
            now = getattr(backend, "replaced", 0)
            replaced, actors_replaced = now - actors_replaced, now
            if replaced:
                history.notes.append(
                    f"round {rnd}: {replaced} Ray actor(s) died and were replaced; their clients trained "
                    "again with the same seeds"
                )
            if refused or history.stopped:  # the update (if any) is discarded; what was revealed is charged
                if refused:
                    if history.stopped or rnd == config.rounds:  # the final model, unchanged, is evaluated
                        evaluate_into(record)
                    record.seconds = time.perf_counter() - start
                    history.records.append(record)
                    if report:
                        report(record, history)
                    save()
                elif history.records[-1].accuracy is None:  # stopped before this round: the final model
                    evaluate_into(history.records[-1])
                    save()
                if failure is not None and not isinstance(failure, TrainingFailure):
                    raise failure
                if history.stopped:
                    break
                continue
            if isinstance(failure, TrainingFailure):  # a lost trainer: this round only, training goes on
                mixer.abandon(round_plan)
                record.failed = (
                    f"local training was lost ({failure}); the model is unchanged, the round's cost was "
                    "charged (privacy that was planned is counted as spent)"
                )
                record.seconds = time.perf_counter() - start
                history.records.append(record)
                if report:
                    report(record, history)
                save()
                continue
            if failure is not None:
                raise failure
            before = params
            if update.shape != params.shape or not np.all(np.isfinite(update)):
                record.failed = (
                    "the mixer produced no finite update (e.g. every party dropped out); model unchanged"
                )
            else:
                params = (params + update).astype(np.float32)
                record.update_norm = float(np.linalg.norm(update))
            if rnd % config.eval_every == 0 or rnd == config.rounds:
                evaluate_into(record)
            record.seconds = time.perf_counter() - start
            history.records.append(record)
            if on_round is not None:
                on_round(RoundContext(rnd, participants, before, updates, update, round_plan))
            if report:
                report(record, history)
            save()
    finally:
        charger.shutdown(wait=True)
        if blas is not None:
            blas.restore_original_limits()
        try:
            history.memory = {"driver_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                              "actors_peak_mb": backend.peak_memory_mb()}
        except Exception:  # noqa: BLE001  (memory figures are informative only)
            pass
        backend.close()
        history.parameters = params
        hint = _chance_hint(history, test_set, config)
        if hint:
            history.notes.append(hint)
        if out_dir is not None:
            history.save(out_dir)
    if history.stopped and report:
        print(f"[flwr-inca simulate] {history.stopped}", file=sys.stderr, flush=True)
    return history


def _chance_hint(history: History, test_set: tuple[np.ndarray, np.ndarray] | None,
                 config: SimulationConfig) -> str:
    """A hint when a private training ends no better than always predicting the most common test label
    (a budget that is reachable but too small for the rounds asked: the noise drowns the updates), else "".

    "Chance" is the most common label's share of ``test_set`` (0.1135 on MNIST); "no better" means within
    5 points of it. Non-integer labels (regression) and runs without a finite epsilon get no hint."""
    try:
        acc, eps = history.accuracy, history.epsilon
        if test_set is None or acc is None or not history.rounds_trained or not math.isfinite(eps) or eps <= 0:
            return ""
        labels = np.asarray(test_set[1])
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or labels.size == 0 or labels.min() < 0:
            return ""
        chance = float(np.unique(labels, return_counts=True)[1].max() / labels.size)  # any label values
        if acc > chance + 0.05:
            return ""
        rounds = history.rounds_trained
        return (f"accuracy {acc:.4f} is no better than chance ({chance:.4f}: always predicting the most common test "
                f"label): at epsilon {eps:.4g} over {rounds} trained round(s) the privacy noise drowns the "
                "updates. Less noise per round: a larger epsilon, fewer rounds, or more clients (record level: "
                "larger batches too)")
    except Exception:  # noqa: BLE001  (a hint never breaks a finished run)
        return ""


def _pre_round_stop(rnd: int, participants: int, mixer: Mixer, ledger: PrivacyLedger, plan: PrivacyPlan,
                    config: SimulationConfig, resumed: int = 0) -> str:
    """IncaStrategy's pre-round budget check (:func:`flwr_inca.privacy.budget_check.check_round_budget`), for a
    round whose own execution does not fit the budget left: "" if a deployment would have started it (its
    predicted cost, ``Mixer.predicted_cost`` over ``budget_check_runs`` simulated executions, charged at the
    ``mu_resolution`` grid, fits; the round is then refused as it runs, see :func:`_charge_refused`), else
    why training stops before it, with the numbers: nothing of the round is released or charged.

    Only such a round is checked: a round whose execution fits is trained as without the check, so the check
    changes no run in which every round fits, costs nothing there (a prediction at n = 1000 takes
    ``budget_check_runs`` certificates: 6-7x a round's own; docs/simulation.md), and can only stop training where the
    run without it would have charged a refused round. ``resumed``: the rounds the ledger held before this run
    (when this run charged none, the message says what to change)."""
    predicted = mixer.predicted_cost(participants, config.budget_check_runs)
    if predicted is None:  # the mechanism reveals nothing before its release: _charge_refused stops it
        return ""
    charged = charge_resolution(predicted, config.mu_resolution)
    check = check_round_budget(ledger, rnd, lambda: charged, plan.sample_rate)
    if check.fits:
        return ""
    hint = ""
    if ledger.rounds == resumed and resumed:
        hint = (f" The ledger {ledger.path} holds the privacy spent by earlier runs: for a new run, choose another "
                "output_dir / ledger_path; to train more on the same data, raise epsilon.")
    elif ledger.rounds == resumed:
        hint = (" Not even one round at this noise fits the budget: raise epsilon, or add noise (sigma_star, "
                "sigma_delta; left unset, they are calibrated for the budget).")
    return (f"{check.reason}: its predicted cost, the worst certified mu over {config.budget_check_runs} simulated "
            f"execution(s) of its {participants} participants (as IncaStrategy predicts it), is {predicted:.4g} "
            f"(charged as {charged:.4g}); nothing of round {rnd} was released or charged.{hint}")


def _charge_refused(record: RoundRecord, round_plan: RoundPlan, mixer: Mixer, ledger: PrivacyLedger,
                    plan: PrivacyPlan, config: SimulationConfig, exc: BudgetExceededError,
                    refusals: int) -> tuple[bool, str]:
    """A round whose charge the budget refused (pre-final rule and budget guard, as IncaStrategy runs them):
    as in a deployment, which learns the round's cost only as it runs, it is charged what its mixing
    revealed until it stopped (``Mixer.stopped_cost``): before its final messages, or, with the guard
    (``reserve_stopped_round``), before the first iteration whose messages would not fit; so the ledger
    never exceeds the budget. The round is skipped (its update discarded, the model unchanged).

    Whether training goes on depends only on the round's execution trace and the ledger, never on the
    data (docs/privacy.md, "The budget guard"). Returns ``(recorded, stopped)``: whether the round was
    charged and is recorded as refused, and why training stops ("" if it goes on with the next round):
    the charge went past ``max_epsilon`` (guard off), none of the round's messages was delivered (the
    budget left does not afford the first step of a round; a mechanism that reveals nothing before its
    release is then not recorded at all), or ``max_consecutive_refusals`` rounds in a row were refused.
    """
    rnd = record.round
    fits = None
    if config.reserve_stopped_round and ledger.max_epsilon is not None:
        # the guard: deliver an iteration's messages only if what they reveal fits
        def fits(mu: float) -> bool:
            charged = charge_resolution(mu, config.mu_resolution)
            return ledger.epsilon_after(charged, plan.sample_rate) <= ledger.max_epsilon

    stopped_mu = charge_resolution(mixer.stopped_cost(round_plan, fits), config.mu_resolution)
    delivered = round_plan.info.get("delivered_iterations")
    iterations = round_plan.trace.iterations if round_plan.trace is not None else None
    guarded = delivered is not None and delivered != iterations
    if not (stopped_mu > 0 or guarded or delivered):  # the mechanism reveals nothing before its release
        return False, (f"stopped before round {rnd}: its cost would exceed the budget (nothing of it was "
                       f"released or spent). {exc}")
    where = (f"by the budget guard before delivering the messages of iteration {delivered + 1}" if guarded
             else "before its final messages")
    # its mixing ran up to there, nothing after it is revealed; charge what was
    record.epsilon = ledger.spend(stopped_mu, plan.sample_rate, force=True, note=f"round {rnd}: stopped {where}")
    record.charged_mu = stopped_mu  # record.mu stays the cost with the finals
    record.cost = (f"stopped {where}: charged the certificate of the messages of iterations 1..{delivered}"
                   if guarded else "stopped before its final messages: charged their no-finals certificate")
    record.refused = True
    record.failed = (f"skipped, refused by the budget: stopped {where}, charged what it revealed "
                     f"(mu = {stopped_mu:.4g}); the model is unchanged")
    what = (f"round {rnd} stopped {where}: with them it would exceed the budget; it was charged what its "
            f"mixing revealed until then (mu = {stopped_mu:.4g}, epsilon = {record.epsilon:.4g}); the model "
            f"is unchanged")
    if ledger.max_epsilon is not None and record.epsilon > ledger.max_epsilon:
        return True, (f"{what}. {exc} max_epsilon = {ledger.max_epsilon:g} was exceeded: the budget guard is "
                      "off (reserve_stopped_round=False); training stops")
    if guarded and delivered == 0:
        return True, (f"{what}. None of its messages was delivered: the budget left does not afford the first "
                      f"iteration of a round; training stops. {exc}")
    if refusals >= config.max_consecutive_refusals:
        return True, (f"{refusals} round(s) in a row were refused by the budget (max_consecutive_refusals = "
                      f"{config.max_consecutive_refusals}): training stops after round {rnd}; {what}. {exc}")
    return True, ""


def _driver_blas_limit() -> Any:
    """Single-threaded BLAS in this process during the rounds (restored after the run).

    The driver's BLAS work (the certificate's factorizations) overlaps the actors' training and the
    noise drawn ahead. With OpenBLAS's default of one thread per core, its threads wait for cores the
    actors hold, and a factorization of a few hundred rows then takes up to a second instead of
    milliseconds (benchmarks/RESULTS.md, "Simulator"). A fixed thread count also fixes the last bits of
    the certificates, which depend on it: a run gives the same numbers on any backend, with any number
    of actors, on machines with any number of cores."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a core dependency
        return None
    return threadpool_limits(limits=DRIVER_BLAS_THREADS, user_api="blas")


def _check_fits(model: nn.Module, loss_fn: LossFn | None, x: np.ndarray, y: np.ndarray, what: str) -> None:
    """Run the model and the loss on two examples of ``(x, y)``; ``ValueError`` naming ``what`` if they
    do not fit (wrong input width, classes, dtypes) or the loss is not one value per example."""
    x, y = np.ascontiguousarray(x[:2]), np.ascontiguousarray(y[:2])
    try:
        with torch.no_grad():
            losses = (loss_fn or cross_entropy)(model(torch.from_numpy(x)), torch.from_numpy(y))
    except Exception as exc:  # noqa: BLE001  (any failure is reported with what it was run on)
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(
            f"{what} does not fit the model of model_fn (or loss_fn): on 2 of its examples "
            f"(x {x.dtype} {x.shape[1:]}, y {y.dtype}), {type(exc).__name__}: {first}"
        ) from None
    if tuple(getattr(losses, "shape", ())) != (len(y),):
        raise ValueError(
            f"loss_fn must return one loss per example (shape ({len(y)},)), got "
            f"{tuple(getattr(losses, 'shape', ()))}"
        )


def _zero_diverged(updates: np.ndarray, participants: np.ndarray, rnd: int, history: History) -> None:
    """A client whose update is not finite (its training diverged) contributes a zero update, said in
    the notes. Sound: the replacement depends on that client's own update only and stays within the
    clip, so the sensitivity bound the round was certified for still holds."""
    bad = ~np.isfinite(updates).all(axis=1)
    if bad.any():
        updates[bad] = 0.0
        ids = participants[bad].tolist()
        history.notes.append(
            f"round {rnd}: client(s) {ids[:10]}{' ...' if len(ids) > 10 else ''} produced a non-finite "
            "update (diverged?): counted as a zero update"
        )


def _charge(ledger: PrivacyLedger, mu: float, sample_rate: float, note: str, method: str | None = None,
            certified_mu: float | None = None) -> tuple[float, float]:
    """Spend one round in the ledger: ``(composed epsilon, seconds)``; raises BudgetExceededError. ``mu``
    is charged; ``certified_mu`` (the round's cost, ``mu`` before rounding up) and ``method`` (what gave
    it) are recorded beside it."""
    start = time.perf_counter()
    epsilon = ledger.spend(mu, sample_rate, note=note, method=method, certified_mu=certified_mu)
    return epsilon, time.perf_counter() - start


def _open_ledger(config: SimulationConfig, plan: PrivacyPlan, out_dir: Path | None) -> PrivacyLedger:
    path = config.ledger_path or (out_dir / "ledger.json" if out_dir is not None else None)
    ledger = PrivacyLedger(path, delta=plan.delta, max_epsilon=config.epsilon, accountant=plan.accountant)
    ledger.accountant.check_sample_rate(plan.sample_rate)
    if ledger.rounds and config.epsilon is not None and ledger.epsilon() >= config.epsilon:
        raise ValueError(
            f"epsilon: the budget is already spent: the ledger {path} records epsilon = "
            f"{ledger.epsilon():.4g} >= epsilon = {config.epsilon:g} over {ledger.rounds} round(s); "
            "choose another output_dir / ledger_path for a new run"
        )
    return ledger
