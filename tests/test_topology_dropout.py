import numpy as np
import pytest
from scipy import stats

from flwr_inca import (
    EdgeSchedule,
    MarkovDropout,
    NoDropout,
    PermanentDropout,
    RandomNeighbors,
    ScheduledDropout,
    StaticTopology,
    TemporaryDropout,
)
from flwr_inca.protocol.topology import Messages, check_column_stochastic, resolve_topology


def _column_sums(m: Messages, n: int) -> np.ndarray:
    keep = check_column_stochastic(m, n)
    return keep + np.bincount(m.senders, weights=m.weights, minlength=n)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_random_neighbors_distinct_not_self_and_weights(k, rng):
    n, T = 30, 6
    for msgs in RandomNeighbors(k).iterate(n, T, rng):
        picks = msgs.receivers.reshape(n, k)
        assert np.all(picks != np.arange(n)[:, None])
        assert all(len(set(row)) == k for row in picks.tolist())
        assert np.allclose(msgs.weights, 1 / (k + 1))
        assert np.allclose(_column_sums(msgs, n), 1.0)


def test_random_neighbors_uniform_over_others(rng):
    n, T = 6, 3000
    counts = np.zeros((n, n))
    for msgs in RandomNeighbors(2).iterate(n, T, rng):
        np.add.at(counts, (msgs.senders, msgs.receivers), 1)
    for i in range(n):
        others = np.delete(counts[i], i)
        assert counts[i, i] == 0
        assert stats.chisquare(others).pvalue > 1e-4


def test_fresh_neighbors_never_repeat(rng):
    n, k, T = 40, 2, 19
    seen = [set() for _ in range(n)]
    for msgs in RandomNeighbors(k, fresh=True).iterate(n, T, rng):
        for s, r in zip(msgs.senders.tolist(), msgs.receivers.tolist()):
            assert r not in seen[s]
            seen[s].add(r)
    assert all(len(s) == k * T for s in seen)
    with pytest.raises(ValueError, match="fresh"):
        list(RandomNeighbors(2, fresh=True).iterate(10, 5, rng))


def test_random_neighbors_bad_k():
    with pytest.raises(ValueError, match=r"neighbors must be in \[1, n-1\]"):
        list(RandomNeighbors(5).iterate(5, 2, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="neighbors"):
        RandomNeighbors(0)


@pytest.mark.parametrize(
    "topology, n, degree",
    [(StaticTopology.ring(8), 8, 2), (StaticTopology.hypercube(16), 16, 4),
     (StaticTopology.complete(5), 5, 4)],
)
def test_static_graphs_column_stochastic(topology, n, degree, rng):
    msgs = next(topology.iterate(n, 1, rng))
    assert np.all(np.bincount(msgs.senders, minlength=n) == degree)
    assert np.allclose(msgs.weights, 1 / (degree + 1))
    assert np.allclose(_column_sums(msgs, n), 1.0)
    assert topology.static


def test_erdos_renyi_and_named_resolution(rng):
    t = resolve_topology("erdos-renyi:0.3", 1, 20, seed=1)
    msgs = next(t.iterate(20, 1, rng))
    deg = np.bincount(msgs.senders, minlength=20)
    assert np.allclose(msgs.weights, 1 / (deg[msgs.senders] + 1))
    # undirected: every edge both ways
    pairs = set(zip(msgs.senders.tolist(), msgs.receivers.tolist()))
    assert all((r, s) in pairs for s, r in pairs)
    with pytest.raises(ValueError, match="power of 2"):
        StaticTopology.hypercube(12)
    with pytest.raises(ValueError, match="topology"):
        resolve_topology("star", 1, 10)


def test_edge_lists_are_checked():
    ok = StaticTopology([(0, 1, 0.5), (1, 0, 0.25), (1, 2, 0.25)], n=3)
    assert np.allclose(_column_sums(ok._messages, 3), 1.0)
    with pytest.raises(ValueError, match="not column stochastic"):
        StaticTopology([(0, 1, 0.7), (0, 2, 0.6)], n=3)
    with pytest.raises(ValueError, match="itself"):
        StaticTopology([(1, 1)], n=3)
    with pytest.raises(ValueError, match="duplicate"):
        StaticTopology([(0, 1), (0, 1)], n=3)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        StaticTopology([(0, 1, -0.1)], n=3)
    with pytest.raises(ValueError, match="for every edge or for none"):
        StaticTopology([(0, 1, 0.5), (1, 0)], n=3)
    sched = EdgeSchedule([[(0, 1)], [(1, 2)]], n=3)
    with pytest.raises(ValueError, match="expected iterations = 3"):
        list(sched.iterate(3, 3, np.random.default_rng(0)))


# ---------------------------------------------------------------------------------- dropout
def test_no_dropout():
    assert NoDropout().sample(5, 4, np.random.default_rng(0)).all()


def test_permanent_dropout(rng):
    n, T = 200, 10
    online = PermanentDropout(0.15).sample(n, T, rng)
    assert online[0].all()
    assert (~online[T]).sum() == 30
    # once offline, never back
    dropped = np.flatnonzero(~online[T])
    for i in dropped:
        first_off = np.flatnonzero(~online[:, i]).min()
        assert not online[first_off:, i].any() and first_off >= 1


def test_temporary_dropout_frequency_and_recovery(rng):
    n, T, p = 400, 12, 0.2
    online = TemporaryDropout(p).sample(n, T, rng)
    assert online[0].all() and online[T].all()
    off = (~online[1:T]).sum()
    total = n * (T - 1)
    assert abs(off / total - p) < 4 * np.sqrt(p * (1 - p) / total)


def test_markov_dropout_transition_probabilities(rng):
    n, T, rate, corr = 2000, 30, 0.1, 0.6
    online = MarkovDropout(rate, corr).sample(n, T, rng)
    prev, cur = online[:-1], online[1:]
    p_drop = (~cur & prev).sum() / prev.sum()
    p_stay_off = (~cur & ~prev).sum() / (~prev).sum()
    assert abs(p_drop - rate) < 0.01
    assert abs(p_stay_off - (rate + corr * (1 - rate))) < 0.02
    assert MarkovDropout(0.3, recover_by_end=True).sample(50, 5, rng)[5].all()


def test_scheduled_dropout():
    online = ScheduledDropout({2: [0, 3], 4: [1]}).sample(5, 4, np.random.default_rng(0))
    assert not online[2, 0] and not online[2, 3] and not online[4, 1] and online.sum() == 5 * 5 - 3
    mask = np.ones((3, 4), dtype=bool)
    mask[1, 2] = False
    assert np.array_equal(ScheduledDropout(mask).sample(4, 2, np.random.default_rng(0)), mask)
    bad = mask.copy()
    bad[0, 0] = False
    with pytest.raises(ValueError, match="step 0"):
        ScheduledDropout(bad).sample(4, 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="shape"):
        ScheduledDropout(mask).sample(5, 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="iteration must be in"):
        ScheduledDropout({7: [0]}).sample(4, 2, np.random.default_rng(0))


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), float("inf")])
def test_probabilities_outside_unit_interval_rejected(bad):
    for make in (PermanentDropout, TemporaryDropout, MarkovDropout):
        with pytest.raises(ValueError, match=r"\[0, 1\)"):
            make(bad)
    with pytest.raises(ValueError, match="correlation"):
        MarkovDropout(0.1, correlation=1.5)
