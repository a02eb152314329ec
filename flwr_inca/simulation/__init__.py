"""Simulated decentralized SGD with IncA: thousands of clients, dropouts and per-round guarantees,
on one machine or a Ray cluster. Imports the protocol and the accountant, never Flower; Ray only when
the Ray backend runs.

    from flwr_inca.simulation import SimulationConfig, iid, load_mnist, simulate

    data = load_mnist()                                       # FLWR_INCA_MNIST_DIR, or a fallback
    parts = iid(data.x_train, data.y_train, num_clients=1000)
    history = simulate(lambda: torch.nn.Linear(784, 10), parts, (data.x_test, data.y_test),
                       SimulationConfig(rounds=40, epsilon=1.0, iterations=10))
"""

from . import baseline_mixers  # noqa: F401  (registers the local-dp, dp-gossip, muffliato and gopa modes)
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

__all__ = [
    "simulate",
    "SimulationConfig",
    "History",
    "RoundRecord",
    "RoundContext",
    "Partitions",
    "iid",
    "dirichlet",
    "from_indices",
    "Availability",
    "AlwaysAvailable",
    "MarkovAvailability",
    "AvailabilityTable",
    "Mixer",
    "MixContext",
    "RoundPlan",
    "IncaMixer",
    "FedAvgMixer",
    "CentralDPMixer",
    "MIXERS",
    "register_mixer",
    "create_mixer",
    "Dataset",
    "load_mnist",
]
