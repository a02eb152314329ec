"""``SimulationConfig``: a simulated training run, with the settings groups every driver shares.

The privacy, mixing and persistence settings are the objects of :mod:`flwr_inca.settings` (the same that
``IncaStrategy`` takes: move a setup to Flower by changing the driver, not the settings); the rest is the
simulation's own: rounds, clients, local training, execution.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .._checks import (
    check_batch_size,
    check_int,
    check_local_steps,
    check_parties,
    check_probability,
    check_rounds,
    check_scale,
    check_workers,
)
from ..privacy.plan import PRIVACY_UNITS
from ..settings import GROUPS, MixingConfig, PersistenceConfig, PrivacyTarget, build_groups
from .availability import Availability

__all__ = ["SimulationConfig", "DEFAULT_LR"]

DEFAULT_LR = {"record": 6.0, "party": 0.05}  # lr=None picks these (the MNIST example's settings)
BACKENDS = ("ray", "inline")


@dataclass(frozen=True, init=False)
class SimulationConfig:
    """A simulated decentralized training run.

    Shared settings (:mod:`flwr_inca.settings`; each field may also be given directly as a keyword, e.g.
    ``SimulationConfig(rounds=40, max_epsilon=1.0, iterations=20)``):
        privacy: a :class:`~flwr_inca.settings.PrivacyTarget`: the total budget ``max_epsilon`` over
            ``budget_rounds`` (default ``rounds``), the threat, the refusal policy. ``value_sensitivity``
            and ``sample_rate`` are derived here from the training settings (leave them unset).
        mixing: a :class:`~flwr_inca.settings.MixingConfig`: IncA's iterations, noise, dropout model
            (drawn within each round), topology, certification.
        persistence: a :class:`~flwr_inca.settings.PersistenceConfig`: the ledger (relative to
            ``output_dir``; memory only without one) and ``trace_dir`` for each round's trace.

    Rounds and clients:
        rounds: training rounds.
        mode: how updates are mixed: ``"inca"`` (default), ``"fedavg"`` (trusted server, no noise),
            ``"central-dp"`` (trusted server adds Gaussian noise), or any ``register_mixer`` name.
        fraction: share of the *available* clients that takes part in a round, in (0, 1].
        min_clients: fewer available clients than this skips the round (>= 2).
        availability: clients available per round (``MarkovAvailability``, ``AvailabilityTable``);
            None: everybody, every round.

    Local training (SGD from the current global model):
        privacy_unit: ``"record"`` (one example: per-example clipping at ``clip_norm``, one Poisson-sampled
            local step per round) or ``"party"`` (a client's whole update is clipped at ``clip_norm``).
        lr: learning rate (None: 6.0 for record level, as in the MNIST example, 0.05 for party level).
        batch_size: record level: expected Poisson batch; party level: minibatch size.
        local_steps, local_epochs: party level: S steps or E epochs (default one epoch). Record level
            takes exactly one step per round.

    Other mechanisms: ``noise_multiplier`` (central DP: std of the noise on the sum over the value
    sensitivity; None: from the budget); ``mixer_options``: keyword arguments for a mixer's ``from_config``.

    Execution:
        backend: ``"ray"`` (actors, default) or ``"inline"`` (this process, no Ray).
        num_actors: Ray actors (each trains a cohort of clients; default: the CPUs Ray has).
        ray_address: None: ``RAY_ADDRESS`` if set, else a local Ray; ``"auto"`` or ``"host:port"`` joins a
            cluster.
        seed: everything random derives from it (results are identical for any number of actors).
        eval_every: evaluate the global model every this many rounds (and after the last).
        output_dir: where history.json/csv, the ledger, traces and the plot go (None: nowhere).
    """

    rounds: int = 40
    mode: str = "inca"
    fraction: float = 1.0
    min_clients: int = 2
    availability: Availability | None = None
    privacy_unit: str = "record"
    lr: float | None = None
    batch_size: int = 50
    local_steps: int | None = None
    local_epochs: int | None = None
    noise_multiplier: float | None = None
    mixer_options: dict[str, Any] = field(default_factory=dict)
    backend: str = "ray"
    num_actors: int | None = None
    ray_address: str | None = None
    seed: int = 0
    eval_every: int = 1
    output_dir: str | None = None
    privacy: PrivacyTarget = field(default_factory=PrivacyTarget)
    mixing: MixingConfig = field(default_factory=MixingConfig)
    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)

    def __init__(self, *, privacy: PrivacyTarget | None = None, mixing: MixingConfig | None = None,
                 persistence: PersistenceConfig | None = None, **settings: Any) -> None:
        groups, own = build_groups(GROUPS, {"privacy": privacy, "mixing": mixing, "persistence": persistence},
                                   settings, "SimulationConfig")
        names = {f.name for f in dataclasses.fields(self)}
        for key in own:
            if key not in names:
                raise TypeError(f"SimulationConfig() got an unexpected keyword argument {key!r}")
        for f in dataclasses.fields(self):
            if f.name in GROUPS:
                value = groups[f.name]
            elif f.name in own:
                value = own[f.name]
            else:
                value = f.default_factory() if f.default is dataclasses.MISSING else f.default
            object.__setattr__(self, f.name, value)
        self._validate()

    def _validate(self) -> None:
        from .mixers import MIXERS

        check_rounds("rounds", self.rounds)
        if not isinstance(self.mode, str) or self.mode not in MIXERS:
            raise ValueError(f"mode must be one of {sorted(MIXERS)}, got {self.mode!r}")
        check_probability("fraction (of available clients per round)", self.fraction, zero=False)
        check_parties("min_clients", self.min_clients)
        if self.availability is not None and not isinstance(self.availability, Availability):
            raise ValueError(f"availability must be an Availability model or None, got {self.availability!r}")
        if self.privacy_unit not in PRIVACY_UNITS:
            raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {self.privacy_unit!r}")
        if self.lr is not None:
            check_scale("lr", self.lr, zero=False)
        check_batch_size("batch_size", self.batch_size)
        if self.local_steps is not None:
            check_local_steps("local_steps", self.local_steps)
        if self.local_epochs is not None:
            check_local_steps("local_epochs", self.local_epochs)
        if self.local_steps is not None and self.local_epochs is not None:
            raise ValueError("give local_steps or local_epochs, not both")
        if self.privacy_unit == "record" and (self.local_epochs is not None or self.local_steps not in (None, 1)):
            raise ValueError(
                "privacy_unit='record' takes exactly one local step per round (local_steps=1): after several "
                "noiseless local steps one example's influence on the update has no bound; use more rounds, "
                "or privacy_unit='party'")
        if self.noise_multiplier is not None:
            check_scale("noise_multiplier", self.noise_multiplier, zero=False)
        if not isinstance(self.mixer_options, dict):
            raise ValueError("mixer_options must be a dict of keyword arguments")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.num_actors is not None:
            check_workers("num_actors", self.num_actors)
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address):
            raise ValueError(f"ray_address must be None, 'auto' or 'host:port', got {self.ray_address!r}")
        check_int("seed", self.seed, 0)
        check_rounds("eval_every", self.eval_every)
        if self.backend != "ray" and (self.num_actors is not None or self.ray_address is not None):
            raise ValueError("num_actors and ray_address need backend='ray' (the inline backend has no actors)")
        self._validate_privacy(MIXERS[self.mode].private)
        if self.mode == "inca" or self.mixer_options:  # the mixer validates its own parameters
            from .mixers import create_mixer

            create_mixer(self)

    def _validate_privacy(self, private: bool) -> None:
        priv = self.privacy
        if not private and priv.max_epsilon is not None:
            raise ValueError(f"mode {self.mode!r} adds no noise (its epsilon is infinite): run it without a "
                             "budget (max_epsilon=None)")
        if priv.value_sensitivity is not None or priv.sample_rate != 1.0:
            raise ValueError("value_sensitivity and sample_rate are derived from the training settings in the "
                             "simulator (privacy_unit, clip_norm, lr, batch_size): leave them unset")
        if priv.round_epsilon is not None and priv.max_epsilon is None:
            raise ValueError("round_epsilon needs a budget (max_epsilon) in the simulator; without one, give "
                             "the noise (sigma_star and sigma_delta, or noise_multiplier)")

    @property
    def learning_rate(self) -> float:
        return float(self.lr) if self.lr is not None else DEFAULT_LR[self.privacy_unit]

    def replace(self, **changes: Any) -> SimulationConfig:
        """A copy with some settings changed (validated again); a group's fields may be given directly."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        groups = {name: current.pop(name) for name in GROUPS}
        for name, cls in GROUPS.items():
            if name in changes:
                groups[name] = changes.pop(name)
            sub = {f.name: changes.pop(f.name) for f in dataclasses.fields(cls) if f.name in changes}
            if sub:
                groups[name] = dataclasses.replace(groups[name], **sub)
        current.update(changes)
        return SimulationConfig(**groups, **current)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in GROUPS:
                out[f.name] = {g.name: _plain(getattr(value, g.name)) for g in dataclasses.fields(value)}
            else:
                out[f.name] = _plain(value)
        return out


def _plain(value: Any) -> Any:
    """A JSON-friendly form of a setting: models (dropout, availability) by their repr, paths as strings."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    import os

    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return repr(value)
