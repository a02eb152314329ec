"""Learning studies: IncA side by side with every alternative (``flwr-inca study mnist``).

``grid`` (what a study runs), ``mnist`` (the runs and the study's steps), ``runs`` (its record of runs,
``runs.csv``), ``report`` (summary, tables, plots), ``command`` (the command line).
"""

from .command import add_study_parser
from .grid import DEFAULT_GRID, FULL_GRID, METHODS, TINY_GRID, StudyGrid
from .mnist import run_study

__all__ = ["DEFAULT_GRID", "FULL_GRID", "METHODS", "TINY_GRID", "StudyGrid", "add_study_parser", "run_study"]
