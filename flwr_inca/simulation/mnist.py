"""MNIST out of the box: models, the split, and one call that runs a simulation on it (the CLI's)."""

from __future__ import annotations

from torch import nn

from .config import SimulationConfig
from .data import load_mnist
from .history import History
from .partitions import dirichlet, iid
from .runner import simulate

__all__ = ["MODELS", "ModelFactory", "simulate_mnist"]

MODELS = ("logreg", "mlp")


class ModelFactory:
    """A picklable model builder: ``"logreg"`` (features -> classes, d = 7850 on MNIST) or ``"mlp"``
    (features -> 128 -> classes, ReLU)."""

    def __init__(self, name: str, features: int, classes: int) -> None:
        if name not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {name!r}")
        self.name, self.features, self.classes = name, int(features), int(classes)

    def __call__(self) -> nn.Module:
        if self.name == "logreg":
            return nn.Linear(self.features, self.classes)
        return nn.Sequential(nn.Linear(self.features, 128), nn.ReLU(), nn.Linear(128, self.classes))


def simulate_mnist(
    config: SimulationConfig,
    *,
    clients: int = 100,
    partition: str = "iid",
    model: str = "logreg",
    data_dir: str = "",
    split_seed: int = 12345,
    progress: bool = True,
    resume: bool = False,
) -> History:
    """Simulate ``config`` on MNIST split over ``clients`` clients.

    Args:
        partition: ``"iid"`` or ``"dirichlet:<alpha>"`` (label skew).
        model: ``"logreg"`` or ``"mlp"``.
        data_dir: MNIST IDX directory (else ``$FLWR_INCA_MNIST_DIR``, Hugging Face, or the
            scikit-learn digits, announced on stderr).
        split_seed: seed of the split (12345 is the Flower example's IID split).
        resume: continue the run recorded in ``config.output_dir`` (see :func:`simulate`).
    """
    data = load_mnist(data_dir, who="flwr-inca simulate")
    kind, _, arg = partition.partition(":")
    if kind == "iid" and not arg:
        parts = iid(data.x_train, data.y_train, clients, seed=split_seed)
    elif kind == "dirichlet" and arg:
        try:
            alpha = float(arg)
        except ValueError:
            raise ValueError(f"partition: bad Dirichlet alpha in {partition!r}") from None
        parts = dirichlet(data.x_train, data.y_train, clients, alpha, seed=split_seed)
    else:
        raise ValueError(f"partition must be 'iid' or 'dirichlet:<alpha>', got {partition!r}")
    factory = ModelFactory(model, data.features, data.classes)
    return simulate(factory, parts, (data.x_test, data.y_test), config, progress=progress, dataset=data.name,
                    resume=resume)
