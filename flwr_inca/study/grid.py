"""What the MNIST study runs: its methods and grids (:class:`StudyGrid`)."""

from __future__ import annotations

from dataclasses import dataclass

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
from ..protocol.schedules import RECOMMENDED_SCHEDULE, InjectionSchedule

__all__ = ["DEFAULT_GRID", "FULL_GRID", "METHODS", "TINY_GRID", "TRUSTED", "StudyGrid", "partition_alpha"]

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
    # IncA's protocol, as the simulator's defaults: T chosen for the run's dropout rate (the fewest of 10, 20,
    # 40 leaving at most a quarter of the central noise uncancelled; 10 without dropouts), the value-free tail
    iterations: int | str = "auto"
    max_iterations: int = 40
    schedule: str = RECOMMENDED_SCHEDULE
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
            partition_alpha(p)
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
        if self.iterations != "auto":
            check_iterations("iterations (or 'auto')", self.iterations)
        check_iterations("max_iterations", self.max_iterations)
        InjectionSchedule.resolve(self.schedule, self.max_iterations)  # raises naming a bad schedule
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
                f"batch {self.batch_size}, IncA T = {self.iterations} (at most {self.max_iterations}), schedule "
                f"{self.schedule}, k = {self.neighbors}, "
                f"{self.collusion:.0%} colluders, calibrated on {self.calibration_runs} execution(s) "
                f"(success share {self.calibration_success:g}) and certified every {self.certify_every} round(s); "
                f"at n <= {self.small_clients}: {self.small_calibration_runs} execution(s), success share "
                f"{self.small_calibration_success:g}, certified every {self.small_certify_every} round(s)")


def partition_alpha(name: str) -> float | None:
    """The Dirichlet concentration of a partition name (``"dirichlet:<alpha>"``), None for ``"iid"``."""
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
