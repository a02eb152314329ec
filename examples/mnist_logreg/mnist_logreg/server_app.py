"""ServerApp: IncaStrategy instead of FedAvg; the server only relays encrypted peer messages."""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from flwr_inca.flower import IncaStrategy

from .task import accuracy, load_config, load_data, make_model, privacy_plan

app = ServerApp()


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


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = load_config(context.run_config)
    data = load_data(cfg["data-dir"])
    nodes = _wait_for_nodes(grid)
    plan = privacy_plan(cfg, len(data.y_train) // nodes)
    out = Path(cfg["output-dir"]).resolve() / f"mnist_logreg-{cfg['privacy-unit']}"
    record = cfg["privacy-unit"] == "record"
    strategy = IncaStrategy(
        fraction_train=1.0, min_train_nodes=nodes, min_available_nodes=nodes, fraction_evaluate=0.0,
        iterations=int(cfg["iterations"]), neighbors=int(cfg["neighbors"]),
        epsilon=plan["epsilon_round"], delta=float(cfg["delta"]), max_epsilon=float(cfg["epsilon"]),
        clip_norm=plan["party_clip"], value_sensitivity=plan["value_sensitivity"],
        sample_rate=plan["sample_rate"], accountant="prv" if record else "gdp",
        collusion=float(cfg["collusion"]), ledger_path=out / "inca_ledger.json", trace_dir=out / "traces",
        seed=int(cfg["seed"]),
    )
    model = make_model(data.features)
    history: list[dict] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = accuracy(model, data.x_test, data.y_test)
        history.append({"round": server_round, "accuracy": acc, "loss": loss})
        return MetricRecord({"accuracy": acc, "loss": loss})

    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                            num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=evaluate)
    for row in history:
        metrics = result.train_metrics_clientapp.get(row["round"])
        row["epsilon"] = float(metrics["inca-epsilon"]) if metrics else 0.0
        row["finalists"] = int(metrics["inca-finalists"]) if metrics else 0
    summary = {"dataset": data.name, "nodes": nodes, "config": cfg, "plan": plan,
               "sigma_star": strategy.rounds[1].trace.sigma_star if strategy.rounds else None,
               "sigma_delta": strategy.rounds[1].trace.sigma_delta if strategy.rounds else None,
               "history": history}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"\n{data.name}, {nodes} nodes, {cfg['privacy-unit']}-level DP, target ({cfg['epsilon']}, "
          f"{cfg['delta']}), {cfg['collusion']:.0%} colluders")
    print(f"{'round':>5} {'accuracy':>9} {'epsilon':>8}")
    for row in history:
        print(f"{row['round']:>5} {row['accuracy']:>9.4f} {row['epsilon']:>8.3f}")
    _plot(history, out / "accuracy_epsilon.png")
    print(f"results in {out}")


def _plot(history: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rounds = [h["round"] for h in history]
    ax.plot(rounds, [h["accuracy"] for h in history], marker="o", ms=3, label="test accuracy")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax2 = ax.twinx()
    ax2.plot(rounds, [h["epsilon"] for h in history], color="tab:red", ls="--", label="epsilon spent")
    ax2.set_ylabel("epsilon (composed)", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
