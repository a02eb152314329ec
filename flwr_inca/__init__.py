"""flwr-inca: IncA, differentially private and dropout-robust decentralized averaging, for Flower.

Quick start::

    import numpy as np
    from flwr_inca import IncaConfig, run_inca

    x = np.random.default_rng(0).random((100, 8))           # 100 parties, 8-dim values
    result = run_inca(x, IncaConfig(iterations=20, sigma_star=0.05, sigma_delta=1.0), seed=0)
    result.estimate                                          # (8,) private mean
    result.trace.save("trace.json")                          # what happened, no private value
"""

from . import _logging

_logging.install()  # importing Opacus later must not configure the root logger

from .protocol import (
    EdgeSchedule,
    ExecutionTrace,
    IncaConfig,
    IncaResult,
    InjectionSchedule,
    MarkovDropout,
    NoDropout,
    PermanentDropout,
    RandomNeighbors,
    ScheduledDropout,
    StaticTopology,
    TemporaryDropout,
    replay,
    run_inca,
)

__version__ = "0.1.0"

__all__ = [
    "IncaConfig", "IncaResult", "run_inca", "replay", "ExecutionTrace", "InjectionSchedule",
    "RandomNeighbors", "StaticTopology", "EdgeSchedule",
    "NoDropout", "PermanentDropout", "TemporaryDropout", "MarkovDropout", "ScheduledDropout",
    "__version__",
]
