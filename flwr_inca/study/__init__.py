"""Learning studies: IncA side by side with every alternative (``flwr-inca study mnist``)."""

from .mnist import DEFAULT_GRID, FULL_GRID, METHODS, TINY_GRID, StudyGrid, add_study_parser, run_study

__all__ = ["DEFAULT_GRID", "FULL_GRID", "METHODS", "TINY_GRID", "StudyGrid", "add_study_parser", "run_study"]
