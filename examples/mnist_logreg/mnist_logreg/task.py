"""Data, model, local training and configuration of the MNIST logistic-regression example.

Data (``flwr_inca.simulation.data``, shared with ``flwr-inca simulate``), in order of preference:
1. a local directory with the four original MNIST IDX files (``*-idx?-ubyte.gz``), given as
   ``data-dir`` in the run config or the ``FLWR_INCA_MNIST_DIR`` environment variable;
2. MNIST from Hugging Face through ``flwr-datasets`` (needs ``pip install flwr-datasets`` and network);
3. scikit-learn's bundled 8x8 digits (offline fallback, announced on stderr).

The privacy plan (per-round target from the total budget) is ``flwr_inca.privacy.plan``, also shared
with the simulator.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from flwr_inca.privacy.plan import privacy_plan as _privacy_plan
from flwr_inca.simulation.data import Dataset
from flwr_inca.simulation.data import load_mnist as load_data  # noqa: F401  (cached; .cache_clear())
from flwr_inca.simulation.partitions import iid

DEFAULTS: dict[str, Any] = {
    "num-server-rounds": 40,
    "num-partitions": 20,  # used by the plain Python entry point; `flwr run` uses the federation's nodes
    "privacy-unit": "record",  # "record" (DP-SGD-like, per example) or "party" (a node's whole update)
    "epsilon": 1.0,  # total budget over all rounds
    "delta": 1e-5,
    "iterations": "auto",  # IncA mixing iterations per round: chosen for expected-dropout, or a number
    "expected-dropout": 0.0,  # fraction of the nodes expected to drop out during a round
    "neighbors": 1,
    "collusion": 0.1,  # fraction of colluding nodes the guarantee holds against
    "lr": 6.0,  # record level: the one DP step per round
    "party-lr": 0.06,  # party level: local SGD
    "clip-norm": 1.0,  # record-level: per-example clip; party-level: clip of a node's update
    "batch-size": 50,  # record-level: expected Poisson batch per node and round
    "local-epochs": 1,  # party-level local training
    "data-dir": "",
    "output-dir": "outputs",
    "seed": 0,
}
HELP: dict[str, str] = {  # one line per key: `run.py --help` and the README's table say the same
    "num-server-rounds": "training rounds, >= 1",
    "num-partitions": "simulated nodes (SuperNodes), >= 2",
    "privacy-unit": "record: one training example (per-example clipping, Poisson sampling, one local DP "
                    "step per round); party: a node's whole update",
    "epsilon": "total privacy budget over all rounds, > 0 (the per-round target is derived from it)",
    "delta": "delta of the budget, in (0, 1)",
    "iterations": "IncA mixing iterations per round: 'auto' (the fewest of 10, 20, 40 leaving at most a quarter "
                  "of the central noise uncancelled by the expected dropouts; 10 without) or an integer >= 1",
    "expected-dropout": "fraction of the nodes expected to drop out during a round, in [0, 0.8): the noise is "
                        "calibrated, and T chosen, for it (every round is still certified on what happened)",
    "neighbors": "peers each node sends to per mixing iteration, >= 1",
    "collusion": "fraction of colluding nodes the guarantee is certified against, in [0, 1)",
    "lr": "record level: learning rate of the round's step -lr * sum(clip(g)) / batch-size, > 0",
    "party-lr": "party level: learning rate of the local SGD (minibatches of 32), > 0",
    "clip-norm": "record level: per-example gradient clip; party level: clip of a node's update; > 0",
    "batch-size": "record level: expected Poisson sample per node and round, >= 1",
    "local-epochs": "party level: local epochs per round, >= 1",
    "data-dir": "directory of the 4 MNIST IDX .gz files ('': $FLWR_INCA_MNIST_DIR, else Hugging Face, "
                "else scikit-learn's 8x8 digits)",
    "output-dir": "where results go: <output-dir>/mnist_logreg-<privacy-unit>/ holds the ledger and a "
                  "run-<time>/ folder per run",
    "seed": "seed of the server's certification draws, >= 0",
}
ENV_CONFIG = "FLWR_INCA_EXAMPLE_CONFIG"  # JSON overrides, used by the plain Python entry point


class ConfigError(ValueError):
    """A run-config value outside its allowed range; the message names the key and the range."""


def _number(low: float, high: float | None = None, low_open: bool = True, high_open: bool = True,
            integer: bool = False) -> tuple[Any, str]:
    def ok(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
            return False
        if not math.isfinite(v) or (v <= low if low_open else v < low):
            return False
        return high is None or (v < high if high_open else v <= high)

    if integer:
        allowed = f"an integer >= {int(low)}"
    elif high is None:
        allowed = f"a number {'>' if low_open else '>='} {low:g}"
    else:
        allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    return ok, allowed


_RULES: dict[str, tuple[Any, str]] = {
    "num-server-rounds": _number(1, low_open=False, integer=True),
    "num-partitions": _number(2, low_open=False, integer=True),
    "privacy-unit": (lambda v: v in ("record", "party"), "'record' or 'party'"),
    "epsilon": _number(0),
    "delta": _number(0, 1),
    "iterations": (lambda v: v == "auto" or _number(1, low_open=False, integer=True)[0](v),
                   "'auto' or an integer >= 1"),
    "expected-dropout": _number(0, 0.8, low_open=False),
    "neighbors": _number(1, low_open=False, integer=True),
    "collusion": _number(0, 1, low_open=False),
    "lr": _number(0),
    "party-lr": _number(0),
    "clip-norm": _number(0),
    "batch-size": _number(1, low_open=False, integer=True),
    "local-epochs": _number(1, low_open=False, integer=True),
    "data-dir": (lambda v: isinstance(v, str) and (v == "" or Path(v).is_dir()),
                 "'' or an existing directory holding the 4 MNIST IDX .gz files"),
    "output-dir": (lambda v: isinstance(v, str) and v != "", "a non-empty path"),
    "seed": _number(0, low_open=False, integer=True),
}


_INTEGER_KEYS = frozenset(k for k, v in DEFAULTS.items() if isinstance(v, int)) | {"iterations"}


def validate_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Check every key against its allowed range before anything starts; raises :class:`ConfigError`
    naming the first bad key. Returns ``cfg`` with integer keys as ``int``."""
    for key, (ok, allowed) in _RULES.items():
        if key in cfg and not ok(cfg[key]):
            raise ConfigError(f"{key} must be {allowed}, got {cfg[key]!r}")
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(unknown)}; known: {', '.join(DEFAULTS)}")
    return {k: (int(v) if k in _INTEGER_KEYS and v != "auto" else v) for k, v in cfg.items()}


def load_config(run_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Defaults, overridden by ``$FLWR_INCA_EXAMPLE_CONFIG`` (JSON), overridden by the run config;
    validated (:class:`ConfigError` names a bad key and its allowed range)."""
    cfg = dict(DEFAULTS)
    cfg.update(json.loads(os.environ.get(ENV_CONFIG, "{}")))
    cfg.update(dict(run_config or {}))
    return validate_config(cfg)


def iterations_option(text: str) -> int | str:
    """``--iterations`` of ``run.py``: 'auto' or an integer (range checked with the other keys)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        return text  # validate_config names the key and what it allows


def expected_dropout(cfg: dict[str, Any]):
    """The dropout model the strategy calibrates for (None: no dropouts expected)."""
    from flwr_inca.protocol import PermanentDropout

    return PermanentDropout(float(cfg["expected-dropout"])) if cfg["expected-dropout"] > 0 else None


def partition(data: Dataset, partition_id: int, num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """IID split of the training set: partition ``partition_id`` of ``num_partitions`` (the same split
    as ``flwr_inca.simulation.iid`` with its default seed)."""
    part = iid(data.x_train, data.y_train, num_partitions).indices[partition_id]
    return data.x_train[part], data.y_train[part]


# ----------------------------------------------------------------------------------------- model
def make_model(features: int) -> nn.Module:
    return nn.Linear(features, 10)


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        loss = nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()
        acc = (logits.argmax(1).numpy() == y).mean()
    return float(loss), float(acc)


def train_party_level(model: nn.Module, x: np.ndarray, y: np.ndarray, epochs: int, lr: float,
                      seed: int) -> None:
    """Plain local SGD (minibatches of 32); the node's whole update is clipped by IncaClient."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=gen).split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xt[batch]), yt[batch]).backward()
            opt.step()


def dp_step_record_level(model: nn.Module, x: np.ndarray, y: np.ndarray, lr: float, clip: float,
                         batch_size: int, rng: np.random.Generator) -> int:
    """One local DP-SGD step without local noise (IncA adds the noise, across nodes).

    Poisson-samples each local example with rate ``batch_size / len(y)``, then
    :func:`clipped_step`. Returns the sampled batch size.
    """
    q = min(1.0, batch_size / len(y))
    mask = rng.random(len(y)) < q
    if mask.any():
        clipped_step(model, x[mask], y[mask], lr, clip, batch_size)
    return int(mask.sum())


def clipped_step(model: nn.Module, x: np.ndarray, y: np.ndarray, lr: float, clip: float,
                 batch_size: int) -> None:
    """``-lr * sum_i clip(grad_i) / batch_size`` over the given examples, per-example gradients from
    Opacus. Adding or removing one example changes the step by at most ``lr * clip / batch_size``."""
    from opacus import GradSampleModule

    gsm = GradSampleModule(model)
    gsm.zero_grad()
    loss = nn.functional.cross_entropy(gsm(torch.from_numpy(x)), torch.from_numpy(y), reduction="sum")
    with warnings.catch_warnings():  # Opacus's hook on a model whose inputs need no gradient: harmless
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    per_example = torch.cat([p.grad_sample.reshape(p.grad_sample.shape[0], -1) for p in params], dim=1)
    factor = (clip / (per_example.norm(dim=1) + 1e-12)).clamp(max=1.0)
    with torch.no_grad():
        for p in params:
            summed = torch.einsum("i,i...->...", factor, p.grad_sample)
            p -= lr * summed / batch_size
            p.grad_sample = None
    gsm._close()


# ----------------------------------------------------------------------------------------- privacy
def privacy_plan(cfg: dict[str, Any], local_size: int) -> dict[str, float]:
    """Per-round target and sensitivities for a total (epsilon, delta) over the rounds
    (``flwr_inca.privacy.plan.privacy_plan``; record level: PRV accountant, party level: GDP).

    Raises :class:`ConfigError` naming epsilon when no per-round target reaches the budget (Opacus's
    own message, "The privacy budget is too low", names none)."""
    try:
        plan = _privacy_plan(cfg["privacy-unit"], epsilon=float(cfg["epsilon"]), delta=float(cfg["delta"]),
                             rounds=int(cfg["num-server-rounds"]), clip_norm=float(cfg["clip-norm"]),
                             lr=float(cfg["lr"]), batch_size=int(cfg["batch-size"]), local_size=local_size)
    except ValueError as exc:
        if "too low" not in str(exc):  # Opacus: no noise multiplier reaches the budget
            raise ConfigError(str(exc)) from exc
        raise ConfigError(
            f"epsilon = {cfg['epsilon']:g} is too small for {cfg['num-server-rounds']} rounds at delta = "
            f"{cfg['delta']:g} ({exc}): raise epsilon, or lower num-server-rounds (or, record level, "
            "batch-size)") from exc
    return {"sample_rate": plan.sample_rate, "mu_round": plan.mu_round, "epsilon_round": plan.epsilon_round,
            "value_sensitivity": plan.value_sensitivity, "party_clip": plan.party_clip}


def describe_plan(cfg: dict[str, Any], plan: dict[str, float], nodes: int) -> str:
    """One line: the user's settings, then what was derived from them for each round."""
    record = cfg["privacy-unit"] == "record"
    mine = (f"{nodes} nodes, {cfg['privacy-unit']}-level DP, total budget ({cfg['epsilon']:g}, "
            f"{cfg['delta']:g}) over {cfg['num-server-rounds']} rounds against {cfg['collusion']:.0%} "
            f"colluders, clip-norm {cfg['clip-norm']:g}")
    if record:
        mine += f", lr {cfg['lr']:g}, batch-size {cfg['batch-size']:g}"
        derived = (f"each example is sampled with rate q = {plan['sample_rate']:.4g} and moves a node's step "
                   f"by at most lr * clip-norm / batch-size = {plan['value_sensitivity']:.4g} (the value "
                   f"sensitivity), so IncA is calibrated for mu = {plan['mu_round']:.4g}, i.e. "
                   f"({plan['epsilon_round']:.3g}, {cfg['delta']:g})-DP per round before subsampling "
                   f"(Opacus's PRV accountant composes the {cfg['num-server-rounds']} subsampled rounds to the "
                   f"budget); a node's whole update is clipped at {plan['party_clip']:.4g}, a guard far above "
                   "any honest step")
    else:
        mine += f", party-lr {cfg['party-lr']:g}, local-epochs {cfg['local-epochs']}"
        derived = (f"a node's update is clipped to clip-norm, so replacing its data moves it by at most "
                   f"{plan['value_sensitivity']:.4g}; rounds compose as GDP, so each round is calibrated "
                   f"for mu = {plan['mu_round']:.4g}, i.e. ({plan['epsilon_round']:.3g}, {cfg['delta']:g})-DP")
    return f"{mine}. Per round: {derived}."
