"""Learning studies: IncA side by side with every alternative (``flwr-inca study mnist``)."""

from .mnist import DEFAULT_GRID, FULL_GRID, METHODS, TINY_GRID, StudyGrid, add_study_parser, run_study

__all__ = ["StudyGrid", "DEFAULT_GRID", "FULL_GRID", "TINY_GRID", "METHODS", "run_study", "add_study_parser"]
