"""``SimulationConfig``: every parameter of a simulated training run, validated when it is built."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .._checks import check_bool, check_int, check_probability, check_real
from ..privacy.accountants import ACCOUNTANTS, resolve_accountant_name
from ..privacy.plan import PRIVACY_UNITS
from ..protocol.dropout import DropoutModel
from .availability import Availability

__all__ = ["SimulationConfig", "DEFAULT_LR"]

DEFAULT_LR = {"record": 6.0, "party": 0.05}  # lr=None picks these (the MNIST example's settings)
BACKENDS = ("ray", "inline")
PRECISIONS = ("float32", "float64")


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    """A simulated decentralized training run.

    Rounds and clients:
        rounds: training rounds.
        mode: how updates are mixed: ``"inca"`` (default), ``"fedavg"`` (trusted server, no noise),
            ``"central-dp"`` (trusted server adds Gaussian noise), or any ``register_mixer`` name.
        fraction: share of the *available* clients that takes part in a round, in (0, 1].
        min_clients: fewer available clients than this skips the round (>= 2).
        availability: clients available per round (``MarkovAvailability``, ``AvailabilityTable``);
            None: everybody, every round.

    Local training (SGD from the current global model):
        privacy_unit: ``"record"`` (one example: per-example clipping, one Poisson-sampled local step
            per round) or ``"party"`` (a client's whole update is clipped).
        lr: learning rate (None: 6.0 for record level, as in the MNIST example, 0.05 for party level).
        clip_norm: record level: per-example gradient clip; party level: clip of the update (L2).
        batch_size: record level: expected Poisson batch; party level: minibatch size.
        local_steps, local_epochs: party level: S steps or E epochs (default one epoch). Record
            level takes exactly one step per round (several noiseless local steps have no per-record
            sensitivity bound).

    Privacy:
        epsilon, delta: total budget over ``budget_rounds`` (epsilon None: no budget; then the noise must be
            given: ``sigma_star``/``sigma_delta`` for inca, ``noise_multiplier`` for central-dp).
            A round whose charge would exceed epsilon is refused and skipped (see ``max_consecutive_refusals``).
        budget_rounds: rounds the budget is planned for (default ``rounds``): each round's target is
            the budget's share of ``budget_rounds`` (e.g. plan for 100 rounds, run 20 now).
        accountant: record level ``"opacus-prv"`` (default) or ``"opacus-rdp"``; party level ``"exact"``
            (default) or either Opacus accountant. The names before 0.2 (``"prv"``, ``"rdp"``, ``"gdp"``)
            still work, warn (``DeprecationWarning``) and are stored under the new name.
        reserve_stopped_round: IncA with a budget: the budget guard (default; ``epsilon`` then holds
            always): a round whose cost does not fit is stopped before its final messages, or before the
            first iteration whose messages would not fit, and charged what was revealed until then.
            False: it is always stopped only before its finals and charged their no-finals cost, which
            may take the total past ``epsilon`` (see ``flwr_inca.flower.PrivacyTarget.reserve_stopped_round``);
            training then stops.
        max_consecutive_refusals: a round refused by the budget (its fresh execution certified too costly)
            is *skipped*: charged what it revealed, the model kept, and training goes on with the next
            round's fresh execution. Training stops after this many refused rounds in a row (a round
            whose charge is accepted resets the count), so a cost that is systematically too high for the
            budget left cannot spend it round after round; 1 stops at the first refused round. A refused
            round none of whose messages was delivered (a mechanism that reveals nothing before its
            release, GOPA's guard before publishing, IncA's guard before the first iteration) stops training
            at once: the budget left does not afford the first step of a round. Same name and meaning as
            ``flwr_inca.flower.PrivacyTarget.max_consecutive_refusals``.
        budget_check_runs: the pre-round budget check, as ``IncaStrategy`` runs it (same name and meaning as
            ``flwr_inca.flower.PrivacyTarget.budget_check_runs``): a round is predicted to cost the worst
            certified mu over this many simulated executions of its participants, and if that does not fit
            the budget left, training stops *before* the round (nothing charged; ``History.stopped`` says
            why). Evaluated for the rounds whose own execution does not fit (only they can differ from a
            run without the check; docs/simulation.md, "The pre-round budget check").
        mu_resolution: a round is charged its mu rounded *up* to this relative grid (0.005: at most
            0.5% more), so the PRV accountant composes few distinct rounds (its cost grows with them);
            0 charges mu exactly.
        ledger_path: the privacy ledger (default ``output_dir/ledger.json``; memory only without an
            output dir). An existing ledger is resumed: what it records counts as spent.

    IncA (``mode="inca"``): iterations, neighbors, schedule, topology, dropout (within a round),
        dissemination, collusion / observed_fraction (threat certified against), threat_draws,
        sigma_star / sigma_delta (else calibrated with ``calibration_runs`` simulated runs),
        certification (``"exact"`` or ``"local-bound"``) and certify_every (see ``IncaMixer``).
    Central DP: noise_multiplier (std of the noise on the sum over the value sensitivity).
    mixer_options: extra keyword arguments for the mixer's ``from_config`` (registered mechanisms).

    Execution:
        backend: ``"ray"`` (actors, default) or ``"inline"`` (this process, no Ray).
        num_actors: Ray actors (each trains a cohort of clients; default: the CPUs Ray has).
        ray_address: None starts (or reuses) a local Ray; ``"auto"`` or ``"host:port"`` joins a cluster.
        precision: of the updates while mixing (``"float32"`` default, ``"float64"``).
        seed: everything random derives from it (results are identical for any number of actors).
        eval_every: evaluate the global model every this many rounds (and after the last).
        output_dir: where history.json/csv, the ledger, traces and the plot go (None: nowhere).
        save_traces: also write each round's IncA execution trace there.
    """

    rounds: int = 40
    mode: str = "inca"
    fraction: float = 1.0
    min_clients: int = 2
    availability: Availability | None = None
    privacy_unit: str = "record"
    lr: float | None = None
    clip_norm: float = 1.0
    batch_size: int = 50
    local_steps: int | None = None
    local_epochs: int | None = None
    epsilon: float | None = 1.0
    delta: float = 1e-5
    budget_rounds: int | None = None
    accountant: str | None = None
    mu_resolution: float = 0.005
    reserve_stopped_round: bool = True
    max_consecutive_refusals: int = 3
    budget_check_runs: int = 10
    ledger_path: str | None = None
    iterations: int = 10
    neighbors: int = 1
    schedule: str = "incremental"
    topology: str = "random"
    dropout: DropoutModel | None = None
    dissemination: str = "exact"
    collusion: float = 0.1
    observed_fraction: float | None = None
    threat_draws: int = 1
    sigma_star: float | None = None
    sigma_delta: float | None = None
    calibration_runs: int = 10
    certification: str = "exact"
    certify_every: int = 1
    noise_multiplier: float | None = None
    mixer_options: dict[str, Any] = field(default_factory=dict)
    backend: str = "ray"
    num_actors: int | None = None
    ray_address: str | None = None
    precision: str = "float32"
    seed: int = 0
    eval_every: int = 1
    output_dir: str | None = None
    save_traces: bool = False

    def __post_init__(self) -> None:
        from .mixers import MIXERS

        check_int("rounds", self.rounds)
        if not isinstance(self.mode, str) or self.mode not in MIXERS:
            raise ValueError(f"mode must be one of {sorted(MIXERS)}, got {self.mode!r}")
        check_probability("fraction (of available clients per round)", self.fraction, zero=False)
        check_int("min_clients", self.min_clients, 2)
        if self.availability is not None and not isinstance(self.availability, Availability):
            raise ValueError(f"availability must be an Availability model or None, got {self.availability!r}")
        if self.privacy_unit not in PRIVACY_UNITS:
            raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {self.privacy_unit!r}")
        if self.lr is not None:
            check_real("lr", self.lr, 0.0, low_open=True)
        check_real("clip_norm", self.clip_norm, 0.0, low_open=True)
        check_int("batch_size", self.batch_size)
        if self.local_steps is not None:
            check_int("local_steps", self.local_steps)
        if self.local_epochs is not None:
            check_int("local_epochs", self.local_epochs)
        if self.local_steps is not None and self.local_epochs is not None:
            raise ValueError("give local_steps or local_epochs, not both")
        if self.privacy_unit == "record" and (
            self.local_epochs is not None or self.local_steps not in (None, 1)
        ):
            raise ValueError(
                "privacy_unit='record' takes exactly one local step per round (local_steps=1): after "
                "several noiseless local steps one example's influence on the update has no bound; use "
                "more rounds, or privacy_unit='party'"
            )
        if self.epsilon is not None:
            check_real("epsilon (or None)", self.epsilon, 0.0, low_open=True)
        check_real("delta", self.delta, 0.0, 1.0, low_open=True, high_open=True)
        if self.budget_rounds is not None:
            check_int("budget_rounds", self.budget_rounds)
        if self.accountant is not None:
            if not isinstance(self.accountant, str):
                raise ValueError(
                    f"accountant must be one of {list(ACCOUNTANTS)} or None, got {self.accountant!r}"
                )
            object.__setattr__(self, "accountant", resolve_accountant_name(self.accountant))
        check_real("mu_resolution", self.mu_resolution, 0.0, 1.0, high_open=True)
        check_bool("reserve_stopped_round", self.reserve_stopped_round)
        check_int("max_consecutive_refusals (rounds refused by the budget in a row before training stops)",
                  self.max_consecutive_refusals, 1)
        check_int("budget_check_runs (simulated executions that predict a round's cost)", self.budget_check_runs, 1)
        if self.noise_multiplier is not None:
            check_real("noise_multiplier", self.noise_multiplier, 0.0, low_open=True)
        if not isinstance(self.mixer_options, dict):
            raise ValueError("mixer_options must be a dict of keyword arguments")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.num_actors is not None:
            check_int("num_actors", self.num_actors)
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address):
            raise ValueError(f"ray_address must be None, 'auto' or 'host:port', got {self.ray_address!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        check_int("seed", self.seed, 0)
        check_int("eval_every", self.eval_every)
        check_bool("save_traces", self.save_traces)
        mixer_private = MIXERS[self.mode].private
        if not mixer_private and self.epsilon is not None:
            raise ValueError(
                f"mode {self.mode!r} adds no noise (its epsilon is infinite): run it with epsilon=None"
            )
        if self.backend != "ray" and (self.num_actors is not None or self.ray_address is not None):
            raise ValueError(
                "num_actors and ray_address need backend='ray' (the inline backend has no actors)"
            )
        if self.mode == "inca" or self.mixer_options:  # the mixer validates its own parameters
            from .mixers import create_mixer

            create_mixer(self)

    @property
    def learning_rate(self) -> float:
        return float(self.lr) if self.lr is not None else DEFAULT_LR[self.privacy_unit]

    def replace(self, **changes: Any) -> SimulationConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("availability", "dropout"):
            out[key] = None if getattr(self, key) is None else repr(getattr(self, key))
        return out
