"""What a simulation did, round by round: ``History``, its files and its plot."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._io import atomic_write_text
from .._json import dumps, float_from_json, jsonable
from .._plots import VECTOR_FORMAT, have_matplotlib, math_number, new_figure, paper_style, save_figure

__all__ = ["RoundRecord", "History", "HISTORY_FORMAT"]

HISTORY_FORMAT = "inca-simulation/1"


@dataclass
class RoundRecord:
    """One round (round 0 is the initial model: only its evaluation is filled in).

    ``mu`` is the round's cost for one protected unit (certified when ``certified``, else a
    prediction or bound, see ``cost``); ``charged_mu`` what the ledger was charged (``mu`` rounded up
    to the configured resolution); ``epsilon`` the composed epsilon after the round.

    ``failed`` says why the round did not change the model ("" if it did); ``refused`` marks a round the
    privacy budget refused (its execution certified too costly): it was skipped, the model kept, and
    charged what it revealed until it stopped (``charged_mu``; ``mu`` stays its cost in full).
    """

    round: int
    available: int = 0
    participants: int = 0
    finalists: int | None = None
    mu: float = 0.0
    charged_mu: float = 0.0
    certified: bool = False
    cost: str = ""
    epsilon: float = 0.0
    accuracy: float | None = None
    loss: float | None = None
    update_norm: float | None = None
    messages: float = 0.0  # messages a participant sent in the round's mixing, on average (mixer's RoundPlan)
    failed: str = ""
    refused: bool = False
    seconds: float = 0.0
    seconds_plan: float = 0.0  # sampling the execution and certifying it
    seconds_charge: float = 0.0  # the ledger (composition with the accountant)
    seconds_train: float = 0.0  # from starting local training to its results (overlaps seconds_plan)
    seconds_train_wait: float = 0.0  # of which the round waited for training after it was charged
    seconds_mix: float = 0.0
    seconds_eval: float = 0.0
    noise: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: an unbounded ``mu``/``epsilon`` is written ``"inf"`` (``flwr_inca._json``)."""
        return jsonable(asdict(self))


@dataclass
class History:
    """The simulation's record: configuration, privacy plan, one :class:`RoundRecord` per round.

    ``stopped`` says why training ended before ``config["rounds"]`` rounds ("" if it did not; a round
    refused by the budget and skipped does not end training, see :attr:`rounds_refused`);
    ``parameters`` is the final global model as a flat float32 vector.
    """

    config: dict[str, Any]
    plan: dict[str, Any]
    mixer: str
    backend: str
    dataset: str = ""
    records: list[RoundRecord] = field(default_factory=list)
    stopped: str = ""
    parameters: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)
    memory: dict[str, float] = field(default_factory=dict)  # peak MB: driver, actors

    # ------------------------------------------------------------------ views
    @property
    def rounds(self) -> list[RoundRecord]:
        """Training rounds (round 0, the initial evaluation, excluded)."""
        return [r for r in self.records if r.round > 0]

    @property
    def rounds_trained(self) -> int:
        """Rounds whose update was applied to the model."""
        return sum(1 for r in self.rounds if not r.failed)

    @property
    def rounds_refused(self) -> int:
        """Rounds the privacy budget refused and skipped (charged what they revealed; model unchanged)."""
        return sum(1 for r in self.rounds if r.refused)

    @property
    def epsilon(self) -> float:
        return self.rounds[-1].epsilon if self.rounds else 0.0

    @property
    def accuracy(self) -> float | None:
        """The last evaluated accuracy."""
        for r in reversed(self.records):
            if r.accuracy is not None:
                return r.accuracy
        return None

    def column(self, name: str) -> list[Any]:
        return [getattr(r, name) for r in self.records]

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": HISTORY_FORMAT,
            "dataset": self.dataset,
            "mixer": self.mixer,
            "backend": self.backend,
            "stopped": self.stopped,
            "notes": list(self.notes),
            "memory": dict(self.memory),
            "config": jsonable(self.config),
            "plan": jsonable(self.plan),
            "rounds": [r.to_dict() for r in self.records],
        }

    def to_json(self) -> str:
        return dumps(self.to_dict(), indent=1, default=str)

    def to_csv(self) -> str:
        names = [k for k in RoundRecord.__dataclass_fields__ if k != "noise"]
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(names)
        for r in self.records:
            row = r.to_dict()
            writer.writerow(["" if row[k] is None else row[k] for k in names])
        return buf.getvalue()

    def save(self, directory: str | Path, plot: bool = True) -> list[Path]:
        """Write ``history.json``, ``history.csv`` and (with matplotlib) ``accuracy_epsilon.png`` and ``.svg``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "history.json", self.to_json())
        atomic_write_text(out / "history.csv", self.to_csv())
        written = [out / "history.json", out / "history.csv"]
        if plot and self.plot(out / "accuracy_epsilon.png"):
            written += [out / "accuracy_epsilon.png", out / f"accuracy_epsilon.{VECTOR_FORMAT}"]
        return written

    def plot(self, path: str | Path) -> bool:
        """Accuracy and epsilon against rounds, to ``path`` (PNG) and the same name with ``.svg`` (False if
        matplotlib is not installed)."""
        if not have_matplotlib():
            return False
        from matplotlib.ticker import MaxNLocator

        with paper_style():
            fig, ax = new_figure(figsize=(6.4, 3.8))
            evald = [r for r in self.records if r.accuracy is not None and math.isfinite(r.accuracy)]
            ax.plot([r.round for r in evald], [r.accuracy for r in evald], marker="o", ms=3, label="test accuracy")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("round")
            ax.set_ylabel("test accuracy", color="tab:blue")
            spent = [r for r in self.records if math.isfinite(r.epsilon)]
            if spent and any(r.epsilon > 0 for r in spent):
                ax2 = ax.twinx()
                ax2.grid(False)
                ax2.plot([r.round for r in spent], [r.epsilon for r in spent], color="tab:red", ls="--",
                         label=r"$\varepsilon$ spent")
                ax2.set_ylabel(r"$\varepsilon$ spent (composed over the rounds)", color="tab:red")
                budget = self.plan.get("epsilon")  # the total budget of the privacy plan
                if isinstance(budget, (int, float)) and math.isfinite(budget):
                    ax2.axhline(budget, color="tab:red", lw=0.8, alpha=0.5, label=r"$\varepsilon$ budget")
                ax2.set_ylim(bottom=0)
                lines = [h for a in (ax, ax2) for h in a.get_legend_handles_labels()[0]]
                ax2.legend(lines, [h.get_label() for h in lines], loc="lower right")
            ax.set_title(self._plot_title())
            save_figure(fig, path, dpi=120)
        return True

    def _plot_title(self) -> str:
        """The mixer and data set, then delta and the first round's noise when the history has them."""
        title = f"{self.mixer.split(' (')[0]}, {self.dataset}"[:80]
        noise = next((r.noise for r in self.rounds if r.noise), {})
        symbols = (("sigma_star", r"\sigma^*"), ("sigma_delta", r"\sigma_\Delta"), ("noise_multiplier", "z"))
        known = [f"${symbol} = {noise[key]:.3g}$" for key, symbol in symbols
                 if isinstance(noise.get(key), (int, float)) and math.isfinite(noise[key])]
        delta = self.plan.get("delta")
        if isinstance(delta, float) and 0 < delta < 1:
            known.insert(0, f"$\\delta = {math_number(delta)}$")
        return title + ("\n" + ", ".join(known) + (" (round 1)" if len(known) > 1 else "") if known else "")

    @classmethod
    def load(cls, path: str | Path) -> History:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if data.get("format") != HISTORY_FORMAT:
            raise ValueError(f"{path}: format must be {HISTORY_FORMAT!r}")
        records = []
        for row in data["rounds"]:
            row = {k: _dec(v) for k, v in row.items()}
            records.append(RoundRecord(**row))
        return cls(
            data["config"],
            data["plan"],
            data["mixer"],
            data["backend"],
            data.get("dataset", ""),
            records,
            data.get("stopped", ""),
            None,
            data.get("notes", []),
            data.get("memory", {}),
        )


def _dec(v: Any) -> Any:
    if isinstance(v, str) and v in ("inf", "-inf", "nan"):
        return float_from_json(v, "history value")
    if isinstance(v, dict):
        return {k: _dec(x) for k, x in v.items()}
    return v
