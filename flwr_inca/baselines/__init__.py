"""Baselines IncA is compared with, behind one interface (pure NumPy/SciPy; no Flower, no Ray).

Every baseline has ``run(x, seed) -> BaselineResult``; those whose adversary view is linear-Gaussian
(IncA, GOPA, CorDP-DME, local DP, Muffliato, DP gossip) also expose that view as an
``ObservationModel``, so one exact certificate calibrates all of them::

    from flwr_inca.baselines import GOPA, Threat, calibrate_baseline, measure_mse

    gopa = GOPA(sigma_star=1.0, sigma_delta=1.0, neighbors=20, gamma=0.1, gamma_rollback=0.025)
    cal = calibrate_baseline(gopa, 200, 0.2, 1e-5, Threat.collusion(0.1), runs=50)
    measure_mse(cal["exact"].apply(gopa), 200, runs=100).mse
"""

from .base import Baseline, BaselineResult, LinearGaussianBaseline, OutputWeights, Threat, random_corrupted
from .calibration import (
    MseMeasurement,
    NoiseCalibration,
    ViewSample,
    calibrate_baseline,
    calibrate_samples,
    measure_mse,
    sample_views,
)
from .gaussian import CentralDP, LocalDP, gaussian_mu, gaussian_sigma
from .gossip import (
    DPGossip,
    GossipExecution,
    GossipView,
    Muffliato,
    gossip,
    gossip_matrix,
    graph_adjacency,
    max_degree,
    muffliato_iterations,
    muffliato_sigma,
    noisy_gossip_step,
    pndp_mean_privacy_loss,
    rdp_to_dp_epsilon,
)
from .inca import IncaBaseline
from .pairwise import GOPA, CorDPDME, PairwiseExecution, pairwise_model

__all__ = [
    "GOPA",
    "Baseline",
    "BaselineResult",
    "CentralDP",
    "CorDPDME",
    "DPGossip",
    "GossipExecution",
    "GossipView",
    "IncaBaseline",
    "LinearGaussianBaseline",
    "LocalDP",
    "MseMeasurement",
    "Muffliato",
    "NoiseCalibration",
    "OutputWeights",
    "PairwiseExecution",
    "Threat",
    "ViewSample",
    "calibrate_baseline",
    "calibrate_samples",
    "gaussian_mu",
    "gaussian_sigma",
    "gossip",
    "gossip_matrix",
    "graph_adjacency",
    "max_degree",
    "measure_mse",
    "muffliato_iterations",
    "muffliato_sigma",
    "noisy_gossip_step",
    "pairwise_model",
    "pndp_mean_privacy_loss",
    "random_corrupted",
    "rdp_to_dp_epsilon",
    "sample_views",
]
