"""The same round as Flower: given the same clipped updates, node noise and execution trace, the
simulator's IncA mixer releases the update an IncaStrategy round released, and certifies the same cost.

The Flower round runs in Flower's simulation engine (Ray backend) with nodes whose secrets come from a
fixed test seed, so their noise can be regenerated (``PartyNoise.explicit``).
"""

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import flower_apps  # noqa: E402
from flwr.app import ArrayRecord, Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from flwr_inca.flower import IncaStrategy  # noqa: E402
from flwr_inca.flower.shared import clip, flatten_arrays  # noqa: E402
from flwr_inca.flower.node import RoundSecrets  # noqa: E402
from flwr_inca.protocol.party import PartyNoise  # noqa: E402
from flwr_inca.simulation import IncaMixer, MixContext, RoundPlan  # noqa: E402
from flwr_inca.simulation.training import clip_rows  # noqa: E402

pytestmark = pytest.mark.flower

NODES, ROUNDS, T, CLIP = 6, 2, 4, 0.8
INITIAL = [np.zeros((3, 4), dtype=np.float32), np.zeros(5, dtype=np.float32)]
SETTINGS = dict(iterations=T, sigma_star=0.3, sigma_delta=4.0, collusion=0.2, threat_draws=2)
SEED = 0  # the simulation's seed; the strategy certifies with the simulator's threat seed for it


@pytest.fixture(scope="module")
def flower_rounds(ray_cluster):
    from flwr.simulation import run_simulation

    out: dict = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = IncaStrategy(
            clip_norm=CLIP,
            precision="float64",
            ledger_path=None,
            seed=IncaMixer.threat_seed(SEED),
            forward_client_metrics=True,
            fraction_evaluate=0.0,
            min_available_nodes=NODES,
            min_train_nodes=NODES,
            exchange_timeout=20,
            **SETTINGS,
        )
        globals_ = {}

        def evaluate_fn(rnd, arrays):
            globals_[rnd] = [a.copy() for a in arrays.to_numpy_ndarrays()]

        strategy.start(
            grid=grid, initial_arrays=ArrayRecord(INITIAL), num_rounds=ROUNDS, evaluate_fn=evaluate_fn
        )
        out.update(strategy=strategy, globals=globals_)

    run_simulation(
        server_app=app,
        client_app=flower_apps.client,
        num_supernodes=NODES,
        backend_config=flower_apps.on_the_session_cluster(ray_cluster[0]),
    )
    return out


def test_simulator_round_is_the_flower_round(flower_rounds):
    strategy, globals_ = flower_rounds["strategy"], flower_rounds["globals"]
    from flwr_inca.settings import MixingConfig, PrivacyTarget

    mixer = IncaMixer(privacy=PrivacyTarget(collusion=0.2, threat_draws=2),
                      mixing=MixingConfig(iterations=T, sigma_star=0.3, sigma_delta=4.0))
    for rnd in range(1, ROUNDS + 1):
        record = strategy.rounds[rnd]
        assert not record.failed and len(record.finalists) == NODES
        old = flatten_arrays(ArrayRecord(globals_[rnd - 1]))[0]
        raw, noises = [], []
        for node in record.roster:
            pid = int(record.client_metrics[node]["partition-id"])
            new = flatten_arrays(ArrayRecord(flower_apps.local_update(globals_[rnd - 1], pid, rnd)))[0]
            raw.append(new - old)
            noises.append(
                PartyNoise(RoundSecrets.generate(rnd, flower_apps.FIXED_SEED, node=node).noise_secret, rnd)
            )
        raw = np.array(raw)
        # the simulator clips as the Flower client does
        ours = clip_rows(torch.from_numpy(raw), CLIP).numpy()
        assert np.allclose(ours, np.array([clip(u, CLIP) for u in raw]), rtol=0, atol=1e-15)
        assert (np.linalg.norm(raw, axis=1) > CLIP).any()  # clipping mattered
        d = raw.shape[1]
        mixer.prepare(
            MixContext(
                value_sensitivity=2 * CLIP, mu_round=None, delta=1e-5, participants=NODES, dimension=d, seed=SEED
            )
        )
        # the simulator's cost of that execution: the same certificate, the same threat draws
        mu = mixer.certificate(record.trace, rnd).mu
        assert mu == record.charge.certified_mu
        plan = RoundPlan(rnd, NODES, mu, True, record.trace)
        update = mixer.mix(ours, plan, noise=PartyNoise.explicit(noises, d, T))
        assert np.allclose(update, record.update, rtol=0, atol=1e-12)
        assert np.abs(update - ours.mean(axis=0)).max() > 1e-3  # the noise is really there
