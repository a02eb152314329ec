"""p2pfl 0.4.4 on MNIST logistic regression, for the side-by-side in ``bench_simulation.py p2pfl``.

Runs in p2pfl's own virtual environment (its pins conflict with ours), set up as::

    python3 -m venv /work/venvs/p2pfl && . /work/venvs/p2pfl/bin/activate
    pip install "torch==2.13.0" p2pfl==0.4.4 lightning==2.6.6 torchmetrics==1.9.0 opendp==0.16.0 \\
        pyarrow==16.1.0 huggingface-hub==0.24.7 && pip uninstall -y torchvision
    python benchmarks/bench_p2pfl.py --nodes 10 --rounds 3 --data-dir /path/to/mnist

The same task as the simulator's side: 784 -> 10 logistic regression, SGD lr 0.1, batch 64, one local
epoch, the 60,000 training images split IID over the nodes, every node trains every round, in-memory
protocol, full topology, no DP (p2pfl has local DP only, without accounting). torchvision is only
imported by p2pfl; a stand-in module replaces it (the index's build fails to import with torch 2.13).
Prints ``RESULT{json}``: seconds per round (from node 0's round counter) and the test accuracy of every
node's final model on the 10,000 test images.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

_STUB = (
    "class _Missing:\n    def __init__(self, *a, **k):\n"
    "        raise RuntimeError('torchvision stand-in')\n\n"
    "def __getattr__(name):\n    return _Missing\n"
)
STAND_IN = {
    "__init__.py": "__version__ = '0.0'\nfrom . import datasets, transforms, models, ops, utils, io\n"
    + _STUB,
    **{f"{m}.py": _STUB for m in ("datasets", "transforms", "ops", "utils", "io")},
    "models/__init__.py": "from . import feature_extraction\n" + _STUB,
    "models/feature_extraction.py": _STUB,
}


def _stand_in_torchvision() -> None:
    root = Path(tempfile.mkdtemp(prefix="tv-stand-in-"))
    (root / "torchvision" / "models").mkdir(parents=True)
    for name, text in STAND_IN.items():
        (root / "torchvision" / name).write_text(text)
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = f"{root}:{os.environ.get('PYTHONPATH', '')}"  # for Ray workers too


def _idx(path: Path) -> np.ndarray:
    data = gzip.open(path, "rb").read()
    magic, count = struct.unpack_from(">II", data)
    if magic == 2049:
        return np.frombuffer(data, dtype=np.uint8, offset=8).astype(np.int64)
    return np.frombuffer(data, dtype=np.uint8, offset=16).reshape(count, -1)


def _mnist(directory: str):
    d = Path(directory)

    def images(name):
        return ((_idx(d / f"{name}-images-idx3-ubyte.gz").astype(np.float32) / 255.0) - 0.1307) / 0.3081

    return (
        images("train"),
        _idx(d / "train-labels-idx1-ubyte.gz"),
        images("t10k"),
        _idx(d / "t10k-labels-idx1-ubyte.gz"),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data-dir", default=os.environ.get("FLWR_INCA_MNIST_DIR", ""))
    p.add_argument("--ray", action="store_true", help="let p2pfl train in its Ray actor pool")
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument("--converge-wait", type=float, default=60, help="seconds for the full mesh to form")
    args = p.parse_args()
    _stand_in_torchvision()
    os.chdir(tempfile.mkdtemp(prefix="p2pfl-run-"))  # p2pfl and Lightning write logs to the cwd
    import lightning as L
    import p2pfl.learning.frameworks.pytorch.lightning_learner as learner_module
    import torch
    from datasets import Dataset, DatasetDict
    from p2pfl.communication.protocols.protobuff.memory import MemoryCommunicationProtocol
    from p2pfl.learning.dataset.p2pfl_dataset import P2PFLDataset
    from p2pfl.learning.dataset.partition_strategies import RandomIIDPartitionStrategy
    from p2pfl.learning.frameworks.pytorch.lightning_model import LightningModel
    from p2pfl.node import Node
    from p2pfl.settings import Settings
    from p2pfl.utils.topologies import TopologyFactory, TopologyType
    from p2pfl.utils.utils import set_standalone_settings, wait_convergence

    set_standalone_settings()
    Settings.general.DISABLE_RAY = not args.ray
    Settings.general.LOG_LEVEL = "WARNING"
    Settings.training.AGGREGATION_TIMEOUT = int(args.timeout)
    # Lightning's rich progress bar crashes with several nodes in one process
    base_trainer = learner_module.Trainer
    learner_module.Trainer = lambda *a, **k: base_trainer(*a, **{"enable_progress_bar": False, **k})

    class LogReg(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(784, 10)

        def forward(self, x):
            return self.linear(x.reshape(x.shape[0], -1).float())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def training_step(self, batch, batch_id):
            return torch.nn.functional.cross_entropy(self(batch["image"]), batch["label"])

        def test_step(self, batch, batch_id):
            logits = self(batch["image"])
            loss = torch.nn.functional.cross_entropy(logits, batch["label"])
            self.log("test_loss", loss)
            self.log("test_metric", (logits.argmax(1) == batch["label"]).float().mean())
            return loss

    xtr, ytr, xte, yte = _mnist(args.data_dir)
    data = P2PFLDataset(
        DatasetDict(
            {
                "train": Dataset.from_dict({"image": list(xtr), "label": ytr}),
                "test": Dataset.from_dict({"image": list(xte), "label": yte}),
            }
        )
    )
    data.set_batch_size(64)
    parts = data.generate_partitions(args.nodes, RandomIIDPartitionStrategy)
    start = time.perf_counter()
    nodes = []
    for i in range(args.nodes):
        node = Node(
            LightningModel(LogReg()), parts[i], protocol=MemoryCommunicationProtocol(), addr=f"node-{i}"
        )
        node.start()
        nodes.append(node)
    result: dict = {"nodes": args.nodes, "rounds": args.rounds, "ray": args.ray}
    try:
        TopologyFactory.connect_nodes(TopologyFactory.generate_matrix(TopologyType.FULL, len(nodes)), nodes)
        try:
            wait_convergence(nodes, args.nodes - 1, only_direct=False, wait=args.converge_wait)
        except AssertionError:
            seen = [len(n.get_neighbors(only_direct=False)) for n in nodes]
            raise AssertionError(f"the full mesh did not form in {args.converge_wait:g} s: nodes saw "
                                 f"{min(seen)}-{max(seen)} of {args.nodes - 1} neighbours") from None
        result["setup_seconds"] = time.perf_counter() - start
        stamps: list[tuple[int, float]] = []
        done = threading.Event()

        def watch():  # round changes of node 0
            last = None
            while not done.is_set():
                r = nodes[0].state.round
                if r != last:
                    stamps.append((-1 if r is None else int(r), time.perf_counter()))
                    last = r
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        nodes[0].set_start_learning(rounds=args.rounds, epochs=1, trainset_size=args.nodes)
        deadline = t0 + args.timeout
        while time.perf_counter() < deadline:
            if all(n.state.round is None for n in nodes) and time.perf_counter() - t0 > 5:
                break
            time.sleep(0.2)
        done.set()
        result["learning_seconds"] = time.perf_counter() - t0
        result["finished"] = all(n.state.round is None for n in nodes)
        # node 0's round counter: r = 0 .. rounds-1 while training, then rounds, then None (finished)
        marks = [(r, t) for r, t in stamps if r >= 0]
        ends = [t for _, t in marks]
        if marks and marks[-1][0] < args.rounds and stamps[-1][0] == -1:
            ends.append(stamps[-1][1])
        result["round_seconds"] = list(np.diff(ends)) if len(ends) > 1 else []
        result["round_seconds_median"] = (
            float(np.median(result["round_seconds"])) if result["round_seconds"] else None
        )
        accs = []
        for node in nodes:
            w, b = node.learner.get_model().get_parameters()
            accs.append(float(((xte @ w.T + b).argmax(1) == yte).mean()))
        result["accuracy_mean"], result["accuracy_min"] = float(np.mean(accs)), float(np.min(accs))
    except Exception as exc:  # report p2pfl's failure honestly
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        result["error"] = (
            f"{type(exc).__name__}: {exc} (at {Path(where.filename).name}:{where.lineno} {where.name})"
        )
    finally:
        for node in nodes:
            try:
                node.stop()
            except Exception:  # noqa: BLE001  (best effort)
                pass
    print("RESULT" + json.dumps(result), flush=True)
    os._exit(0)  # p2pfl leaves non-daemon threads behind


if __name__ == "__main__":
    main()
