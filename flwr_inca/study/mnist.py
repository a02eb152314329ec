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

import csv
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .._checks import (
    MAX_SCALE,
    check_batch_size,
    check_bool,
    check_delta,
    check_epsilon,
    check_int,
    check_iterations,
    check_parties,
    check_real,
    check_rounds,
    check_runs,
    check_scale,
)

from ..privacy.calibration import NoiseCalibrator

__all__ = ["DEFAULT_GRID", "FULL_GRID", "METHODS", "TINY_GRID", "StudyGrid", "add_study_parser", "run_study"]

METHODS: dict[str, str] = {
    "fedavg": "FedAvg, no privacy (clipped)",
    "central-dp": "central DP (trusted server)",
    "inca": "IncA (improved calibration)",
    "inca-paper": "IncA (paper's calibration)",
    "local-dp": "local DP",
    "dp-gossip": "DP gossip / D-SGD",
    "muffliato": "Muffliato (PNDP accounting: weaker)",
    # GOPA: its own in-round dropouts (gamma/4 of them during the roll-back), certified like IncA
    "gopa": "GOPA (k_PR = 20, roll-back)",
}
TRUSTED = ("fedavg", "central-dp")


@dataclass(frozen=True)
class StudyGrid:
    """What the study runs.

    ``epsilons`` are swept at ``gamma_at_epsilon`` and ``gammas`` at ``epsilon_at_gamma``, unless
    ``product`` (every epsilon at every gamma). Tuning runs every (lr, clip, rounds) of the three
    lists at (``tune_epsilon``, ``tune_gamma``, first seed) for every method.
    """

    clients: tuple[int, ...] = (1000,)
    partitions: tuple[str, ...] = ("iid",)
    epsilons: tuple[float, ...] = (0.5, 1.0, 2.0, 8.0)
    gammas: tuple[float, ...] = (0.0, 0.1, 0.3)
    seeds: tuple[int, ...] = (0,)
    methods: tuple[str, ...] = tuple(METHODS)
    product: bool = False
    gamma_at_epsilon: float = 0.1
    epsilon_at_gamma: float = 1.0
    tune_lr: tuple[float, ...] = (1.5, 4.0)
    tune_clip: tuple[float, ...] = (1.0,)
    tune_rounds: tuple[int, ...] = (10, 25)
    tune_epsilon: float = 1.0
    tune_gamma: float = 0.1
    delta: float = 1e-5
    batch_size: int = 10
    validation: int = 6000
    collusion: float = 0.1
    iterations: int = 10
    neighbors: int = 1
    # IncA's calibration and charging, at every n (docs/results.md, "IncA at n = 1000"). A fresh execution's
    # certificate spreads around the target its noise was calibrated for: calibrated on 3 executions at a
    # success share of 1, fresh rounds at n = 1000 certified up to 1.33x the target at gamma = 0.1 (28% of
    # them above it) and 1.45x at gamma = 0.3. Charging the rounds between certificates (every 10th) the
    # largest certified mu so far then ended training early (after 20 of 25 rounds at gamma = 0.3 in the
    # default grid; 12 of 25 in one of four sequences at gamma = 0.1, benchmarks/study_round_cost.py). So
    # every round is certified and charged its own certificate (~0.3 s at 900 participants), and the noise is
    # calibrated on 60 executions at a 0.9 success share: fresh rounds then certify at 0.87x the target on
    # average, and all 25 rounds fit at every epsilon (0.5-8) and gamma (0-0.3) measured. The price at
    # gamma > 0: sigma_delta 5-11% larger than with 3 executions, 10-18% of the budget left unspent at
    # epsilon = 1, and ~50-100 s per calibration at n = 1000.
    certify_every: int = 1
    calibration_runs: int = 60
    calibration_success: float = 0.9  # share of the calibration runs the noise must certify
    # at n <= small_clients the per-round target is steeper still (docs/results.md, n = 100): a small
    # q = B / N_local puts mu_round near 1, where a few percent more mu per round costs tens of percent of
    # epsilon; there the same rule is required (the small_* fields), whatever the fields above say.
    small_clients: int = 300
    small_calibration_runs: int = 60
    small_calibration_success: float = 0.9
    small_certify_every: int = 1
    train_examples: int | None = None  # None: all (60,000 - validation); tests use fewer
    test_examples: int | None = None

    def __post_init__(self) -> None:
        for name in ("clients", "partitions", "epsilons", "gammas", "seeds", "methods", "tune_lr", "tune_clip",
                     "tune_rounds"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"methods: unknown {unknown}; choose from {list(METHODS)}")
        for n in self.clients:
            check_parties("clients (each)", n, 3)
        for p in self.partitions:
            _partition_alpha(p)
        for e in self.epsilons + (self.tune_epsilon, self.epsilon_at_gamma):
            check_epsilon("epsilons, tune_epsilon and epsilon_at_gamma (each)", e)
        for g in self.gammas + (self.tune_gamma, self.gamma_at_epsilon):
            check_real("gammas, tune_gamma and gamma_at_epsilon (each)", g, 0.0, 1.0, high_open=True)
        for seed in self.seeds:
            check_int("seeds (each)", seed, 0)
        for r in self.tune_rounds:
            check_rounds("tune_rounds (each)", r)
        for x in self.tune_lr + self.tune_clip:
            check_scale("tune_lr and tune_clip (each)", x, zero=False)
        check_delta("delta", self.delta)
        check_batch_size("batch_size", self.batch_size)
        check_real("collusion", self.collusion, 0.0, 1.0, high_open=True)
        check_iterations("iterations", self.iterations)
        check_int("neighbors", self.neighbors, 1, min(self.clients) - 1)
        check_parties("small_clients", self.small_clients, 0)
        check_bool("product", self.product)
        for name in ("calibration_success", "small_calibration_success"):
            check_real(f"{name} (a share of the calibration runs)", getattr(self, name), 0.0, 1.0, low_open=True)
        for name in ("calibration_runs", "small_calibration_runs"):
            check_runs(name, getattr(self, name))
        for name in ("certify_every", "small_certify_every"):
            check_rounds(name, getattr(self, name))
        check_int("validation (examples held out of training)", self.validation, 1, 59999)
        for name in ("train_examples", "test_examples"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)

    def inca_settings(self, clients: int) -> tuple[int, float, int]:
        """IncA's ``(calibration runs, calibration success share, certify every)`` at ``clients``."""
        if clients <= self.small_clients:
            return self.small_calibration_runs, self.small_calibration_success, self.small_certify_every
        return self.calibration_runs, self.calibration_success, self.certify_every

    def tuning_settings(self) -> list[tuple[float, float, int]]:
        return [(lr, c, r) for lr in self.tune_lr for c in self.tune_clip for r in self.tune_rounds]

    def points(self) -> list[tuple[float, float]]:
        """(epsilon, gamma) evaluation points."""
        if self.product:
            pts = [(e, g) for e in self.epsilons for g in self.gammas]
        else:
            pts = [(e, self.gamma_at_epsilon) for e in self.epsilons]
            pts += [(self.epsilon_at_gamma, g) for g in self.gammas if (self.epsilon_at_gamma, g) not in pts]
        return pts

    def describe(self) -> str:
        return (f"n in {list(self.clients)}, partitions {list(self.partitions)}, epsilon in {list(self.epsilons)}"
                f" (at gamma = {self.gamma_at_epsilon}), gamma in {list(self.gammas)} (at epsilon = "
                f"{self.epsilon_at_gamma})" if not self.product else
                f"n in {list(self.clients)}, partitions {list(self.partitions)}, epsilon in "
                f"{list(self.epsilons)} x gamma in {list(self.gammas)}") + (
                f", seeds {list(self.seeds)}; tuning grid lr {list(self.tune_lr)} x clip {list(self.tune_clip)} x "
                f"rounds {list(self.tune_rounds)} at epsilon = {self.tune_epsilon}, gamma = {self.tune_gamma}; "
                f"batch {self.batch_size}, IncA T = {self.iterations}, k = {self.neighbors}, "
                f"{self.collusion:.0%} colluders, calibrated on {self.calibration_runs} execution(s) "
                f"(success share {self.calibration_success:g}) and certified every {self.certify_every} round(s); "
                f"at n <= {self.small_clients}: {self.small_calibration_runs} execution(s), success share "
                f"{self.small_calibration_success:g}, certified every {self.small_certify_every} round(s)")


def _partition_alpha(name: str) -> float | None:
    if name == "iid":
        return None
    if name.startswith("dirichlet:"):
        try:
            alpha = float(name.split(":", 1)[1])
        except ValueError:
            alpha = -1.0
        if 0 < alpha <= MAX_SCALE:
            return alpha
    raise ValueError(f"partition must be 'iid' or 'dirichlet:<alpha>' with alpha in (0, {MAX_SCALE:g}], got {name!r}")


DEFAULT_GRID = StudyGrid()
FULL_GRID = StudyGrid(clients=(100, 1000), partitions=("iid", "dirichlet:0.5"), seeds=(0, 1, 2), product=True,
                      epsilons=(0.5, 1.0, 2.0, 4.0, 8.0),
                      tune_lr=(1.0, 3.0, 8.0), tune_clip=(0.5, 1.0, 2.0), tune_rounds=(10, 25, 50))
TINY_GRID = StudyGrid(clients=(8,), epsilons=(1.0, 4.0), gammas=(0.0, 0.25), tune_lr=(2.0,), tune_clip=(1.0,),
                      tune_rounds=(2,), tune_gamma=0.25, gamma_at_epsilon=0.25, validation=300, batch_size=10,
                      iterations=3, calibration_runs=1, calibration_success=1.0, train_examples=800, test_examples=300,
                      small_calibration_runs=4, small_calibration_success=0.75)


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
class _CalibrationCache:
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

    def calibrator(self, procedure: str, gamma: float, clients: int) -> NoiseCalibrator:
        """The calibrator of ``procedure`` at dropout rate ``gamma`` for a study of ``clients`` clients (whose
        size picks the runs and success share, :meth:`StudyGrid.inca_settings`)."""
        from ..protocol.dropout import PermanentDropout

        runs, success, _ = self.grid.inca_settings(clients)
        key = (procedure, gamma, runs, success)
        if key not in self.calibrators:
            self.calibrators[key] = NoiseCalibrator(
                iterations=self.grid.iterations, neighbors=self.grid.neighbors, collusion=self.grid.collusion,
                dropout=PermanentDropout(gamma) if gamma > 0 else None, runs=runs, procedure=procedure,
                target_success=success, seed=1414 + round(gamma * 1000))
        return self.calibrators[key]


# ------------------------------------------------------------------------------------------ one run
@dataclass
class RunResult:
    phase: str
    method: str
    clients: int
    partition: str
    epsilon: float
    gamma: float
    seed: int
    lr: float
    clip: float
    rounds: int
    accuracy: float | None = None  # on the validation split (tuning) or the test set
    test_accuracy: float | None = None  # tuning runs: the same model on the test set (reused, not selected on)
    worst_node: float | None = None
    epsilon_spent: float | None = None
    rounds_done: int = 0  # rounds trained (the model updated)
    rounds_refused: int = 0  # rounds the budget refused and skipped (charged what they revealed; model kept)
    seconds: float = 0.0
    note: str = ""


def run_one(data: StudyData, grid: StudyGrid, method: str, clients: int, partition: str, epsilon: float,
            gamma: float, seed: int, lr: float, clip: float, rounds: int, phase: str,
            cache: _CalibrationCache) -> RunResult:
    """Train one method once; evaluate on validation (``phase="tune"``) or test."""
    import torch

    from ..protocol.dropout import PermanentDropout
    from ..simulation import MarkovAvailability, SimulationConfig, dirichlet, iid, simulate
    from ..simulation.baseline_mixers import WithinRoundDropout
    from ..simulation.mixers import IncaMixer, create_mixer

    res = RunResult(phase, method, clients, partition, epsilon, gamma, seed, lr, clip, rounds)
    start = time.perf_counter()
    alpha = _partition_alpha(partition)
    parts = (iid(data.x_train, data.y_train, clients, seed=seed) if alpha is None
             else dirichlet(data.x_train, data.y_train, clients, alpha=alpha, seed=seed))
    evaluation = (data.x_val, data.y_val) if phase == "tune" else (data.x_test, data.y_test)
    mode = "inca" if method.startswith("inca") else method
    calibration_runs, calibration_success, certify_every = grid.inca_settings(clients)
    config = SimulationConfig(
        rounds=rounds, mode=mode, max_epsilon=None if method == "fedavg" else epsilon, delta=grid.delta,
        privacy_unit="record", lr=lr, clip_norm=clip, batch_size=grid.batch_size,
        availability=MarkovAvailability(p_off=0.5 * gamma / (1 - gamma), p_on=0.5) if gamma > 0 else None,
        dropout=PermanentDropout(gamma) if (mode == "inca" and gamma > 0) else None,
        iterations=grid.iterations, neighbors=grid.neighbors, collusion=grid.collusion,
        certify_every=certify_every, calibration_runs=calibration_runs, calibration_success=calibration_success,
        backend="inline", seed=seed, eval_every=rounds + 1)
    if mode == "inca":
        procedure = "paper" if method == "inca-paper" else "exact"
        mixer = IncaMixer(privacy=config.privacy, mixing=config.mixing,
                          calibrator=cache.calibrator(procedure, gamma, clients))
    elif method == "gopa":  # its own in-round dropouts; calibrated on IncA's runs and success share
        mixer = create_mixer(config.replace(mixer_options={"gamma": gamma,
                                                            "calibration_success": calibration_success}))
    else:
        mixer = create_mixer(config)
        if method == "muffliato" and phase == "tune":  # the average model only: no per-party gossip needed
            mixer = type(mixer)(node_estimates=False)
        if gamma > 0:
            mixer = WithinRoundDropout(mixer, gamma)

    deviation = np.zeros((clients, 7850), dtype=np.float32) if method in ("dp-gossip", "muffliato") else None
    last_nodes: list[np.ndarray] = []

    def on_round(ctx) -> None:
        nodes = ctx.plan.info.pop("node_updates", None)
        if deviation is None or nodes is None:
            return
        rows = ctx.plan.info.get("rows", np.arange(len(ctx.participants)))
        ids = ctx.participants[rows]
        keep = deviation[ids] + (nodes - ctx.update[None, :])
        deviation[:] = 0.0  # the others rejoin with the current model (the simulator's rule)
        deviation[ids] = keep
        last_nodes[:] = [ids]

    try:
        history = simulate(lambda: torch.nn.Linear(784, 10), parts, None, config, mixer=mixer, progress=False,
                           on_round=on_round if deviation is not None else None)
    except ValueError as exc:  # e.g. the paper's classic bound needs a per-round epsilon < 1
        res.note = f"not run: {exc}"
        res.seconds = time.perf_counter() - start
        return res
    params = np.asarray(history.parameters, dtype=np.float32)
    res.accuracy = float(accuracies(params, *evaluation)[0])
    res.test_accuracy = float(accuracies(params, data.x_test, data.y_test)[0])
    res.rounds_done, res.rounds_refused = history.rounds_trained, history.rounds_refused
    res.epsilon_spent = None if method == "fedavg" else float(history.records[-1].epsilon)
    notes = []
    if res.rounds_refused:  # outlier executions: skipped, charged what they revealed, training went on
        refused = [r.round for r in history.rounds if r.refused]
        notes.append(f"{len(refused)} round(s) refused by the budget and skipped (round(s) "
                     f"{', '.join(map(str, refused[:10]))}{' ...' if len(refused) > 10 else ''})")
    if history.stopped:
        notes.append(history.stopped.split(". ")[0])  # first sentence (decimals kept)
    res.note = "; ".join(notes)
    if deviation is not None and last_nodes:
        res.worst_node = worst_node(params[None, :] + deviation[last_nodes[0]], data.x_test, data.y_test)
    res.seconds = time.perf_counter() - start
    return res


# ------------------------------------------------------------------------------------------ the study
FIELDS = [f for f in RunResult.__dataclass_fields__]


def _key(r: dict | RunResult) -> tuple:
    d = asdict(r) if isinstance(r, RunResult) else r
    return (d["phase"], d["method"], int(d["clients"]), d["partition"], float(d["epsilon"]), float(d["gamma"]),
            int(d["seed"]), float(d["lr"]), float(d["clip"]), int(d["rounds"]))


class StudyOutputExists(ValueError):
    """The output folder holds an earlier study's runs and ``resume`` was not asked for."""


def check_output(out_dir: str | Path, resume: bool) -> None:
    """Raise :class:`StudyOutputExists` if ``out_dir`` holds an earlier study's runs and ``resume`` is
    False (a study never deletes runs it did not make)."""
    for p in (Path(out_dir) / "runs.csv", Path(out_dir) / "runs.csv.partial"):
        if p.exists() and not resume:
            raise StudyOutputExists(
                f"{p} holds runs of an earlier study: pass --resume to reuse them (nothing is deleted), "
                "or choose another --out")


def _finish_runs(runs_path: Path, partial: Path, rows: list[dict], old_rows: list[dict]) -> None:
    """Atomically replace ``runs.csv`` by this study's rows followed by every earlier row it did not
    reach (another grid's runs in the same folder are kept), then drop the partial file."""
    keys = {_key(r) for r in rows}
    kept, seen = [], set()
    for r in old_rows:
        k = _key(r)
        if k not in keys and k not in seen:
            seen.add(k)
            kept.append(r)
    tmp = runs_path.with_name(runs_path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows + kept)
    os.replace(tmp, runs_path)
    partial.unlink(missing_ok=True)


def _upgrade_header(path: Path) -> None:
    """Rewrite ``path`` (runs of an interrupted study) with this version's columns if it was written with
    others (an earlier version, e.g. before ``rounds_refused``), so that rows appended now line up; a
    column it lacks is left empty."""
    if not path.exists():
        return
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or reader.fieldnames == FIELDS:
            return
        _check_columns(path, reader.fieldnames)
        rows = list(reader)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def _check_columns(path: Path, fieldnames: list[str]) -> None:
    unknown = sorted(set(fieldnames) - set(FIELDS))
    if unknown:
        raise ValueError(f"{path}: its columns {unknown} are not this version's {FIELDS}; move it away "
                         "or resume it with the version that wrote it")


def _read_rows(path: Path, log: Callable[[str], None] | None = None) -> list[dict]:
    """The runs recorded in ``path`` (none if it does not exist).

    A last row cut short -- what a study killed while appending it leaves: fewer fields, a value that does
    not parse, or no line end -- is skipped with a warning (``log``) naming the file and line, and removed
    from the file, so that its run is done again and the rows appended next start on a line of their own.
    A malformed row anywhere else raises ``ValueError`` naming the file and line (not what an interrupted
    append leaves: the file was edited or damaged)."""
    if not path.exists():
        return []
    try:
        with path.open(newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            records = [(reader.line_num, values) for values in reader if values]
    except (csv.Error, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a CSV file of runs ({exc})") from None
    if header is None:
        return []
    with path.open("rb") as f:  # csv.writer ends every row with a line end: a file without one was cut
        f.seek(max(f.seek(0, os.SEEK_END) - 1, 0))
        terminated = f.read(1) == b"\n"
    if not records and not terminated:  # the header itself was cut: no run was recorded
        (log or _stderr)(f"warning: {path}: only a cut header line, as a study stopped while writing its first "
                         "run leaves it: removed")
        path.unlink()
        return []
    _check_columns(path, header)
    rows = []
    for k, (line, values) in enumerate(records):
        last = k == len(records) - 1
        try:
            row = _parse_row(header, values)
            if last and not terminated:
                raise ValueError("no line end")
        except ValueError as exc:
            if not last:
                raise ValueError(f"{path}, line {line}: not a complete run ({exc}); correct or remove that "
                                 "row") from None
            (log or _stderr)(f"warning: {path}, line {line}: the last row is incomplete ({exc}), as a study "
                             "stopped while writing it leaves it: skipped, and that run is done again")
            _rewrite_rows(path, header, [v for _, v in records[:-1]])
            continue
        rows.append(row)
    return rows


def _parse_row(header: list[str], values: list[str]) -> dict:
    """One row of ``runs.csv`` as a dict, its scores as floats (None when empty); ``ValueError`` saying what
    is wrong with a row that is not a complete run."""
    if len(values) != len(header):
        raise ValueError(f"{len(values)} fields, the header has {len(header)}")
    row = dict(zip(header, values))
    try:
        for k in ("accuracy", "test_accuracy", "worst_node", "epsilon_spent"):
            if k in row:
                row[k] = float(row[k]) if row[k] not in ("", "None") else None
        _key(row)  # the run's identity: every field of it present and parseable
        float(row.get("seconds") or 0.0)
    except KeyError as exc:
        raise ValueError(f"no {exc.args[0]!r} column") from None
    return row


def _rewrite_rows(path: Path, header: list[str], records: list[list[str]]) -> None:
    """Replace ``path`` atomically by ``header`` and ``records`` (fields written back as they were read)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(records)
    os.replace(tmp, path)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _skipped(row: dict) -> str:
    """`` (k of R rounds skipped: refused by the budget)`` for a run whose budget refused rounds, else ""."""
    refused = row.get("rounds_refused")
    if refused in (None, "", 0, "0"):
        return ""
    return f" ({int(refused)} of {row['rounds']} rounds skipped: refused by the budget)"


@dataclass
class _Progress:
    total_units: float
    done_units: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def line(self, k: int, total: int, text: str, units: float) -> str:
        self.done_units += units
        elapsed = time.perf_counter() - self.started
        left = max(0.0, self.total_units - self.done_units)
        eta = elapsed / self.done_units * left if self.done_units else math.nan
        eta_text = "?" if not math.isfinite(eta) else f"{eta / 60:.1f} min"
        return f"[{k:>3}/{total}] {text}  | elapsed {elapsed / 60:.1f} min, ETA {eta_text}"


def run_study(dataset: Any, grid: StudyGrid = DEFAULT_GRID, out_dir: str | Path = "study-mnist", *,
              resume: bool = False, log=None) -> dict[str, Any]:
    """Tune, run and summarise; writes ``runs.csv``, ``results.json``, ``table.csv``, ``table.md`` and the
    two plots into ``out_dir``. Returns the summary (also in ``results.json``)."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_output(out, resume)
    runs_path, partial = out / "runs.csv", out / "runs.csv.partial"
    # Runs of this study go to runs.csv.partial as they finish; runs.csv is replaced only at the end (by
    # this study's rows plus every earlier row it did not reach), so an interruption loses nothing.
    old_rows = _read_rows(runs_path, log) + _read_rows(partial, log)
    _upgrade_header(partial)  # rows are appended to it below, with this version's columns
    done = {_key(r): r for r in old_rows}
    data = split_data(dataset, grid)
    cache = _CalibrationCache(grid)
    settings = grid.tuning_settings()
    points = grid.points()
    n_tune = len(grid.clients) * len(grid.partitions) * len(grid.methods) * len(settings)
    eval_cells = [(n, p, m, e, g, s) for n in grid.clients for p in grid.partitions for m in grid.methods
                  for (e, g) in points for s in grid.seeds]
    eval_cells = [c for c in eval_cells if c[2] != "fedavg" or c[3] == points[0][0] or
                  (c[3], c[4]) == (grid.epsilon_at_gamma, c[4])]
    # fedavg has no epsilon: one run per gamma (reported at every epsilon)
    seen, cells = set(), []
    for c in eval_cells:
        k = (c[0], c[1], c[2], c[4], c[5]) if c[2] == "fedavg" else c
        if k not in seen:
            seen.add(k)
            cells.append(c)
    mean_rounds = float(np.mean([s[2] for s in settings]))
    total = n_tune + len(cells)
    progress = _Progress(sum(n * r for n in grid.clients for _ in grid.partitions for _ in grid.methods
                             for _, _, r in settings) + sum(c[0] for c in cells) * mean_rounds)
    log(f"[flwr-inca study mnist] {grid.describe()}")
    log(f"[flwr-inca study mnist] {n_tune} tuning runs (validation split of {grid.validation}) + {len(cells)} "
        f"evaluation runs; data: {data.source}, {len(data.y_train)} training examples, {len(data.y_test)} test")
    rows: list[dict] = []
    tuning_runs: dict[tuple, dict] = {}
    k = 0

    def record(r: RunResult | dict) -> dict:
        d = asdict(r) if isinstance(r, RunResult) else r
        new = not partial.exists()
        with partial.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerow(d)
        rows.append(d)
        return d

    def run(phase, method, n, part, eps, gamma, seed, lr, clip, rnds) -> dict:
        nonlocal k
        k += 1
        key = (phase, method, n, part, float(eps), float(gamma), seed, float(lr), float(clip), int(rnds))
        twin = ("tune",) + key[1:]
        units = n * rnds
        reuse = phase == "test" and twin in tuning_runs and method != "muffliato"  # its tuning skipped the gossip
        if key in done or reuse:
            progress.total_units -= units  # nothing to run
            units = 0
        if key in done:
            d = record(done[key])
        elif reuse:  # the selected tuning run is this cell: its model's test score
            d = record({**tuning_runs[twin], "phase": "test", "accuracy": tuning_runs[twin]["test_accuracy"],
                        "note": (tuning_runs[twin]["note"] + "; " if tuning_runs[twin]["note"] else "")
                        + "the selected tuning run"})
        else:
            d = record(run_one(data, grid, method, n, part, eps, gamma, seed, lr, clip, rnds, phase, cache))
        if phase == "tune":
            tuning_runs[key] = d
        acc = "n/a" if d["accuracy"] is None else f"{float(d['accuracy']):.4f}"
        worst = "" if d["worst_node"] in (None, "") else f" (worst node {float(d['worst_node']):.4f})"
        skipped = "" if "refused by the budget" in (d["note"] or "") else _skipped(d)  # said once, not twice
        log(progress.line(k, total, f"{phase:<4} {method:<10} n={n} {part} eps={eps:g} gamma={gamma:g} seed={seed} "
                                    f"lr={lr:g} C={clip:g} R={rnds}: acc {acc}{worst}{skipped}  "
                                    f"{float(d['seconds']):.1f} s"
                                    + (f"  [{d['note']}]" if d["note"] else ""), units))
        return d

    tuned: dict[tuple, tuple[float, float, int]] = {}
    for n in grid.clients:
        for part in grid.partitions:
            for method in grid.methods:
                scores = []
                for lr, clip, rnds in settings:
                    d = run("tune", method, n, part, grid.tune_epsilon, grid.tune_gamma, grid.seeds[0], lr, clip, rnds)
                    scores.append((-1.0 if d["accuracy"] is None else float(d["accuracy"]), lr, clip, rnds))
                best = max(scores, key=lambda s: s[0])
                tuned[(n, part, method)] = best[1:]
    # the evaluation's work is known once the rounds are tuned: the ETA counts it from here
    progress.total_units = progress.done_units + sum(c[0] * tuned[(c[0], c[1], c[2])][2] for c in cells)
    for n, part, method, eps, gamma, seed in cells:
        lr, clip, rnds = tuned[(n, part, method)]
        run("test", method, n, part, eps, gamma, seed, lr, clip, rnds)

    _finish_runs(runs_path, partial, rows, old_rows)
    summary = summarise(rows, grid, points)
    summary.update(
        grid=asdict(grid), tuned={f"{m} n={n} {p}": {"lr": v[0], "clip": v[1], "rounds": v[2]}
                                  for (n, p, m), v in tuned.items()},
        seconds=time.perf_counter() - progress.started, calibration_seconds=cache.seconds, data=data.source)
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=float))
    write_table(summary, out)
    plot(summary, grid, out)
    log(f"[flwr-inca study mnist] done in {summary['seconds'] / 60:.1f} min; {out / 'table.md'}, "
        f"{out / 'accuracy_vs_epsilon.png'}, {out / 'accuracy_vs_gamma.png'}")
    return summary


def summarise(rows: list[dict], grid: StudyGrid, points: list[tuple[float, float]]) -> dict[str, Any]:
    """Mean and spread over seeds per (method, n, partition, epsilon, gamma) of the test runs."""
    table = []
    for n in grid.clients:
        for part in grid.partitions:
            for method in grid.methods:
                for eps, gamma in points:
                    sel = [r for r in rows if r["phase"] == "test" and r["method"] == method
                           and int(r["clients"]) == n and r["partition"] == part and float(r["gamma"]) == gamma
                           and (method == "fedavg" or float(r["epsilon"]) == eps)]
                    accs = [float(r["accuracy"]) for r in sel if r["accuracy"] is not None]
                    worst = [float(r["worst_node"]) for r in sel if r["worst_node"] not in (None, "")]
                    spent = [float(r["epsilon_spent"]) for r in sel if r["epsilon_spent"] not in (None, "")]
                    table.append({
                        "method": method, "label": METHODS[method], "clients": n, "partition": part, "epsilon": eps,
                        "gamma": gamma, "runs": len(accs),
                        "accuracy": float(np.mean(accs)) if accs else None,
                        "spread": float(np.std(accs)) if len(accs) > 1 else 0.0 if accs else None,
                        "worst_node": float(np.mean(worst)) if worst else None,
                        "epsilon_spent": float(np.max(spent)) if spent else None,
                        "note": "; ".join(sorted({r["note"] for r in sel if r["note"]}))})
    return {"table": table}


def write_table(summary: dict[str, Any], out: Path) -> None:
    table = summary["table"]
    with (out / "table.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    (out / "table.md").write_text(markdown_table(table))


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def markdown_table(table: list[dict]) -> str:
    """Accuracy (%) per method (rows) and (epsilon, gamma) (columns), one block per (n, partition)."""
    lines = []
    for n, part in dict.fromkeys((r["clients"], r["partition"]) for r in table):
        block = [r for r in table if r["clients"] == n and r["partition"] == part]
        cols = list(dict.fromkeys((r["epsilon"], r["gamma"]) for r in block))
        lines.append(f"**n = {n}, {part}** — test accuracy (%), mean ± spread over seeds; DP gossip / Muffliato: "
                     "average model (worst node)\n")
        lines.append("| method | " + " | ".join(f"ε={e:g}, γ={g:g}" for e, g in cols) + " |")
        lines.append("|---|" + "---:|" * len(cols))
        for method in dict.fromkeys(r["method"] for r in block):
            cells = []
            for e, g in cols:
                r = next(x for x in block if x["method"] == method and x["epsilon"] == e and x["gamma"] == g)
                cell = _pct(r["accuracy"])
                if r["accuracy"] is not None and r["runs"] > 1:
                    cell += f" ± {100 * r['spread']:.1f}"
                if r["worst_node"] is not None:
                    cell += f" ({_pct(r['worst_node'])})"
                cells.append(cell)
            lines.append(f"| {METHODS[method]} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict[str, Any], grid: StudyGrid, out: Path) -> None:
    """``accuracy_vs_epsilon.png`` (at ``gamma_at_epsilon``) and ``accuracy_vs_gamma.png`` (at
    ``epsilon_at_gamma``): one panel per (n, partition) of the grid, rows n, columns partitions."""
    import matplotlib.pyplot as plt

    for name, fig in _figures(summary, grid):
        fig.savefig(out / f"{name}.png", dpi=120)
        plt.close(fig)


def _figures(summary: dict[str, Any], grid: StudyGrid):
    """Yield ``(name, figure)`` for :func:`plot` (open matplotlib figures; the caller closes them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summary["table"]
    rows, cols = len(grid.clients), len(grid.partitions)
    for name, x_key, fixed_key, fixed in (("accuracy_vs_epsilon", "epsilon", "gamma", grid.gamma_at_epsilon),
                                          ("accuracy_vs_gamma", "gamma", "epsilon", grid.epsilon_at_gamma)):
        fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.4 * rows), squeeze=False)
        where = f"γ = {fixed:g}" if x_key == "epsilon" else f"ε = {fixed:g}"
        for (n, part), ax in zip(((n, p) for n in grid.clients for p in grid.partitions), axes.flat):
            for method in grid.methods:
                pts = sorted((r[x_key], r["accuracy"], r["spread"]) for r in table
                             if r["method"] == method and r["clients"] == n and r["partition"] == part
                             and r[fixed_key] == fixed and r["accuracy"] is not None)
                if not pts:
                    continue
                xs, ys, sp = (np.array(v, dtype=float) for v in zip(*pts))
                style = "--" if method in TRUSTED else ":" if method == "muffliato" else "-"
                ax.errorbar(xs, 100 * ys, yerr=100 * sp, label=METHODS[method], linestyle=style, marker="o",
                            capsize=2)
            if x_key == "epsilon":
                ax.set_xscale("log", base=2)
            ax.set_xlabel("ε (total, δ = 1e-5)" if x_key == "epsilon" else "γ (dropouts within and across rounds)")
            ax.set_ylabel("test accuracy (%)")
            ax.set_title(f"MNIST logistic regression, n = {n}, {part}, {where}", fontsize=10)
            ax.grid(alpha=0.3)
        # one legend for all panels, below them: inside a panel it covered points wherever it went
        handles, labels = [], []
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        # room below the panels for the legend's rows (about 0.22 in each at fontsize 9), not a fixed share
        ncol = min(len(labels), 4 if cols > 1 else 2) or 1
        legend_rows = -(-len(labels) // ncol)
        bottom = (0.22 * legend_rows + 0.12) / fig.get_figheight() if handles else 0.0
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
        fig.tight_layout(rect=(0, bottom, 1, 1))
        yield name, fig


# ------------------------------------------------------------------------------------------ CLI
def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def add_study_parser(sub: Any, **parser_options: Any) -> None:
    """Register ``flwr-inca study mnist``; ``parser_options`` go to ``add_parser`` (e.g. the CLI's help
    formatter)."""
    s = sub.add_parser(
        "study", help="side-by-side learning study: IncA vs central/local DP, DP gossip, Muffliato, GOPA",
        description="Train MNIST logistic regression with every method (FedAvg without noise, central DP, "
                    "IncA with both calibrations, local DP, DP gossip, Muffliato, GOPA) at each epsilon, n and "
                    "dropout rate of the grid, tuning each method on a validation split with the same budget; "
                    "writes runs.csv, table.csv/.md, results.json and the plots to --out.",
        epilog="examples:\n  flwr-inca study mnist --data-dir /path/to/mnist\n"
               "  flwr-inca study mnist --grid tiny --out study-smoke",
        **parser_options)
    s.add_argument("dataset", choices=["mnist"], help="the study to run")
    s.add_argument("--grid", choices=["default", "full", "tiny"], default="default",
                   help="default: the reduced grid (n = 1000, IID, 1 seed; about 25 minutes on 2 CPU cores); "
                        "full: the whole grid (n in {100, 1000}, IID and Dirichlet(0.5), every epsilon x gamma, "
                        "3 seeds, 27 tuning settings; many hours); tiny: a seconds-long smoke test")
    s.add_argument("--data-dir", default=None, help="directory of the MNIST IDX files (else FLWR_INCA_MNIST_DIR)")
    s.add_argument("--out", default="study-mnist", help="output directory")
    s.add_argument("--clients", type=_ints, help="override the grid's n values, e.g. 100,1000")
    s.add_argument("--partitions", type=lambda t: tuple(v for v in t.split(",") if v),
                   help="override the grid's partitions, e.g. iid,dirichlet:0.5")
    s.add_argument("--epsilons", type=_floats, help="override the grid's epsilons")
    s.add_argument("--gammas", type=_floats, help="override the grid's gammas")
    s.add_argument("--seeds", type=_ints, help="override the grid's seeds, e.g. 0,1,2")
    s.add_argument("--methods", type=lambda t: tuple(v for v in t.split(",") if v),
                   help=f"subset of {','.join(METHODS)}")
    s.add_argument("--resume", action="store_true", help="reuse the runs already in OUT (runs.csv, and runs.csv.partial of an interrupted study); "
                   "without it, a folder holding runs is refused")
    s.set_defaults(func=_cmd_study)


def _cmd_study(args: Any) -> int:
    from ..simulation.data import load_mnist

    grid = {"default": DEFAULT_GRID, "full": FULL_GRID, "tiny": TINY_GRID}[args.grid]
    changes = {k: getattr(args, k) for k in ("clients", "partitions", "epsilons", "gammas", "seeds", "methods")
               if getattr(args, k, None)}
    try:
        grid = replace(grid, **changes)
    except ValueError as exc:
        print(f"flwr-inca study: {exc}", file=sys.stderr)
        return 2
    try:
        check_output(args.out, args.resume)  # before loading anything
    except StudyOutputExists as exc:
        print(f"flwr-inca study: {exc}", file=sys.stderr)
        return 2
    dataset = load_mnist(args.data_dir)
    if dataset.features != 784:
        print(f"flwr-inca study: MNIST not found (give --data-dir or FLWR_INCA_MNIST_DIR); got "
              f"{getattr(dataset, 'name', '?')} with {dataset.features} features, which the study's 784 -> 10 model "
              "cannot take", file=sys.stderr)
        return 2
    summary = run_study(dataset, grid, args.out, resume=args.resume)
    print(markdown_table(summary["table"]))
    return 0
