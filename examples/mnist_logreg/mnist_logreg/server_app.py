"""ServerApp: IncaStrategy instead of FedAvg; the server only relays encrypted peer messages."""

from __future__ import annotations

import json
import sys
import time
from logging import ERROR, INFO
from pathlib import Path

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from flwr_inca._plots import have_matplotlib, new_figure, paper_style, save_figure
from flwr_inca._progress import ProgressBar
from flwr_inca.flower import IncaBudgetExhausted, IncaStrategy
from flwr_inca.privacy.session import BudgetExhausted

from .task import (accuracy, describe_plan, expected_dropout, load_config, load_data, make_model,
                   privacy_plan)

app = ServerApp()
BUDGET_STOPS: list[str] = []  # why training stopped early, one line each (python -m mnist_logreg.run exits 1)


def _wait_for_nodes(grid: Grid, settle: float = 2.0) -> int:
    """Number of connected nodes, once it stops changing for ``settle`` seconds."""
    count, since = -1, time.monotonic()
    while True:
        now = len(list(grid.get_node_ids()))
        if now != count:
            count, since = now, time.monotonic()
        elif count >= 2 and time.monotonic() - since >= settle:
            return count
        time.sleep(0.1)


def output_paths(cfg: dict) -> tuple[Path, Path]:
    """``(ledger, run_dir)``: one ledger per output directory and privacy unit, shared by every run on
    purpose (the budget spent by earlier runs counts), and a new folder per run, so a run never
    overwrites the results of another. The folder is created only once a round has run."""
    base = Path(cfg["output-dir"]).resolve() / f"mnist_logreg-{cfg['privacy-unit']}"
    stamp = time.strftime("run-%Y%m%d-%H%M%S")
    run_dir, n = base / stamp, 1
    while run_dir.exists():
        n += 1
        run_dir = base / f"{stamp}-{n}"
    return base / "inca_ledger.json", run_dir


def make_strategy(cfg: dict, plan: dict, nodes: int, ledger: Path, trace_dir: Path | None) -> IncaStrategy:
    """The app's strategy for ``nodes`` nodes (also built before Flower starts, to check the ledger)."""
    return IncaStrategy(
        fraction_train=1.0, min_train_nodes=nodes, min_available_nodes=nodes, fraction_evaluate=0.0,
        iterations=cfg["iterations"], dropout=expected_dropout(cfg), neighbors=cfg["neighbors"],
        max_epsilon=float(cfg["epsilon"]), delta=float(cfg["delta"]),  # the rounds share it: calibrated per round
        clip_norm=plan["party_clip"], value_sensitivity=plan["value_sensitivity"],
        sample_rate=plan["sample_rate"],  # the accountant follows: Opacus's PRV if < 1, else exact GDP
        collusion=float(cfg["collusion"]), ledger_path=ledger, trace_dir=trace_dir, seed=cfg["seed"],
    )


def check_ledger(cfg: dict, plan: dict, nodes: int) -> str | None:
    """Before Flower starts: the one-line refusal the first round would end with when the ledger that
    earlier runs with this output-dir share has no room for it (None: it has, or there is no ledger yet)."""
    ledger, _ = output_paths(cfg)
    if not ledger.exists():
        return None
    try:
        make_strategy(cfg, plan, nodes, ledger, None).check_round(1, nodes, num_rounds=cfg["num-server-rounds"])
    except BudgetExhausted as stop:
        return _budget_message(stop, ledger, 0, 0, cfg["num-server-rounds"], None)
    return None


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = load_config(context.run_config)  # ConfigError names a bad key before anything starts
    data = load_data(cfg["data-dir"])
    nodes = _wait_for_nodes(grid)
    plan = privacy_plan(cfg, len(data.y_train) // nodes)
    ledger, run_dir = output_paths(cfg)
    log(INFO, "mnist_logreg: %s", describe_plan(cfg, plan, nodes))
    strategy = make_strategy(cfg, plan, nodes, ledger, run_dir / "traces")
    model = make_model(data.features)
    history: list[dict] = []
    rounds = cfg["num-server-rounds"]
    progress = ProgressBar(rounds, "mnist_logreg", lines=True)  # one line per round, between Flower's logs

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = accuracy(model, data.x_test, data.y_test)
        history.append({"round": server_round, "accuracy": acc, "loss": loss})
        if server_round > 0:
            eps = strategy.privacy_spent().epsilon
            progress.advance(status=f"round {server_round}/{rounds}: accuracy {acc:.4f}, epsilon {eps:.3f}")
        return MetricRecord({"accuracy": acc, "loss": loss})

    stopped: IncaBudgetExhausted | None = None
    try:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds,
                       evaluate_fn=evaluate)
    except IncaBudgetExhausted as exc:  # raised before the round that would overspend; nothing is lost
        stopped = exc
    for row in history:
        metrics = strategy.train_metrics_serverapp.get(row["round"])
        row["epsilon"] = float(metrics["inca-epsilon"]) if metrics else 0.0
        row["finalists"] = int(metrics["inca-finalists"]) if metrics else 0
    ran = len(strategy.train_metrics_serverapp)  # rounds that mixed (a refused round is charged, not applied)
    if ran:
        _report(cfg, data.name, nodes, plan, strategy, history, run_dir, stopped)
    if "digits" in data.name:  # said when the data was loaded, and again here, where it cannot be missed
        print(f"note: {_DIGITS_NOTE}", file=sys.stderr)
    if stopped is not None:  # one line naming the budget and the ledger; the results so far are kept
        message = _budget_message(stopped, ledger, ran, strategy.rounds_refused, rounds, run_dir if ran else None)
        BUDGET_STOPS.append(message)
        log(ERROR, "%s", message)


_DIGITS_NOTE = ("this run used scikit-learn's 8x8 digits, not MNIST (no data-dir or FLWR_INCA_MNIST_DIR, and "
                "Hugging Face unreachable): its accuracy is not comparable with the README's table")


def _budget_message(stop: BudgetExhausted, ledger: Path, ran: int, refused: int, rounds: int,
                    run_dir: Path | None) -> str:
    skipped = f", {refused} of them skipped: refused by the budget, charged, model unchanged" if refused else ""
    done = (f"{ran} of {rounds} rounds ran{skipped} (results in {run_dir})" if ran
            else "No round ran and no results were written")
    return (f"privacy budget spent: {stop}. {done}. The ledger {ledger} holds the privacy already spent by "
            f"earlier runs with this output-dir (epsilon = {stop.epsilon:.4g} of {stop.max_epsilon:g}). To start "
            f"afresh, delete it (rm {ledger}) or use another output-dir; to train more on the same data, "
            "raise epsilon (the total budget).")


def _report(cfg: dict, dataset: str, nodes: int, plan: dict, strategy: IncaStrategy, history: list[dict],
            run_dir: Path, stopped: IncaBudgetExhausted | None) -> None:
    first = min(strategy.rounds)
    summary = {"dataset": dataset, "nodes": nodes, "config": cfg, "plan": plan,
               "sigma_star": strategy.rounds[first].trace.sigma_star if strategy.rounds[first].trace else None,
               "sigma_delta": strategy.rounds[first].trace.sigma_delta if strategy.rounds[first].trace else None,
               "stopped": None if stopped is None else str(stopped), "history": history}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"\n{dataset}, {nodes} nodes, {cfg['privacy-unit']}-level DP, target ({cfg['epsilon']}, "
          f"{cfg['delta']}), {cfg['collusion']:.0%} colluders")
    print(f"{'round':>5} {'accuracy':>9} {'epsilon':>8}")
    for row in history:
        print(f"{row['round']:>5} {row['accuracy']:>9.4f} {row['epsilon']:>8.3f}")
    _plot(history, run_dir / "accuracy_epsilon.png")
    print(f"results in {run_dir}")


def _plot(history: list[dict], path: Path) -> None:
    """Test accuracy and the epsilon spent against rounds: ``path`` (PNG) and the same name with ``.svg``."""
    if not have_matplotlib():  # optional: the results are in results.json either way
        return
    with paper_style():
        fig, ax = new_figure(figsize=(6, 3.5))
        rounds = [h["round"] for h in history]
        ax.plot(rounds, [h["accuracy"] for h in history], marker="o", ms=3, label="test accuracy")
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy", color="tab:blue")
        ax2 = ax.twinx()
        ax2.grid(False)
        ax2.plot(rounds, [h["epsilon"] for h in history], color="tab:red", ls="--", label=r"$\varepsilon$ spent")
        ax2.set_ylabel(r"$\varepsilon$ spent (composed over the rounds)", color="tab:red")
        lines = ax.get_lines() + ax2.get_lines()
        ax2.legend(lines, [line.get_label() for line in lines], loc="lower right")
        save_figure(fig, path, dpi=120)
