"""``simulate``: the round loop of a simulated decentralized training.

Each round runs these named steps, in this order (the product's first promise: charge, then release):

1. **participants**: who is available (across-round availability) and who takes part;
2. **plan**: the mixer's plan, before any value exists (IncA: a fresh execution trace, certified);
   local training starts on the actors meanwhile (it releases nothing);
3. **charge**: the round through the run's :class:`~flwr_inca.privacy.session.RoundSession`, as
   ``IncaStrategy`` runs a Flower round: admitted (a round predicted not to fit does not start, and
   training stops), reserved before anything is revealed, each step guarded, the release only if it
   fits, then charged; a refused round is charged what it revealed and skipped. The charge runs in a
   thread beside the wait for training;
4. **mix**: the participants' clipped updates become the round's update;
5. **apply**: the update is applied (released) only if the charge released the round;
6. **evaluate** and **record**: the global model is evaluated; the round is recorded and the history,
   the model and the ledger written to the output directory (``resume`` continues a run from them).
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .._io import atomic_write_bytes, remove_temp_files
from .._progress import ProgressBar
from ..privacy.ledger import PrivacyLedger
from ..privacy.plan import PrivacyPlan, privacy_plan
from ..privacy.session import BudgetExhausted, RoundCharge, RoundSession
from ..rounds import trace_privacy
from . import seeding
from .availability import AlwaysAvailable, AvailabilityTable, MarkovAvailability
from .backend import TrainingFailure, WorkPlanner, create_backend
from .config import SimulationConfig
from .history import History, RoundRecord
from .mixers import MixContext, Mixer, RoundPlan, create_mixer
from .partitions import Partitions
from .training import LossFn, ParamSpec, cross_entropy, evaluate

__all__ = ["simulate", "RoundContext"]

Progress = Callable[[RoundRecord, History], None]

DRIVER_BLAS_THREADS = 1  # BLAS threads of this process during the rounds (see _driver_blas_limit)
MODEL_FILE = "model.npy"  # the global model after the last recorded round (what resume continues from)


@dataclass
class RoundContext:
    """Handed to ``on_round`` after each round that trained: for analyses and tests."""

    round: int
    participants: np.ndarray  # client ids, ascending; row i of ``updates`` is participants[i]
    params_before: np.ndarray  # the global model the participants started from
    updates: np.ndarray  # (participants, d) clipped updates
    update: np.ndarray  # the released update (NaN if the round produced none)
    plan: RoundPlan


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
    resume: bool = False,
) -> History:
    """Train ``model_fn()`` on ``partitions`` for ``config.rounds`` rounds of decentralized SGD.

    Args:
        model_fn: builds the model (a torch ``nn.Module`` with floating-point parameters); called once
            here under ``torch.manual_seed(config.seed)`` for the initial model, and once per trainer.
            It must be picklable for Ray (a function of an importable module, a ``functools.partial``,
            or a function defined in your script).
        partitions: the training data and each client's rows (``iid``, ``dirichlet``, ``from_indices``).
        test_set: ``(x_test, y_test)`` to evaluate the global model on, or None.
        config: a :class:`SimulationConfig` (default: its defaults).
        loss_fn: per-example loss ``loss_fn(outputs, targets) -> (batch,)`` (default cross-entropy).
        mixer: a :class:`Mixer` instance instead of ``config.mode`` (e.g. a custom mechanism).
        progress: True prints one line per round to stderr; a callable gets each ``RoundRecord``.
        on_round: called with a :class:`RoundContext` after each round that trained.
        dataset: a name for the data in the output.
        resume: continue the run recorded in ``config.output_dir`` (same settings, more rounds allowed)
            from its last recorded round, with its model and ledger. Without it, an output directory
            that already holds a run is refused (nothing is overwritten).

    Returns:
        The :class:`History`; also written to ``config.output_dir`` after every round when set.
    """
    run = _Run.create(model_fn, partitions, test_set, config, loss_fn, mixer, progress, dataset, resume)
    return run.train(on_round)


class _Run:
    """The state of one simulation and its named steps (see the module doc)."""

    def __init__(self) -> None:  # built by create()
        self.config: SimulationConfig
        self.history: History
        self.params: np.ndarray

    # -------------------------------------------------------------------------------- setup
    @classmethod
    def create(cls, model_fn, partitions, test_set, config, loss_fn, mixer, progress, dataset,
               resume) -> _Run:
        self = cls()
        config = config if config is not None else SimulationConfig()
        _check_inputs(model_fn, partitions, test_set, config)
        self.config, self.partitions, self.test_set, self.loss_fn = config, partitions, test_set, loss_fn
        self.out_dir = Path(config.output_dir) if config.output_dir else None
        previous = _previous_run(self.out_dir, resume)
        with torch.random.fork_rng():
            torch.manual_seed(config.seed)
            self.model = model_fn()
        if not isinstance(self.model, nn.Module):
            raise ValueError(f"model_fn must return a torch nn.Module, got {type(self.model).__name__}")
        self.spec = ParamSpec.of(self.model)
        self.params = self.spec.vector(self.model)
        # before anything is spent: a model that does not fit the data fails here, saying which data
        _check_fits(self.model, loss_fn, *partitions.client(0), "partitions (the training data)")
        if test_set is not None:
            _check_fits(self.model, loss_fn, test_set[0], test_set[1], "test_set")
        self.plan = _privacy_plan(config, partitions)
        self.mixer = mixer if mixer is not None else create_mixer(config)
        if not isinstance(self.mixer, Mixer):
            raise ValueError(f"mixer must be a Mixer, got {type(self.mixer).__name__}")
        if not self.mixer.private and config.privacy.max_epsilon is not None:
            raise ValueError(f"mode {self.mixer.name!r} adds no noise (its epsilon is infinite): run it without a "
                             "budget (max_epsilon=None)")
        self.ledger = _open_ledger(config, self.plan, self.out_dir, resumed=previous is not None) \
            if self.mixer.private else None
        self.session = None if self.ledger is None else RoundSession(
            self.ledger, sample_rate=self.plan.sample_rate,
            max_consecutive_refusals=config.privacy.max_consecutive_refusals,
            resolution=config.privacy.mu_resolution)
        self._prepare_availability()
        self._prepare_mixer()
        self._prepare_backend(model_fn)
        self.history = History(config.to_dict(), self.plan.to_dict(), self.mixer.describe(),
                               self.backend.describe(), dataset or partitions.name)
        self.history.notes.extend(getattr(self.mixer, "notes", []))
        if self.ledger is not None and self.ledger.rounds and previous is None:
            self.history.notes.append(f"resumed ledger {self.ledger.path}: {self.ledger.rounds} round(s) already "
                                      f"spent, epsilon = {self.ledger.epsilon():.4g}")
        self.report = _StderrProgress() if progress is True else (progress or None)
        self._announce(progress is True)
        self.first_round = 1
        self.charges: dict[int, RoundCharge] = {}  # what the session charged, by round
        if previous is not None:
            self._resume_from(previous)
        return self

    def _prepare_availability(self) -> None:
        config, clients = self.config, self.partitions.clients
        self.availability = config.availability or AlwaysAvailable()
        if isinstance(self.availability, AvailabilityTable) and self.availability.table.shape[0] < config.rounds:
            raise ValueError(f"availability: the table covers {self.availability.table.shape[0]} round(s), fewer "
                             f"than rounds = {config.rounds}")
        self.availability.reset(clients, seeding.stream(config.seed, seeding.AVAILABILITY, 0))

    def _prepare_mixer(self) -> None:
        config, plan = self.config, self.plan
        # the ledger charges mu rounded up to the resolution: calibrate so that the rounded charge fits
        target = None if plan.mu_round is None else plan.mu_round / (1.0 + config.privacy.mu_resolution)
        self.mixer.prepare(MixContext(plan.value_sensitivity, target, plan.delta,
                                      _expected_participants(config, self.partitions.clients),
                                      self.spec.dimension, config.seed, config.mixing.precision))

    def _prepare_backend(self, model_fn) -> None:
        config, plan = self.config, self.plan
        trainer_kwargs: dict[str, Any] = dict(unit=config.privacy_unit, lr=config.learning_rate,
                                              clip_norm=config.privacy.clip_norm, batch_size=config.batch_size,
                                              party_clip=plan.party_clip, loss_fn=self.loss_fn)
        self.backend = create_backend(config.backend, model_fn, self.partitions, trainer_kwargs,
                                      num_actors=config.num_actors, address=config.ray_address)
        self.planner = WorkPlanner(self.partitions, self.backend.cohorts, unit=config.privacy_unit,
                                   sample_rate=plan.sample_rate, batch_size=config.batch_size,
                                   local_steps=config.local_steps, local_epochs=config.local_epochs,
                                   seed=config.seed)

    def _announce(self, to_stderr: bool) -> None:
        """Before round 1: where the budget lives (a resumed one said loudly), and whether the noise would
        drown the updates (IncA: the history's notes keep both)."""
        lines = []
        ledger = self.ledger
        if ledger is not None and ledger.path is not None:
            where = ledger.path.resolve()
            lines.append(f"ledger {where}: resumes {ledger.rounds} round(s) already spent, epsilon = "
                         f"{ledger.epsilon():.4g} (a fresh budget needs another output_dir / ledger_path)"
                         if ledger.rounds else f"ledger {where} (new)")
        rounds = getattr(self.mixer, "rounds", None)
        if rounds is not None and hasattr(rounds, "usefulness_warning"):
            config, plan = self.config, self.plan
            norm = plan.value_sensitivity * config.batch_size if config.privacy_unit == "record" else \
                config.privacy.clip_norm  # the largest averaged update: lr C (record level), or the clip
            why = rounds.usefulness_warning(_expected_participants(config, self.partitions.clients),
                                            self.spec.dimension, norm, config.privacy.budget_rounds or config.rounds)
            if why:
                self.history.notes.append(f"warning: {why}")
                lines.append(f"WARNING: {why}")
        if to_stderr:
            for line in lines:
                print(f"[flwr-inca simulate] {line}", file=sys.stderr, flush=True)

    def _resume_from(self, previous: History) -> None:
        """Continue ``previous``: its records and model, the availability replayed to its last round."""
        if _comparable(previous.config) != _comparable(self.history.config):
            raise ValueError(f"resume: the settings differ from those of the run in {self.out_dir} (only rounds "
                             "may change): resume with the same settings, or choose another output_dir")
        self.history.records = list(previous.records)
        self.history.notes = list(previous.notes)
        self.params = np.load(self.out_dir / MODEL_FILE, allow_pickle=False).astype(np.float32)
        done = previous.rounds[-1].round if previous.rounds else 0
        for rnd in range(1, done + 1):  # the availability model's state after those rounds
            self.availability.available(rnd, self.partitions.clients,
                                        seeding.stream(self.config.seed, seeding.AVAILABILITY, rnd))
        self.first_round = done + 1
        self.history.stopped = ""
        self.history.notes.append(f"resumed after round {done} (ledger: {self.ledger.rounds if self.ledger else 0} "
                                  "entries)")

    # -------------------------------------------------------------------------------- the loop
    def train(self, on_round: Callable[[RoundContext], None] | None) -> History:
        history = self.history
        if self.first_round == 1:
            initial = RoundRecord(0, epsilon=self.ledger.epsilon() if self.ledger is not None else 0.0)
            self.evaluate_into(initial)
            history.records.append(initial)
            self._report(initial)
        charger = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inca-ledger")
        blas = _driver_blas_limit()
        try:
            for rnd in range(self.first_round, self.config.rounds + 1):
                self.run_round(rnd, charger, on_round)
                if history.stopped:
                    break
        finally:
            charger.shutdown(wait=True)
            if blas is not None:
                blas.restore_original_limits()
            self._finish()
        if history.stopped and self.report:
            print(f"[flwr-inca simulate] {history.stopped}", file=sys.stderr, flush=True)
        return history

    def run_round(self, rnd: int, charger: ThreadPoolExecutor,
                  on_round: Callable[[RoundContext], None] | None) -> None:
        """One round: participants, plan (training starts), charge (in a thread), mix, apply, record."""
        start = time.perf_counter()
        record = RoundRecord(rnd)
        participants = self.participants(rnd, record)
        if participants is None:
            return self.record(record, start)
        if self.ledger is not None and self.config.privacy.max_epsilon is not None:
            planned = self.config.privacy.budget_rounds or self.config.rounds
            self.mixer.spend_what_is_left(self.ledger, planned - rnd + 1, self.plan.sample_rate, participants.size)
        t_train = time.perf_counter()
        collect = self.backend.submit(self.params, participants, self.planner.plan(rnd, participants))
        round_plan = self.plan_round(rnd, participants.size, record)
        charge = charger.submit(self.charge, rnd, round_plan) if self.session is not None else None
        updates, update, failure = self.mix(round_plan, participants, collect, record, t_train)
        outcome = self.settle(charge, record, round_plan)
        self.save_trace(record, round_plan)
        self._note_replaced_actors(rnd)
        if outcome == "refused":  # the update is discarded; what was revealed is charged
            self.mixer.abandon(round_plan)
            if self.history.stopped or rnd == self.config.rounds:  # the final model, unchanged, is evaluated
                self.evaluate_into(record)
            self.record(record, start)
        elif outcome == "stopped":  # stopped before this round: nothing of it charged; the final model
            self.mixer.abandon(round_plan)
            if self.history.records[-1].accuracy is None:
                self.evaluate_into(self.history.records[-1])
                self.save()
        elif isinstance(failure, TrainingFailure):  # a lost trainer: this round only, training goes on
            self.mixer.abandon(round_plan)
            record.failed = (f"local training was lost ({failure}); the model is unchanged, the round's cost was "
                             "charged (privacy that was planned is counted as spent)")
            self.record(record, start)
        elif failure is None:
            before = self.params
            self.apply(update, record)
            if rnd % self.config.eval_every == 0 or rnd == self.config.rounds:
                self.evaluate_into(record)
            if on_round is not None:
                on_round(RoundContext(rnd, participants, before, updates, update, round_plan))
            self.record(record, start)
        if failure is not None and not isinstance(failure, TrainingFailure):
            raise failure
        return None

    # -------------------------------------------------------------------------------- steps
    def participants(self, rnd: int, record: RoundRecord) -> np.ndarray | None:
        """The round's participants (ascending client ids), or None when too few are available (the round
        is skipped, nothing spent)."""
        config, clients = self.config, self.partitions.clients
        available = np.flatnonzero(self.availability.available(
            rnd, clients, seeding.stream(config.seed, seeding.AVAILABILITY, rnd)))
        record.available = int(available.size)
        if available.size < config.min_clients:
            record.failed = (f"skipped: {available.size} client(s) available (min_clients = {config.min_clients}); "
                             "the model is unchanged, nothing was spent")
            record.epsilon = self.history.records[-1].epsilon
            return None
        count = min(available.size, max(config.min_clients, int(config.fraction * available.size)))
        record.participants = int(count)
        return np.sort(seeding.stream(config.seed, seeding.SAMPLING, rnd).choice(available, size=count,
                                                                                replace=False))

    def plan_round(self, rnd: int, count: int, record: RoundRecord) -> RoundPlan:
        """The mixer's plan (no value), recorded; IncA's trace saved with what its certificate needs."""
        t = time.perf_counter()
        round_plan = self.mixer.plan(rnd, int(count))
        record.seconds_plan = time.perf_counter() - t
        record.mu, record.certified = float(round_plan.mu), bool(round_plan.certified)
        record.cost = str(round_plan.info.get("cost", "certified" if round_plan.certified else ""))
        record.finalists = round_plan.info.get("finalists")
        record.messages = float(round_plan.messages)
        record.noise = {k: float(v) for k, v in round_plan.info.items()
                        if k in ("sigma_star", "sigma_delta", "noise_multiplier", "noise_std")}
        return round_plan

    def charge(self, rnd: int, round_plan: RoundPlan) -> tuple[RoundCharge | None, str, float]:
        """The round's privacy through the session (in the charger thread): ``(charge, stop, seconds)``;
        ``stop`` says why training stops before the round (nothing of it charged: ``charge`` None)."""
        start = time.perf_counter()
        try:
            self.session.admit(rnd, predicted_mu=lambda: self._predicted(round_plan), known_mu=round_plan.mu,
                               hint=self._budget_hint)
        except BudgetExhausted as stop:
            return None, str(stop), time.perf_counter() - start
        charge = self.mixer.charge(self.session, round_plan)
        return charge, "", time.perf_counter() - start

    def _predicted(self, round_plan: RoundPlan) -> float:
        predicted = self.mixer.predicted_cost(round_plan.participants, self.config.privacy.budget_check_runs)
        return round_plan.mu if predicted is None else predicted

    def _budget_hint(self) -> str:
        ledger = self.ledger
        if ledger.rounds and self.history.rounds == []:
            return (f"The ledger {ledger.path} holds the privacy spent by earlier runs: for a new run, choose another "
                    "output_dir / ledger_path; to train more on the same data, raise max_epsilon.")
        if not ledger.rounds:
            return ("Not even one round at this noise fits the budget: raise max_epsilon, or add noise (sigma_star, "
                    "sigma_delta; left unset, they are calibrated for the budget).")
        return ""

    def mix(self, round_plan: RoundPlan, participants: np.ndarray, collect, record: RoundRecord,
            t_train: float) -> tuple[np.ndarray | None, np.ndarray | None, BaseException | None]:
        """The participants' updates (waiting for training) and the mixer's output: ``(updates, update,
        failure)``; a failure is kept until the charge is known."""
        dtype = np.float64 if self.config.mixing.precision == "float64" else np.float32
        t = time.perf_counter()
        try:
            updates = collect()
            record.seconds_train = time.perf_counter() - t_train
            record.seconds_train_wait = time.perf_counter() - t
            _zero_diverged(updates, participants, record.round, self.history)
            t = time.perf_counter()
            update = np.asarray(self.mixer.mix(updates.astype(dtype, copy=False), round_plan))
            record.seconds_mix = time.perf_counter() - t
            return updates, update, None
        except BaseException as exc:  # noqa: BLE001  (re-raised once the charge is recorded)
            return None, None, exc

    def settle(self, charge: Future | None, record: RoundRecord, round_plan: RoundPlan) -> str:
        """The charge's outcome (``"released"``, ``"refused"``, or ``"stopped"`` before the round), recorded."""
        if charge is None:  # no privacy (FedAvg without a budget)
            record.charged_mu, record.epsilon = math.inf, math.inf
            return "released"
        result, stop, seconds = charge.result()
        record.seconds_charge = seconds
        if result is None:
            self.history.stopped = stop
            return "stopped"
        record.charged_mu, record.epsilon = result.mu, result.epsilon
        self.charges[record.round] = result
        if result.unsettled:
            self.history.notes.append(f"round {record.round}: {result.unsettled}; its reservation stays charged")
        if result.outcome == "released":
            return "released"
        delivered = round_plan.info.get("delivered_iterations")
        record.refused = result.refused
        where = ("before its final messages" if result.delivered == result.steps and result.steps
                 else f"by the budget guard before delivering step {result.delivered + 1}")
        record.cost = (f"stopped {where}: charged what it revealed" if delivered is None
                       else f"stopped {where}: charged the certificate of iterations 1..{delivered}")
        record.failed = (f"skipped, refused by the budget: stopped {where}, charged what it revealed "
                         f"(mu = {result.mu:.4g}); the model is unchanged")
        if result.stop:
            self.history.stopped = f"round {record.round} {record.failed}. Training stops: {result.stop}"
        return "refused"

    def save_trace(self, record: RoundRecord, round_plan: RoundPlan) -> None:
        """IncA's trace of the round, with what its certificate needs (``flwr-inca audit`` reproduces the
        charge from it), to ``trace_dir`` (relative to the output directory)."""
        trace_dir = self.config.persistence.trace_dir
        if trace_dir is None or round_plan.trace is None or (self.out_dir is None and not Path(trace_dir).is_absolute()):
            return
        plan, trace = self.plan, round_plan.trace
        charge = self.charges.get(record.round)
        trace.meta["round"] = record.round
        if charge is not None and not charge.released:  # refused: what was delivered, no final asked for
            trace.meta.update({"finalists": [], "finals-collected": False, "delivered-iterations": charge.delivered})
        trace.meta["privacy"] = trace_privacy(
            self.config.privacy, record.round, certification_seed=_threat_seed(self.mixer, self.config.seed),
            value_sensitivity=plan.value_sensitivity, sample_rate=plan.sample_rate, accountant=plan.accountant,
            charge=charge)
        base = Path(trace_dir) if Path(trace_dir).is_absolute() else self.out_dir / trace_dir
        trace.save(base / f"round-{record.round:04d}.json")

    def apply(self, update: np.ndarray, record: RoundRecord) -> None:
        """Release the round: the update applied to the global model (unless it is not finite)."""
        if update.shape != self.params.shape or not np.all(np.isfinite(update)):
            record.failed = "the mixer produced no finite update (e.g. every party dropped out); model unchanged"
            return
        self.params = (self.params + update).astype(np.float32)
        record.update_norm = float(np.linalg.norm(update))

    def evaluate_into(self, record: RoundRecord) -> None:
        if self.test_set is None:
            return
        start = time.perf_counter()
        record.loss, record.accuracy = evaluate(self.model, self.spec, self.params, self.test_set[0],
                                                self.test_set[1], self.loss_fn)
        if math.isnan(record.accuracy):
            record.accuracy = None
        record.seconds_eval = time.perf_counter() - start

    def record(self, record: RoundRecord, start: float) -> None:
        """Append the round to the history, report it, and write the outputs."""
        record.seconds = time.perf_counter() - start
        self.history.records.append(record)
        self._report(record)
        self.save()

    def save(self) -> None:
        """The history (without its plot), the model and what IncA's traces need, to the output dir."""
        if self.out_dir is None:
            return
        self.history.parameters = self.params
        atomic_write_bytes(self.out_dir / MODEL_FILE, _npy(self.params))
        self.history.save(self.out_dir, plot=False)

    # -------------------------------------------------------------------------------- helpers
    def _report(self, record: RoundRecord) -> None:
        if self.report:
            self.report(record, self.history)

    def _note_replaced_actors(self, rnd: int) -> None:
        now = getattr(self.backend, "replaced", 0)
        replaced, self._actors_replaced = now - getattr(self, "_actors_replaced", 0), now
        if replaced:
            self.history.notes.append(f"round {rnd}: {replaced} Ray actor(s) died and were replaced; their clients "
                                      "trained again with the same seeds")

    def _finish(self) -> None:
        history = self.history
        try:
            history.memory = {"driver_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                              "actors_peak_mb": self.backend.peak_memory_mb()}
        except Exception:  # noqa: BLE001  (memory figures are informative only)
            pass
        self.backend.close()
        history.parameters = self.params
        hint = _chance_hint(history, self.test_set)
        if hint:
            history.notes.append(hint)
        if self.out_dir is not None:
            self.save()
            history.save(self.out_dir)


def _threat_seed(mixer: Mixer, seed: int) -> int | None:
    threat_seed = getattr(mixer, "threat_seed", None)
    return None if threat_seed is None else int(threat_seed(seed))


def _comparable(config: dict[str, Any]) -> Any:
    """A run's settings as JSON would keep them, without ``rounds`` (a resumed run may have more)."""
    import json

    from .._json import dumps

    return json.loads(dumps({k: v for k, v in config.items() if k != "rounds"}))


def _npy(array: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _check_inputs(model_fn, partitions, test_set, config) -> None:
    if not isinstance(config, SimulationConfig):
        raise ValueError(f"config must be a SimulationConfig, got {type(config).__name__}")
    if not isinstance(partitions, Partitions):
        raise ValueError("partitions must be a Partitions (see flwr_inca.simulation.iid / dirichlet / "
                         f"from_indices), got {type(partitions).__name__}")
    if not callable(model_fn):
        raise ValueError("model_fn must be a callable returning a torch nn.Module")
    if test_set is not None and (len(test_set) != 2 or len(test_set[0]) != len(test_set[1])):
        raise ValueError("test_set must be (x_test, y_test) with as many labels as rows, or None")


def _previous_run(out_dir: Path | None, resume: bool) -> History | None:
    """The run recorded in ``out_dir`` to resume (None for a fresh run); a recorded run is never
    overwritten without ``resume``. Temporary files a killed writer left are removed."""
    if out_dir is None:
        if resume:
            raise ValueError("resume needs output_dir (where the run to continue was recorded)")
        return None
    for name in ("history.json", "history.csv", MODEL_FILE):
        remove_temp_files(out_dir / name)
    recorded = (out_dir / "history.json").exists()
    if not resume:
        if recorded:
            raise ValueError(f"output_dir {out_dir} already holds a run (history.json): resume it (resume=True, "
                             "--resume), or choose another output_dir")
        return None
    if not recorded or not (out_dir / MODEL_FILE).exists():
        raise ValueError(f"resume: {out_dir} holds no run to continue (history.json and {MODEL_FILE} are needed)")
    try:
        return History.load(out_dir / "history.json")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"resume: cannot read {out_dir / 'history.json'}: {exc}") from None


def _privacy_plan(config: SimulationConfig, partitions: Partitions) -> PrivacyPlan:
    priv = config.privacy
    planned = priv.budget_rounds or config.rounds
    try:
        return privacy_plan(config.privacy_unit, epsilon=priv.max_epsilon, delta=priv.delta, rounds=planned,
                            clip_norm=priv.clip_norm, lr=config.learning_rate, batch_size=config.batch_size,
                            local_size=float(partitions.sizes().mean()), accountant=priv.accountant)
    except ValueError as exc:
        if "too low" not in str(exc):
            raise
        # Opacus's own message ("The privacy budget is too low.") names no parameter
        raise ValueError(
            f"max_epsilon = {priv.max_epsilon:g} is too small for {planned} round(s) at delta = {priv.delta:g}: no "
            f"noise multiplier Opacus can account reaches it ({exc}); raise max_epsilon, or plan fewer rounds "
            "(rounds / budget_rounds; record level: or a smaller batch_size)") from None


def _expected_participants(config: SimulationConfig, clients: int) -> int:
    availability = config.availability
    share = 1.0
    if isinstance(availability, MarkovAvailability):
        share = availability.stationary
    elif isinstance(availability, AvailabilityTable):
        share = float(availability.table.mean())
    available = max(2, int(round(share * clients)))
    return min(clients, max(config.min_clients, int(config.fraction * available)))


def _open_ledger(config: SimulationConfig, plan: PrivacyPlan, out_dir: Path | None, resumed: bool) -> PrivacyLedger:
    """The run's ledger: ``ledger_path`` relative to the output directory (memory only without one)."""
    pers = config.persistence
    path = None
    if pers.ledger_path is not None and (out_dir is not None or Path(pers.ledger_path).is_absolute()):
        path = Path(pers.ledger_path) if Path(pers.ledger_path).is_absolute() else out_dir / pers.ledger_path
    ledger = PrivacyLedger(path, delta=plan.delta, max_epsilon=config.privacy.max_epsilon,
                           accountant=plan.accountant, owner=pers.ledger_owner,
                           shared=pers.share_ledger and pers.ledger_owner is not None)
    ledger.accountant.check_sample_rate(plan.sample_rate)
    budget = config.privacy.max_epsilon
    if ledger.rounds and budget is not None and ledger.epsilon() >= budget and not resumed:
        raise ValueError(f"max_epsilon: the budget is already spent: the ledger {path} records epsilon = "
                         f"{ledger.epsilon():.4g} >= max_epsilon = {budget:g} over {ledger.rounds} round(s); choose "
                         "another output_dir / ledger_path for a new run")
    return ledger


class _StderrProgress:
    """One line per round on stderr, through the package's :class:`~flwr_inca._progress.ProgressBar`:
    rounds done / total, elapsed time and ETA, accuracy, epsilon, mu and seconds per round."""

    def __init__(self) -> None:
        self.bar: ProgressBar | None = None

    def __call__(self, record: RoundRecord, history: History) -> None:
        total = history.config["rounds"]
        if self.bar is None:  # the clock starts with the first report (the initial evaluation)
            self.bar = ProgressBar(total, "[flwr-inca simulate]", lines=True)
            self.bar.done = max(record.round - 1, 0)
        if record.round == 0:
            acc = "n/a" if record.accuracy is None else f"{record.accuracy:.4f}"
            print(f"[flwr-inca simulate] {history.mixer}; {history.backend}; initial accuracy {acc}",
                  file=sys.stderr, flush=True)
            return
        self.bar.advance(max(record.round - self.bar.done, 0), _status(record, total))


def _status(record: RoundRecord, total: int) -> str:
    if record.refused:
        return (f"round {record.round:>4}/{total}  SKIPPED (refused by the budget; eps {record.epsilon:.4f}, "
                f"charged mu {record.charged_mu:.4g} of {record.mu:.4g}): {record.failed}")
    if record.failed:
        return f"round {record.round:>4}/{total}  {record.failed}"
    acc = "   n/a" if record.accuracy is None else f"{record.accuracy:.4f}"
    eps = "inf" if not math.isfinite(record.epsilon) else f"{record.epsilon:.4f}"
    mark = "" if record.certified or not math.isfinite(record.mu) else "*"
    mu = "-" if not math.isfinite(record.mu) else f"{record.mu:.4g}{mark}"
    return (f"round {record.round:>4}/{total}  acc {acc}  eps {eps}  mu {mu}  {record.participants} clients  "
            f"{record.seconds:.2f} s/round (certify {record.seconds_plan:.2f} | train {record.seconds_train:.2f}, "
            f"ledger {record.seconds_charge:.2f}, mix {record.seconds_mix:.2f})")


def _chance_hint(history: History, test_set: tuple[np.ndarray, np.ndarray] | None) -> str:
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
        return (f"accuracy {acc:.4f} is no better than chance ({chance:.4f}: always predicting the most common test "
                f"label): at epsilon {eps:.4g} over {history.rounds_trained} trained round(s) the privacy noise "
                "drowns the updates. Less noise per round: a larger max_epsilon, fewer rounds, or more clients "
                "(record level: larger batches too)")
    except Exception:  # noqa: BLE001  (a hint never breaks a finished run)
        return ""


def _driver_blas_limit() -> Any:
    """Single-threaded BLAS in this process during the rounds (restored after the run).

    The driver's BLAS work (the certificate's factorizations) overlaps the actors' training and the
    noise drawn ahead. With OpenBLAS's default of one thread per core, its threads wait for cores the
    actors hold, and a factorization of a few hundred rows then takes up to a second instead of
    milliseconds. A fixed thread count also fixes the last bits of the certificates, which depend on it:
    a run gives the same numbers on any backend, with any number of actors, on machines with any number
    of cores."""
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
