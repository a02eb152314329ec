"""Re-measure the paper's figures: ``flwr-inca reproduce fig1|fig2|fig3a|fig3b|fig5|all``, and map IncA's
communication-accuracy frontier under dropouts: ``flwr-inca reproduce frontier`` (not part of ``all``: hours at
its default scale, see :mod:`flwr_inca.reproduce.frontier`).

Each figure writes ``<out>/<figure>.csv`` (every number plotted), ``<out>/<figure>.png`` and ``.svg``
(needs matplotlib) and ``<out>/<figure>.txt`` (the printed table and the paper's statements next to what was
measured), and returns a :class:`FigureResult`::

    from flwr_inca.reproduce import reproduce
    results = reproduce(["fig3b"], runs=20, out="outputs/reproduce", seed=0)
    print(results[0].checks_table())

``runs`` is the number of simulated runs per point: calibration runs *and* MSE runs for Figs. 1 and 3
(the paper: 1000 each), runs per (n, rho) for Fig. 2 (the paper: 1e5), per (k, T) for Fig. 5 (100).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import TextIO

from .._checks import check_bool, check_int, check_runs
from .._plots import have_matplotlib
from .common import Check, FigureResult, ProgressBar, single_blas_thread, write_csv

__all__ = ["DEFAULT_RUNS", "FIGURES", "FRONTIER_PROTOCOLS", "Check", "FigureResult", "reproduce"]


@dataclass(frozen=True)
class _Figure:
    """One figure: the module of this package that measures it, imported when the figure runs (naming the
    figures and their default runs, as the command line's help does, imports none)."""

    module: str
    runner: str  # the module's function (runs, seed, bar, **kwargs) -> FigureResult
    default_runs: int  # simulated runs per point when --runs is not given
    display: tuple[str, ...]
    shares_cache: bool = False
    in_all: bool = True  # run by "all" (the paper's figures)
    settings: bool = False  # takes settings (the frontier's grid: parties, epsilons, gammas, iterations, neighbors,
    # solver, protocols)
    work_name: str | None = None  # the name the module's work() takes first (one module, two figures)

    def _measures(self):
        return import_module(f"{__name__}.{self.module}")

    def run(self, runs: int, seed: int, bar: ProgressBar, **kwargs) -> FigureResult:
        return getattr(self._measures(), self.runner)(runs, seed, bar, **kwargs)

    def work(self, runs: int, **kwargs) -> int:
        work = self._measures().work
        return work(self.work_name, runs, **kwargs) if self.work_name else work(runs, **kwargs)


FIGURES: dict[str, _Figure] = {
    "fig1": _Figure("fig1", "run", 3,
                    ("rho", "n_honest", "cdp_classic", "ldp_classic", "muffliato_pndp_T8", "muffliato_pndp_T17",
                     "inca_formula_classic", "inca_formula_exact", "inca_paper_mse", "inca_exact_mse",
                     "inca_exact_alpha")),
    "fig2": _Figure("fig2", "run", 500,
                    ("n", "rho", "runs", "min_T_all_runs", "median_T", "p99_T", "T_estimate_these_runs",
                     "T_for_1e5_runs")),
    "fig3a": _Figure("fig3", "run_3a", 50,
                     ("protocol", "gamma", "procedure", "sigma_star", "sigma_delta", "alpha", "success_fraction",
                      "mse", "mse_stderr"), shares_cache=True, work_name="fig3a"),
    "fig3b": _Figure("fig3", "run_3b", 100,
                     ("protocol", "gamma", "procedure", "sigma_star", "sigma_delta", "alpha", "success_fraction",
                      "mse", "mse_stderr", "noise_lower_bound"), shares_cache=True, work_name="fig3b"),
    "fig5": _Figure("fig5", "run", 100,
                    ("threat", "k", "T", "messages", "precondition_success", "exact_floor_success")),
    # calibration runs: at n = 200 the worst-case sigma_delta keeps growing with R (by single runs, up to 17% from
    # 800 to 1600), while covering 99% of the runs is within 2% of its 1600-run value from 400 runs on
    # (benchmarks/bench_schedules.py "stability")
    "frontier": _Figure("frontier", "run", 400,
                        ("n", "epsilon", "gamma", "protocol", "T", "k_PR", "messages_per_party", "rounds",
                         "sigma_star", "sigma_delta", "alpha", "runs", "predicted_mse"), in_all=False, settings=True),
}
DEFAULT_RUNS = {name: f.default_runs for name, f in FIGURES.items()}
# the frontier's protocols, as its --protocols names them: IncA with D_Inc, IncA with the value-free tail, GOPA
# (every k_PR and gamma_2), CorDP-DME, and the two central-DP lines (closed form)
FRONTIER_PROTOCOLS = ("inca", "inca-tail", "gopa", "cordp-dme", "central-dp")


def reproduce(
    figures: Sequence[str],
    *,
    runs: int | None = None,
    out: str | Path = "outputs/reproduce",
    seed: int = 0,
    progress: bool = True,
    stream: TextIO | None = None,
    plots: bool = True,
    settings: Mapping[str, Sequence] | None = None,
    merge: Sequence[str | Path] | None = None,
) -> list[FigureResult]:
    """Reproduce ``figures`` (names of :data:`FIGURES`, or ``["all"]``: the paper's figures, not the
    frontier); see the module docstring.

    ``settings`` narrow the frontier's grid (:class:`flwr_inca.reproduce.frontier.Grid`: ``parties``,
    ``epsilons``, ``gammas``, ``iterations``, ``neighbors``, ``solver``, how IncA's runs are certified,
    ``protocols``, which of :data:`FRONTIER_PROTOCOLS` run, and ``target_success``, the share of each point's
    runs its noise certifies);
    the paper's figures take none. ``merge``: the
    frontier only, runs nothing: joins the ``frontier.csv`` files of earlier runs (pieces of its grid) and
    writes the frontier's outputs for all their points (:func:`flwr_inca.reproduce.frontier.merged`).

    Raises ``ValueError`` naming the bad argument (unknown figure, runs outside [1, MAX_RUNS], seed < 0, an
    ``out`` that is not a directory, settings for a figure that takes none or out of range).
    """
    names = [n for n, f in FIGURES.items() if f.in_all] if list(figures) == ["all"] else list(figures)
    unknown = [f for f in names if f not in FIGURES]
    if unknown or not names:
        raise ValueError(f"figure must be one of {', '.join(FIGURES)} or all, got {', '.join(unknown) or 'none'}")
    if runs is not None:
        check_runs("runs (--runs)", runs)
    check_int("seed (--seed)", seed, 0)
    check_bool("progress", progress)
    check_bool("plots", plots)
    if not isinstance(out, (str, Path)):
        raise ValueError(f"out (--out) must be a path, got {out!r}")  # noqa: TRY004 - one error type for bad arguments
    settings = {k: v for k, v in (settings or {}).items() if v is not None}
    if merge is not None and (names != ["frontier"] or settings or runs is not None):
        raise ValueError("--merge joins frontier CSVs: only with the frontier, and without --runs or grid settings")
    if settings:
        fixed = [f for f in names if not FIGURES[f].settings]
        if fixed:
            raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in settings)}: only the frontier takes "
                             "these settings, not "
                             f"{', '.join(fixed)}")
        from .frontier import Grid

        Grid.of(**settings)  # raises naming a bad setting before anything runs
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out (--out) must be a directory, got the file {out}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"out (--out): cannot create the directory {out}: {exc.strerror or exc}") from None
    stream = stream if stream is not None else sys.stdout
    plots = plots and _have_matplotlib(stream)
    if merge is not None:
        from .frontier import merged

        result = merged(merge)
        _write(result, FIGURES["frontier"].display, out, plots, stream)
        return [result]
    cache: dict = {}
    results = []
    with single_blas_thread():
        for name in names:
            fig = FIGURES[name]
            n_runs = runs if runs is not None else fig.default_runs
            kwargs = dict(settings) if fig.settings else {}
            bar = ProgressBar(fig.work(n_runs, **kwargs), name, enabled=progress)
            start = time.perf_counter()
            if fig.shares_cache:
                kwargs["cache"] = cache
            result = fig.run(n_runs, seed, bar, **kwargs)
            bar.close()
            result.seconds = time.perf_counter() - start
            _write(result, fig.display, out, plots, stream)
            results.append(result)
    return results


def _have_matplotlib(stream: TextIO) -> bool:
    if have_matplotlib():
        return True
    print("note: matplotlib is not installed (pip install matplotlib): CSV and tables only, no PNG",
          file=stream)
    return False


def _write(result: FigureResult, display: Sequence[str], out: Path, plots: bool, stream: TextIO) -> None:
    write_csv(result, out / f"{result.figure}.csv")
    figures: list[Path] = []
    if plots and result.plot is not None:
        png = out / f"{result.figure}.png"
        figures = result.plot(result, png) or [png]
    extra = result.write_extra(result, out) if result.write_extra is not None else []
    params = ", ".join(f"{k} = {v}" for k, v in result.params.items())
    lines = [f"== {result.title}", f"({params}; {result.seconds:.1f} s)", "", result.table(list(display)), "",
             result.checks_heading, result.checks_table()]
    lines += [f"note: {n}" for n in result.notes]
    written = [out / f"{result.figure}.csv", *figures, *(out / name for name in extra)]
    lines += ["", f"wrote {', '.join(str(w) for w in written)}"]
    text = "\n".join(lines)
    (out / f"{result.figure}.txt").write_text(text + "\n", encoding="utf-8")
    print(text + "\n", file=stream, flush=True)
