"""Simulated decentralized SGD with IncA: thousands of clients, dropouts and per-round guarantees,
on one machine or a Ray cluster. Imports the protocol and the accountant, never Flower; Ray only when
the Ray backend runs.

    from flwr_inca.simulation import SimulationConfig, iid, load_mnist, simulate

    data = load_mnist()                                       # FLWR_INCA_MNIST_DIR, or a fallback
    parts = iid(data.x_train, data.y_train, num_clients=1000)
    history = simulate(lambda: torch.nn.Linear(784, 10), parts, (data.x_test, data.y_test),
                       SimulationConfig(rounds=40, epsilon=1.0, iterations=10))

The names below are loaded on first use: a process that needs only a part (a Ray actor imports
``training`` and torch) does not import the accountant, the baselines and the runner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the submodule that defines it
_EXPORTS = {
    "simulate": "runner",
    "RoundContext": "runner",
    "SimulationConfig": "config",
    "History": "history",
    "RoundRecord": "history",
    "Partitions": "partitions",
    "iid": "partitions",
    "dirichlet": "partitions",
    "from_indices": "partitions",
    "Availability": "availability",
    "AlwaysAvailable": "availability",
    "MarkovAvailability": "availability",
    "AvailabilityTable": "availability",
    "Mixer": "mixers",
    "MixContext": "mixers",
    "RoundPlan": "mixers",
    "IncaMixer": "mixers",
    "FedAvgMixer": "mixers",
    "CentralDPMixer": "mixers",
    "MIXERS": "mixers",
    "register_mixer": "mixers",
    "create_mixer": "mixers",
    "Dataset": "data",
    "load_mnist": "data",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "MIXERS":  # the registry with the baselines' modes (local-dp, dp-gossip, muffliato, gopa)
        value: Any = importlib.import_module(".mixers", __name__).registered_mixers()
    else:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the names as plain imports
    from .availability import AlwaysAvailable, Availability, AvailabilityTable, MarkovAvailability
    from .config import SimulationConfig
    from .data import Dataset, load_mnist
    from .history import History, RoundRecord
    from .mixers import (
        MIXERS,
        CentralDPMixer,
        FedAvgMixer,
        IncaMixer,
        MixContext,
        Mixer,
        RoundPlan,
        create_mixer,
        register_mixer,
    )
    from .partitions import Partitions, dirichlet, from_indices, iid
    from .runner import RoundContext, simulate
