"""IncA core: the protocol's mathematics, with no dependency on Flower or Ray."""

from .config import IncaConfig
from .dissemination import Dissemination, ExactDissemination, PushSumGossip
from .dropout import (
    DropoutModel,
    MarkovDropout,
    NoDropout,
    PermanentDropout,
    ScheduledDropout,
    TemporaryDropout,
)
from .engine import IncaResult, replay, run_inca, sample_trace
from .noise import ExplicitNoise, NoiseSource, SeededNoise
from .schedules import InjectionSchedule, adapted_rows
from .topology import EdgeSchedule, Messages, RandomNeighbors, StaticTopology, Topology
from .trace import TRACE_FORMAT, ExecutionTrace, TraceStep

__all__ = [
    "IncaConfig", "IncaResult", "run_inca", "replay", "sample_trace",
    "InjectionSchedule", "adapted_rows",
    "Topology", "RandomNeighbors", "StaticTopology", "EdgeSchedule", "Messages",
    "DropoutModel", "NoDropout", "PermanentDropout", "TemporaryDropout", "MarkovDropout",
    "ScheduledDropout",
    "Dissemination", "ExactDissemination", "PushSumGossip",
    "NoiseSource", "SeededNoise", "ExplicitNoise",
    "ExecutionTrace", "TraceStep", "TRACE_FORMAT",
]
