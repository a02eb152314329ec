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

from .._lazy import lazy_exports

# name -> the submodule that defines it
_WHERE = {
    "simulate": ".runner",
    "RoundContext": ".runner",
    "SimulationConfig": ".config",
    "History": ".history",
    "RoundRecord": ".history",
    "Partitions": ".partitions",
    "iid": ".partitions",
    "dirichlet": ".partitions",
    "from_indices": ".partitions",
    "Availability": ".availability",
    "AlwaysAvailable": ".availability",
    "MarkovAvailability": ".availability",
    "AvailabilityTable": ".availability",
    "Mixer": ".mixers",
    "MixContext": ".mixers",
    "RoundPlan": ".mixers",
    "IncaMixer": ".mixers",
    "FedAvgMixer": ".mixers",
    "CentralDPMixer": ".mixers",
    "MIXERS": ".mixers",
    "register_mixer": ".mixers",
    "create_mixer": ".mixers",
    "Dataset": ".data",
    "load_mnist": ".data",
}

__all__ = list(_WHERE)

__getattr__, __dir__ = lazy_exports(__name__, _WHERE, globals())
