"""``flwr-inca study mnist``: IncA next to every alternative on MNIST logistic regression.

The question: does IncA give central-DP accuracy without a trusted aggregator? Each method trains
``nn.Linear(784, 10)`` (d = 7850) on the 60,000 training images minus a validation split, split over n
clients, with record-level DP (per-example clipping, Poisson sampling, delta = 1e-5, epsilon total
over training), through the simulator (:func:`flwr_inca.simulation.simulate`); accuracy on the 10,000
test images. Methods, each with the accounting of its own threat model:

* ``fedavg``: non-private FedAvg (clipping kept), the ceiling;
* ``central-dp``: a trusted server adds the noise to the sum;
* ``inca``: IncA, improved calibration (exact certificate, analytic conversion, optimised alpha),
  certified every round against 10% colluding participants; ``inca-paper``: the paper's calibration
  (alpha = 1.3, classic bound; only where the per-round epsilon is below 1, as that bound needs);
* ``local-dp``: each client noises its update;
* ``dp-gossip``: D-SGD with DP gossip on a sparse Erdos-Renyi graph (average and worst node reported);
* ``muffliato``: with its own, weaker, Pairwise Network DP accounting (labelled as such).
* ``gopa``: GOPA (pairwise terms with k_PR = 20 random neighbours, a roll-back round; its own in-round
  dropouts, a quarter of them during the roll-back), certified every round against the same colluders.

Dropouts ``gamma``: a ``gamma`` share of each round's participants drops out during the round (IncA:
``PermanentDropout(gamma)`` inside its mixing; GOPA: its own dropouts; the others: their update never arrives), and clients are
unavailable for whole rounds with a Markov chain whose stationary unavailable share is ``gamma``
(``p_on = 0.5``).

Tuning: every method gets the same grid of (learning rate, clipping bound, rounds), run at the tuning
point (epsilon = 1, gamma = 0.1, first seed) and scored on the validation split (held out from the
training set, never the test set); the best setting is used for all of that method's cells.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._io import atomic_write_text
from .._progress import ProgressBar
from .grid import DEFAULT_GRID, StudyGrid, partition_alpha
from .report import plot, summarise, write_table
from .runs import RunResult, append_row, check_output, finish_runs, read_rows, run_key, skipped_note

if TYPE_CHECKING:  # imported where used: `flwr-inca --help` and the study's parser load no solver
    from ..privacy.calibration import NoiseCalibrator

__all__ = ["CalibrationCache", "Study", "StudyData", "accuracies", "run_one", "run_study", "split_data", "worst_node"]


# ------------------------------------------------------------------------------------------ data
@dataclass
class StudyData:
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    source: str


def split_data(dataset: Any, grid: StudyGrid, seed: int = 0) -> StudyData:
    """Hold ``grid.validation`` training examples out (a fixed permutation) for tuning."""
    rng = np.random.default_rng([seed, 1414])
    perm = rng.permutation(len(dataset.y_train))
    val, train = perm[: grid.validation], perm[grid.validation:]
    if grid.train_examples is not None:
        train = train[: grid.train_examples]
    test = slice(None) if grid.test_examples is None else slice(0, grid.test_examples)
    return StudyData(dataset.x_train[train], dataset.y_train[train], dataset.x_train[val], dataset.y_train[val],
                     dataset.x_test[test], dataset.y_test[test], getattr(dataset, "name", "mnist"))


def accuracies(params: np.ndarray, x: np.ndarray, y: np.ndarray, classes: int = 10) -> np.ndarray:
    """Accuracy of linear models (rows of ``params``: flat ``nn.Linear`` weight then bias) on (x, y)."""
    import torch

    params = np.atleast_2d(np.asarray(params, dtype=np.float32))
    features = x.shape[1]
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    yt = torch.from_numpy(np.asarray(y))
    out = np.empty(params.shape[0])
    with torch.no_grad():
        for lo in range(0, params.shape[0], 64):
            block = torch.from_numpy(params[lo: lo + 64])
            w = block[:, : classes * features].reshape(-1, classes, features)
            b = block[:, classes * features:]
            logits = torch.einsum("nf,mcf->mnc", xt, w) + b[:, None, :]
            out[lo: lo + block.shape[0]] = (logits.argmax(dim=2) == yt[None, :]).float().mean(dim=1).numpy()
    return out


def worst_node(models: np.ndarray, x: np.ndarray, y: np.ndarray, screen: int = 2000, keep: int = 20) -> float:
    """Lowest test accuracy among the parties' models: all screened on the first ``screen`` test
    examples, the ``keep`` lowest measured again on all of them (a full pass over 1000 models costs
    70 GFLOP)."""
    if models.shape[0] <= keep or len(y) <= screen:
        return float(accuracies(models, x, y).min())
    rough = accuracies(models, x[:screen], y[:screen])
    lowest = np.argsort(rough, kind="stable")[:keep]
    return float(accuracies(models[lowest], x, y).min())


# ------------------------------------------------------------------------------------------ IncA noise
class CalibrationCache:
    """IncA's noise calibrations, shared by the study's runs: one
    :class:`~flwr_inca.privacy.calibration.NoiseCalibrator` per (procedure, gamma, runs, success share), so
    that every run with the same protocol reuses the calibrations of the others (the calibrator's rule:
    one calibration per party count, scaled to every target and sensitivity)."""

    def __init__(self, grid: StudyGrid) -> None:
        self.grid = grid
        self.calibrators: dict[tuple, NoiseCalibrator] = {}

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.calibrators.values())

    def calibrator(self, procedure: str, gamma: float, clients: int, iterations: int) -> NoiseCalibrator:
        """The calibrator of ``procedure`` at dropout rate ``gamma`` and ``iterations`` T for a study of
        ``clients`` clients (whose size picks the runs and success share, :meth:`StudyGrid.inca_settings`)."""
        from ..privacy.calibration import NoiseCalibrator
        from ..protocol.dropout import PermanentDropout

        runs, success, _ = self.grid.inca_settings(clients)
        key = (procedure, gamma, runs, success, iterations)
        if key not in self.calibrators:
            self.calibrators[key] = NoiseCalibrator(
                iterations=iterations, neighbors=self.grid.neighbors, collusion=self.grid.collusion,
                dropout=PermanentDropout(gamma) if gamma > 0 else None, schedule=self.grid.schedule, runs=runs,
                procedure=procedure, target_success=success, seed=1414 + round(gamma * 1000))
        return self.calibrators[key]



# ------------------------------------------------------------------------------------------ one run
def run_one(data: StudyData, grid: StudyGrid, method: str, clients: int, partition: str, epsilon: float,
            gamma: float, seed: int, lr: float, clip: float, rounds: int, phase: str,
            cache: CalibrationCache) -> RunResult:
    """Train one method once; evaluate on validation (``phase="tune"``) or test."""
    import torch

    from ..simulation import simulate  # looked up at each run (tests replace it)

    res = RunResult(phase, method, clients, partition, epsilon, gamma, seed, lr, clip, rounds)
    start = time.perf_counter()
    parts = _client_data(data, clients, partition, seed)
    config = _config(grid, method, clients, epsilon, gamma, seed, lr, clip, rounds)
    mixer = _mixer(config, method, gamma, clients, phase, cache)
    nodes = _NodeModels(clients) if method in ("dp-gossip", "muffliato") else None
    try:
        history = simulate(lambda: torch.nn.Linear(784, 10), parts, None, config, mixer=mixer, progress=False,
                           on_round=None if nodes is None else nodes.on_round)
    except ValueError as exc:  # e.g. the paper's classic bound needs a per-round epsilon < 1
        res.note = f"not run: {exc}"
    else:
        _score(res, history, data, nodes)
    res.seconds = time.perf_counter() - start
    return res


def _client_data(data: StudyData, clients: int, partition: str, seed: int) -> list:
    """The training split over ``clients`` clients: IID, or Dirichlet over the labels."""
    from ..simulation import dirichlet, iid

    alpha = partition_alpha(partition)
    if alpha is None:
        return iid(data.x_train, data.y_train, clients, seed=seed)
    return dirichlet(data.x_train, data.y_train, clients, alpha=alpha, seed=seed)


def _config(grid: StudyGrid, method: str, clients: int, epsilon: float, gamma: float, seed: int, lr: float,
            clip: float, rounds: int) -> Any:
    """The simulator's configuration of one run (record-level DP; unavailable clients: a Markov chain whose
    stationary unavailable share is ``gamma``; IncA: ``PermanentDropout(gamma)`` within its rounds)."""
    from ..protocol.dropout import PermanentDropout
    from ..simulation import MarkovAvailability, SimulationConfig

    mode = "inca" if method.startswith("inca") else method
    calibration_runs, calibration_success, certify_every = grid.inca_settings(clients)
    return SimulationConfig(
        rounds=rounds, mode=mode, max_epsilon=None if method == "fedavg" else epsilon, delta=grid.delta,
        privacy_unit="record", lr=lr, clip_norm=clip, batch_size=grid.batch_size,
        availability=MarkovAvailability(p_off=0.5 * gamma / (1 - gamma), p_on=0.5) if gamma > 0 else None,
        dropout=PermanentDropout(gamma) if (mode == "inca" and gamma > 0) else None,
        iterations=grid.iterations, max_iterations=grid.max_iterations, schedule=grid.schedule,
        neighbors=grid.neighbors, collusion=grid.collusion,
        certify_every=certify_every, calibration_runs=calibration_runs, calibration_success=calibration_success,
        backend="inline", seed=seed, eval_every=rounds + 1)


def _mixer(config: Any, method: str, gamma: float, clients: int, phase: str, cache: CalibrationCache) -> Any:
    """The run's mixer: IncA with the study's shared calibrator, GOPA with its own in-round dropouts, the
    others behind a ``gamma`` share of in-round dropouts."""
    from ..simulation.baseline_mixers import WithinRoundDropout
    from ..simulation.mixers import IncaMixer, create_mixer

    if config.mode == "inca":
        procedure = "paper" if method == "inca-paper" else "exact"
        return IncaMixer(privacy=config.privacy, mixing=config.mixing,
                         calibrators=functools.partial(cache.calibrator, procedure, gamma, clients))
    if method == "gopa":  # its own in-round dropouts; calibrated on IncA's runs and success share
        success = config.privacy.calibration_success
        return create_mixer(config.replace(mixer_options={"gamma": gamma, "calibration_success": success}))
    mixer = create_mixer(config)
    if method == "muffliato" and phase == "tune":  # the average model only: no per-party gossip needed
        mixer = type(mixer)(node_estimates=False)
    return WithinRoundDropout(mixer, gamma) if gamma > 0 else mixer


class _NodeModels:
    """Every party's own model in the gossip methods, as its deviation from the released average (the
    simulator keeps one model); the parties of the last round are the ones reported."""

    def __init__(self, clients: int) -> None:
        self.deviation = np.zeros((clients, 7850), dtype=np.float32)
        self.last: np.ndarray | None = None  # the parties of the last round

    def on_round(self, ctx: Any) -> None:
        nodes = ctx.plan.info.pop("node_updates", None)
        if nodes is None:
            return
        rows = ctx.plan.info.get("rows", np.arange(len(ctx.participants)))
        ids = ctx.participants[rows]
        keep = self.deviation[ids] + (nodes - ctx.update[None, :])
        self.deviation[:] = 0.0  # the others rejoin with the current model (the simulator's rule)
        self.deviation[ids] = keep
        self.last = ids

    def worst(self, params: np.ndarray, data: StudyData) -> float | None:
        """The lowest test accuracy among the last round's parties' models (None before any round)."""
        if self.last is None:
            return None
        return worst_node(params[None, :] + self.deviation[self.last], data.x_test, data.y_test)


def _score(res: RunResult, history: Any, data: StudyData, nodes: _NodeModels | None) -> None:
    """Fill ``res`` from a finished training: accuracies, privacy spent, rounds, and a note on refused rounds
    and early stops."""
    evaluation = (data.x_val, data.y_val) if res.phase == "tune" else (data.x_test, data.y_test)
    params = np.asarray(history.parameters, dtype=np.float32)
    res.accuracy = float(accuracies(params, *evaluation)[0])
    res.test_accuracy = float(accuracies(params, data.x_test, data.y_test)[0])
    res.rounds_done, res.rounds_refused = history.rounds_trained, history.rounds_refused
    sent = [r.messages for r in history.rounds if not r.failed]
    res.messages = float(np.mean(sent)) if sent else None
    res.epsilon_spent = None if res.method == "fedavg" else float(history.records[-1].epsilon)
    notes = []
    if res.rounds_refused:  # outlier executions: skipped, charged what they revealed, training went on
        refused = [r.round for r in history.rounds if r.refused]
        notes.append(f"{len(refused)} round(s) refused by the budget and skipped (round(s) "
                     f"{', '.join(map(str, refused[:10]))}{' ...' if len(refused) > 10 else ''})")
    if history.stopped:
        notes.append(history.stopped.split(". ")[0])  # first sentence (decimals kept)
    res.note = "; ".join(notes)
    if nodes is not None:
        res.worst_node = nodes.worst(params, data)


# ------------------------------------------------------------------------------------------ the study
Cell = tuple[int, str, str, float, float, int]  # (clients, partition, method, epsilon, gamma, seed)


class _LogLines:
    """A text stream handing each line written to it to ``log``: the progress bar's lines go where the
    study's other lines go."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log

    def write(self, text: str) -> int:
        for line in text.splitlines():
            self.log(line)
        return len(text)

    def flush(self) -> None:
        pass


class Study:
    """One run of the study: its plan, the runs it recorded and its progress, in the steps of
    :func:`run_study` (:meth:`plan`, :meth:`tune`, :meth:`evaluate`, :meth:`finish`).

    Runs go to ``runs.csv.partial`` as they finish; ``runs.csv`` is replaced only at the end (by this study's
    rows plus every earlier row it did not reach), so an interruption loses nothing; with ``resume`` a run
    recorded in either file is reused instead of run again.
    """

    LABEL = "[flwr-inca study mnist]"

    def __init__(self, dataset: Any, grid: StudyGrid, out_dir: str | Path, resume: bool,
                 log: Callable[[str], None]) -> None:
        self.grid, self.log = grid, log
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        check_output(self.out, resume)
        self.runs_path, self.partial = self.out / "runs.csv", self.out / "runs.csv.partial"
        self.old_rows = read_rows(self.runs_path, log) + read_rows(self.partial, log)
        self.done = {run_key(r): r for r in self.old_rows}  # runs recorded earlier: reused
        self.data = split_data(dataset, grid)
        self.cache = CalibrationCache(grid)
        self.rows: list[dict] = []  # this study's rows, in the order they were recorded
        self.tuning_runs: dict[tuple, dict] = {}
        self.tuned: dict[tuple, tuple[float, float, int]] = {}  # (n, partition, method) -> (lr, clip, rounds)
        self.count = 0  # runs reported so far
        self.cells: list[Cell] = []
        self.bar = ProgressBar(1, self.LABEL, stream=_LogLines(log), lines=True)

    def plan(self) -> None:
        """The evaluation cells (one per (n, partition, method, point, seed); fedavg has no epsilon: one per
        gamma, reported at every epsilon) and the work's size for the ETA: ``clients x rounds`` per run,
        the evaluation's rounds guessed as the tuning grid's mean until they are tuned."""
        grid, points = self.grid, self.grid.points()
        cells = [(n, p, m, e, g, s) for n in grid.clients for p in grid.partitions for m in grid.methods
                 for (e, g) in points for s in grid.seeds]
        cells = [c for c in cells if c[2] != "fedavg" or c[3] == points[0][0] or
                 (c[3], c[4]) == (grid.epsilon_at_gamma, c[4])]
        seen = set()
        for c in cells:
            k = (c[0], c[1], c[2], c[4], c[5]) if c[2] == "fedavg" else c
            if k not in seen:
                seen.add(k)
                self.cells.append(c)
        settings = grid.tuning_settings()
        mean_rounds = float(np.mean([s[2] for s in settings]))
        tuning = sum(n * r for n in grid.clients for _ in grid.partitions for _ in grid.methods for _, _, r in settings)
        self.bar.set_total(round(tuning + sum(c[0] for c in self.cells) * mean_rounds))
        self.log(f"{self.LABEL} {grid.describe()}")
        self.log(f"{self.LABEL} {self.tuning_count} tuning runs (validation split of {grid.validation}) + "
                 f"{len(self.cells)} evaluation runs; data: {self.data.source}, {len(self.data.y_train)} training "
                 f"examples, {len(self.data.y_test)} test")

    @property
    def tuning_count(self) -> int:
        grid = self.grid
        return len(grid.clients) * len(grid.partitions) * len(grid.methods) * len(grid.tuning_settings())

    def tune(self) -> None:
        """Every method's tuning grid at the tuning point, scored on the validation split; the best setting
        of each (n, partition, method) is kept for its evaluation."""
        grid = self.grid
        for n in grid.clients:
            for part in grid.partitions:
                for method in grid.methods:
                    scores = []
                    for lr, clip, rnds in grid.tuning_settings():
                        d = self.run("tune", method, n, part, grid.tune_epsilon, grid.tune_gamma, grid.seeds[0],
                                     lr, clip, rnds)
                        scores.append((-1.0 if d["accuracy"] is None else float(d["accuracy"]), lr, clip, rnds))
                    best = max(scores, key=lambda s: s[0])
                    self.tuned[(n, part, method)] = best[1:]

    def evaluate(self) -> None:
        """Every evaluation cell with its method's tuned setting, scored on the test set."""
        # the evaluation's work is known once the rounds are tuned: the ETA counts it from here
        self.bar.set_total(self.bar.done + sum(c[0] * self.tuned[c[:3]][2] for c in self.cells))
        for n, part, method, eps, gamma, seed in self.cells:
            lr, clip, rnds = self.tuned[(n, part, method)]
            self.run("test", method, n, part, eps, gamma, seed, lr, clip, rnds)

    def run(self, phase: str, method: str, n: int, part: str, eps: float, gamma: float, seed: int, lr: float,
            clip: float, rnds: int) -> dict:
        """One run: the one recorded earlier, the selected tuning run when it is this evaluation cell, or
        trained now (:func:`run_one`); recorded and reported."""
        key = (phase, method, n, part, float(eps), float(gamma), seed, float(lr), float(clip), int(rnds))
        twin = self.tuning_runs.get(("tune",) + key[1:]) if phase == "test" else None
        reuse = twin is not None and method != "muffliato"  # its tuning skipped the gossip
        units = n * rnds
        if key in self.done or reuse:
            self.bar.set_total(self.bar.total - units)  # nothing to run
            units = 0
        if key in self.done:
            d = self.record(self.done[key])
        elif reuse:  # the selected tuning run is this cell: its model's test score
            d = self.record({**twin, "phase": "test", "accuracy": twin["test_accuracy"],
                             "note": (twin["note"] + "; " if twin["note"] else "") + "the selected tuning run"})
        else:
            d = self.record(run_one(self.data, self.grid, method, n, part, eps, gamma, seed, lr, clip, rnds, phase,
                                    self.cache))
        if phase == "tune":
            self.tuning_runs[key] = d
        self.report(d, units)
        return d

    def record(self, run: RunResult | dict) -> dict:
        """Append ``run`` to ``runs.csv.partial`` and to this study's rows."""
        d = asdict(run) if isinstance(run, RunResult) else run
        append_row(self.partial, d)
        self.rows.append(d)
        return d

    def report(self, d: dict, units: int) -> None:
        """One progress line for the run ``d``, which did ``units`` of the work."""
        self.count += 1
        acc = "n/a" if d["accuracy"] is None else f"{float(d['accuracy']):.4f}"
        worst = "" if d["worst_node"] in (None, "") else f" (worst node {float(d['worst_node']):.4f})"
        skipped = "" if "refused by the budget" in (d["note"] or "") else skipped_note(d)  # said once, not twice
        note = f"  [{d['note']}]" if d["note"] else ""
        self.bar.advance(units, f"[{self.count:>3}/{self.tuning_count + len(self.cells)}] {d['phase']:<4} "
                                f"{d['method']:<10} n={d['clients']} {d['partition']} eps={float(d['epsilon']):g} "
                                f"gamma={float(d['gamma']):g} seed={d['seed']} lr={float(d['lr']):g} "
                                f"C={float(d['clip']):g} R={d['rounds']}: acc {acc}{worst}{skipped}  "
                                f"{float(d['seconds']):.1f} s{note}  |")

    def finish(self) -> dict[str, Any]:
        """Replace ``runs.csv``; write ``results.json``, the tables and the plots; return the summary."""
        finish_runs(self.runs_path, self.partial, self.rows, self.old_rows)
        summary = summarise(self.rows, self.grid, self.grid.points())
        summary.update(
            grid=asdict(self.grid), tuned={f"{m} n={n} {p}": {"lr": v[0], "clip": v[1], "rounds": v[2]}
                                           for (n, p, m), v in self.tuned.items()},
            seconds=self.bar.elapsed, calibration_seconds=self.cache.seconds, data=self.data.source)
        atomic_write_text(self.out / "results.json", json.dumps(summary, indent=1, default=float))
        write_table(summary, self.out)
        plot(summary, self.grid, self.out)
        self.log(f"{self.LABEL} done in {summary['seconds'] / 60:.1f} min; {self.out / 'table.md'}, "
                 f"{self.out / 'accuracy_vs_epsilon.png'}, {self.out / 'accuracy_vs_gamma.png'}")
        return summary


def run_study(dataset: Any, grid: StudyGrid = DEFAULT_GRID, out_dir: str | Path = "study-mnist", *,
              resume: bool = False, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Tune, run and summarise; writes ``runs.csv``, ``results.json``, ``table.csv``, ``table.md`` and the
    two plots into ``out_dir``. Returns the summary (also in ``results.json``)."""
    study = Study(dataset, grid, out_dir, resume, log or (lambda s: print(s, file=sys.stderr, flush=True)))
    study.plan()
    study.tune()
    study.evaluate()
    return study.finish()
