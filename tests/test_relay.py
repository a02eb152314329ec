"""The relayed protocol (relay + party handlers) in process, without Flower: faults, tampering, replay."""

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("cryptography")

from flwr_inca import InjectionSchedule, replay  # noqa: E402
from flwr_inca.flower.crypto import KeyPair, PayloadRejected, associated_data, open_sealed, pair_key, seal  # noqa: E402
from flwr_inca.flower.node import RoundSecrets, draw_noise_ahead, handle_exchange  # noqa: E402
from flwr_inca.flower.shared import RoundParams  # noqa: E402
from flwr_inca.flower.storage import MemoryStore  # noqa: E402
from flwr_inca.flower.relay import RoundRelay, drive  # noqa: E402
from flwr_inca.protocol.party import PartyNoise  # noqa: E402

ROUND = 3


def run_local(values, T=5, k=1, s_star=0.3, s_delta=4.0, schedule="incremental", fault=None, tamper=None,
              seed=0, log=None, final_retries=2, precision="float64", lost_replies=None, wipe=None,
              stores=None, ahead=False, on_start=None, corrupt=None):
    """Run one relayed round in process.

    ``fault(i, e)``: party i fails exchange e before doing anything; ``lost_replies(i, e)``: it does
    the work (and stores its state) but the reply never arrives; ``wipe(i, e)``: its storage is lost
    before exchange e. ``stores``: the parties' node-local stores (fresh ones by default).
    ``ahead``: parties draw their noise into storage when they join; ``on_start()`` runs after that.
    ``corrupt(i, commit, reply)``: what party i's reply becomes on its way to the relay.
    """
    n, d = values.shape
    sched = InjectionSchedule.resolve(schedule, T)
    roster = [10_000 + 7 * i for i in range(n)]
    secrets = [RoundSecrets.generate(ROUND, fixed_seed=seed, node=roster[i]) for i in range(n)]
    stores = [MemoryStore() for _ in range(n)] if stores is None else stores
    for i in range(n):
        stores[i].save_value(ROUND, values[i])
        if ahead:
            draw_noise_ahead(stores[i], secrets[i], T, d)
    if on_start is not None:
        on_start()
    params = RoundParams(ROUND, T, k, s_star, s_delta, sched, roster, [s.public_key for s in secrets], precision)
    relay = RoundRelay(n, T, d, sched, s_star, s_delta, precision)
    counter = [0]

    def exchange(commit, requests):
        counter[0] += 1  # exchange number: commit for 1..T+1, then T+2, ... for final retries
        e = counter[0]
        replies = {}
        for req in requests:
            i = req.party
            if fault is not None and fault(i, e):
                continue  # the party errored or timed out in this exchange
            if wipe is not None and wipe(i, e):
                stores[i].states.clear()
            if tamper is not None:  # what the party receives, not what the relay stores
                req = replace(req, incoming=[replace(m, payload=tamper(m, commit)) for m in req.incoming])
            rep = handle_exchange(req, params, i, secrets[i], stores[i])
            if log is not None:
                log.append((req, rep))
            if lost_replies is not None and lost_replies(i, e):
                continue  # computed and stored, but the relay never hears about it
            replies[i] = rep if corrupt is None else corrupt(i, commit, rep)
        return replies

    drive(relay, exchange, final_retries=final_retries)
    noise = PartyNoise.explicit([PartyNoise(s.noise_secret, ROUND) for s in secrets], d, T)
    return relay, noise


def check_replay(relay, noise, values):
    trace = relay.trace()
    res = replay(trace, values, seed=0, noise=noise, finalists=sorted(relay.finals))
    est = relay.estimate()
    assert np.allclose(res.estimate, est, atol=1e-10, rtol=1e-10)
    return trace, res


@pytest.mark.parametrize("schedule", ["incremental", "early", "incremental:tail=2"])
def test_fault_free_round_is_exact(schedule):
    values = np.random.default_rng(0).random((9, 4))
    relay, noise = run_local(values, s_star=0.0, s_delta=50.0, schedule=schedule)
    assert sorted(relay.finals) == list(range(9))
    assert np.allclose(relay.estimate(), values.mean(axis=0), atol=1e-10)
    trace, _ = check_replay(relay, noise, values)
    assert all(step.online.size == 9 for step in trace.steps)
    assert relay.exchanges == 6  # T + 1: one per iteration plus the final report


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_random_failures_match_engine_replay(rate):
    rng = np.random.default_rng(int(rate * 100))
    values = rng.random((12, 3))
    failures = {(i, u) for i in range(12) for u in range(1, 9) if rng.random() < rate}
    relay, noise = run_local(values, T=6, k=2, fault=lambda i, u: (i, u) in failures)
    trace, res = check_replay(relay, noise, values)
    online = trace.online_mask()
    assert not online[1:].all()  # failures did make parties offline
    # a party that failed the exchange committing to u is offline at u
    for (i, u) in failures:
        if u <= 6:
            assert not online[u, i]


def test_party_that_fails_forever_drops_out_and_noise_stays_consistent():
    values = np.random.default_rng(1).random((8, 2))
    relay, noise = run_local(values, T=4, fault=lambda i, u: i == 5 and u >= 3)
    trace, _ = check_replay(relay, noise, values)
    assert 5 not in relay.finals and trace.online_mask()[2, 5] and not trace.online_mask()[3, 5]


def test_timeout_at_final_report_is_retried_then_lost():
    values = np.random.default_rng(2).random((6, 2))
    relay, noise = run_local(values, T=3, s_star=0.0, s_delta=10.0, fault=lambda i, u: i == 2 and u == 4)
    assert 2 in relay.finals  # the retry succeeded
    assert np.allclose(relay.estimate(), values.mean(axis=0), atol=1e-10)
    relay, noise = run_local(values, T=3, fault=lambda i, u: i == 2 and u >= 4)
    assert 2 not in relay.finals and relay.missing_finals() == [2]
    trace, _ = check_replay(relay, noise, values)  # a lost final: output over the others
    assert trace.meta["finalists"] == [0, 1, 3, 4, 5]


def test_tampered_payload_is_rejected_and_retransmitted():
    values = np.random.default_rng(3).random((7, 3))
    done = set()

    def tamper(m, commit):
        if commit == 3 and m.receiver == 4 and (m.sender, m.receiver) not in done:
            done.add((m.sender, m.receiver))
            return m.payload[:-1] + bytes([m.payload[-1] ^ 1])
        return m.payload

    relay, noise = run_local(values, T=5, s_star=0.0, s_delta=20.0, tamper=tamper)
    assert relay.rejected_payloads == len(done) == 1 and relay.excluded == {} and relay.disputes == 0
    (sender, receiver), = done
    trace, res = check_replay(relay, noise, values)
    # the receiver refuses at exchange 3, the sender re-encrypts at exchange 4, the receiver computes
    # at exchange 5: it cannot commit to iterations 3 and 4 meanwhile; the sender is held (no new
    # message of it accepted) until the receiver has used the payload sent again: offline at 3 and 4
    online = trace.online_mask()
    expected = np.ones_like(online)
    expected[3:5, receiver] = expected[3:5, sender] = False
    assert np.array_equal(online, expected)
    assert sorted(relay.finals) == list(range(7))  # ... but both recovered
    # all noise cancelled; both missed 2 of T+1 = 6 steps, so they injected 4/6 of their values (D_Inc)
    w = res.injected
    assert w[receiver] == w[sender] == pytest.approx(4 / 6)
    assert np.allclose(np.delete(w, [sender, receiver]), 1.0)
    assert np.allclose(relay.estimate(), (w[:, None] * values).sum(axis=0) / w.sum(), atol=1e-9)


def test_lost_replies_after_computing_are_harmless():
    rng = np.random.default_rng(8)
    values = rng.random((10, 3))
    lost = {(i, e) for i in range(10) for e in range(1, 8) if rng.random() < 0.25}
    relay, noise = run_local(values, T=6, k=2, lost_replies=lambda i, e: (i, e) in lost)
    trace, _ = check_replay(relay, noise, values)
    assert not trace.online_mask()[1:].all()


def test_party_that_loses_its_storage_is_restored_from_its_own_payload():
    values = np.random.default_rng(9).random((7, 4))
    relay, noise = run_local(values, T=5, s_star=0.0, s_delta=30.0, wipe=lambda i, e: i == 3 and e == 4)
    assert relay.restores == 1
    trace, res = check_replay(relay, noise, values)
    assert 3 in relay.finals
    w = res.injected
    assert np.allclose(relay.estimate(), (w[:, None] * values).sum(axis=0) / w.sum(), atol=1e-9)


@pytest.mark.parametrize("kind", ["memory", "directory"])
def test_rejoining_a_round_number_uses_nothing_from_the_earlier_instance(kind, tmp_path):
    # a restarted strategy numbers its rounds from 1 again: the nodes' storage still holds the old
    # instance's data for that round number (cached x + eta*, states, roster with old public keys)
    from flwr_inca.flower.storage import DirectoryStore

    rng = np.random.default_rng(9)
    first, second = rng.random((6, 3)), rng.random((6, 3)) + 5.0
    stores = [MemoryStore() if kind == "memory" else DirectoryStore(tmp_path / f"node-{i}") for i in range(6)]
    run_local(first, seed=0, stores=stores)
    relay, noise = run_local(second, seed=1, stores=stores)  # fresh secrets, as in a deployment
    assert sorted(relay.finals) == list(range(6))
    check_replay(relay, noise, second)


def _faulty_round(values, **kwargs):
    rng = np.random.default_rng(21)
    bad = {(i, e) for i in range(values.shape[0]) for e in range(1, 9) if rng.random() < 0.15}
    return run_local(values, T=6, k=2, fault=lambda i, e: (i, e) in bad,
                     lost_replies=lambda i, e: (i, e + 1) in bad, **kwargs)


def test_party_noise_cache_halves_the_draws_of_d_inc_and_changes_no_number():
    sched = InjectionSchedule.incremental(6)
    draws = []

    class Counting(PartyNoise):
        def _rng(self, kind, index):
            draws.append((kind, index))
            return super()._rng(kind, index)

    def run(cache):
        from flwr_inca.protocol.party import IncaParty

        party = IncaParty(np.arange(5.0), sched, 0.5, 3.0, Counting(b"k" * 32, 2, cache))
        state, out = party.initial_state(), []
        for t in range(7):
            state = party.compute(state, t, [], 0.0)
            out.append(state.y)
        return np.array(out)

    plain = run(None)
    n_plain = len(draws)
    draws.clear()
    cached = run({})
    assert np.array_equal(plain, cached)
    assert n_plain == 1 + 2 * 6 and len(draws) == 1 + 6  # eta* and each term once


@pytest.mark.parametrize("schedule", ["incremental", "early"])
def test_noise_drawn_ahead_is_the_noise_drawn_on_demand(schedule, monkeypatch):
    values = np.random.default_rng(23).random((8, 5))
    relay0, noise = _faulty_round(values, schedule=schedule)
    import flwr_inca.flower.node as node

    draws = []

    class Counting(PartyNoise):
        def _rng(self, kind, index):
            draws.append((kind, index))
            return super()._rng(kind, index)

    monkeypatch.setattr(node, "PartyNoise", Counting)  # the parties' noise, not the replay's
    relay1, _ = _faulty_round(values, schedule=schedule, ahead=True, on_start=draws.clear)
    assert draws == []  # mixing only read what was drawn at join
    _faulty_round(values, schedule=schedule, ahead=False, on_start=draws.clear)
    assert len(draws) >= 8 * 7  # the control: without it, every party draws eta* and 6 terms
    assert np.array_equal(relay0.estimate(), relay1.estimate())
    assert relay0.trace().to_dict() == relay1.trace().to_dict()
    check_replay(relay1, noise, values)


def test_stored_noise_reads_each_step_once_from_exact_ranges(tmp_path):
    from flwr_inca.flower.storage import DirectoryStore, StoredNoise

    reads = []

    class Counting(DirectoryStore):
        def load_blob_range(self, round, name, offset, size):
            reads.append((offset, size))
            return super().load_blob_range(round, name, offset, size)

    secrets = RoundSecrets.generate(4, fixed_seed=1, node=9)
    store = Counting(tmp_path / "node")
    store.save_value(4, np.zeros(5))
    draw_noise_ahead(store, secrets, 3, 5)
    plain = PartyNoise(secrets.noise_secret, 4)
    row = 8 * 5
    assert len(store.load_blob(4, "noise")) == 4 * row
    assert store.load_blob_range(4, "noise", 2 * row, row) == plain.term(2, 5).tobytes()
    assert store.load_blob_range(4, "noise", 3 * row, 2 * row) is None  # past the end
    assert store.load_blob_range(4, "missing", 0, 8) is None
    reads.clear()
    noise = PartyNoise(secrets.noise_secret, 4, StoredNoise(store, 4))
    # a D_Inc step cancels eta_2 and injects eta_3: one read
    assert np.array_equal(noise.term(2, 5), plain.term(2, 5))
    assert np.array_equal(noise.term(3, 5), plain.term(3, 5))
    assert reads == [(2 * row, 2 * row)]
    assert np.array_equal(noise.star(5), plain.star(5))
    reads.clear()
    noise = PartyNoise(secrets.noise_secret, 4, StoredNoise(store, 4))
    assert np.array_equal(noise.term(3, 5), plain.term(3, 5))  # the last row: a shorter second read
    assert reads == [(3 * row, 2 * row), (3 * row, row)]
    empty = PartyNoise(secrets.noise_secret, 4, StoredNoise(MemoryStore(), 4))
    assert np.array_equal(empty.term(1, 5), plain.term(1, 5))  # nothing drawn ahead: drawn on demand
    reads.clear()
    bare = Counting(tmp_path / "bare")
    bare.save_value(4, np.zeros(5))
    noise = PartyNoise(secrets.noise_secret, 4, StoredNoise(bare, 4))
    assert np.array_equal(noise.term(2, 5), plain.term(2, 5))
    assert np.array_equal(noise.term(3, 5), plain.term(3, 5))
    assert len(reads) == 2  # storage is asked once per step, not once per row


def test_choose_neighbors_is_uniform_over_the_other_parties():
    from itertools import combinations

    from flwr_inca.flower.node import choose_neighbors

    n, k, me, runs = 6, 2, 2, 20_000
    counts = {c: 0 for c in combinations([j for j in range(n) if j != me], k)}
    for it in range(runs):
        picks = choose_neighbors(b"s" * 32, 1, it, me, n, k)
        assert len(set(picks)) == k and me not in picks and all(0 <= p < n for p in picks)
        counts[tuple(sorted(picks))] += 1
    expected = runs / len(counts)
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 30  # 9 degrees of freedom: P(chi2 > 30) < 0.001
    assert choose_neighbors(b"s" * 32, 1, 7, me, n, k) == choose_neighbors(b"s" * 32, 1, 7, me, n, k)
    assert choose_neighbors(b"s" * 32, 1, 0, 0, 2, 1) == [1]
    with pytest.raises(ValueError, match="neighbors"):
        choose_neighbors(b"s" * 32, 1, 0, 0, 3, 3)


def test_directory_store_keeps_states_in_checksummed_slots(tmp_path):
    from flwr_inca.flower.storage import DirectoryStore

    store = DirectoryStore(tmp_path / "node")
    store.save_value(2, np.zeros(3))
    states = {v: bytes([v]) * 40 for v in (0, 1, 3)}
    for v, data in states.items():
        store.save_state(2, v, data)
    assert all(store.load_state(2, v) == data for v, data in states.items())
    assert store.load_state(2, 2) is None and store.load_state(2, 4) is None  # never written
    assert store.load_state(3, 0) is None and store.load_state(2, -1) is None
    store.save_state(2, 1, states[1])  # a retry writes the same bytes again
    assert store.load_state(2, 1) == states[1]
    with pytest.raises(ValueError, match="same size"):
        store.save_state(2, 5, b"x" * 41)
    path = tmp_path / "node" / "round-2" / "states.bin"
    raw = bytearray(path.read_bytes())
    raw[8 + 48 + 8 + 5] ^= 0xFF  # a torn or damaged slot (version 1) reads as missing
    path.write_bytes(bytes(raw))
    assert store.load_state(2, 1) is None and store.load_state(2, 0) == states[0]
    store.save_value(3, np.zeros(3))  # joining the next round drops the states
    assert store.load_state(2, 0) is None


def test_directory_store_is_private_to_the_node(tmp_path):
    import stat

    from flwr_inca.flower.storage import DirectoryStore

    root = tmp_path / "node"
    root.mkdir(mode=0o755)
    root.chmod(0o755)  # a pre-existing, world-readable directory
    store = DirectoryStore(root)
    store.save_value(1, np.arange(3.0))
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert np.array_equal(store.load_value(1), np.arange(3.0))


def test_float32_messages_match_the_engine_to_float32_precision():
    values = np.random.default_rng(10).random((12, 6))
    for sd in [1.0, 50.0]:
        relay, noise = run_local(values, T=6, s_star=0.2, s_delta=sd, precision="float32",
                                 fault=lambda i, e: (i + e) % 7 == 0)
        trace = relay.trace()
        res = replay(trace, values, seed=0, noise=noise, finalists=sorted(relay.finals))
        # rounding each state to float32: errors of eps32 * |y| per step, |y| ~ sigma_delta
        tol = 50 * np.finfo(np.float32).eps * sd * np.sqrt(12 * 6)
        assert np.abs(res.estimate - relay.estimate()).max() < tol


def test_relay_never_sees_plaintext():
    from reference import all_messages

    values = np.random.default_rng(4).random((6, 5))
    log = []
    relay, noise = run_local(values, T=3, log=log)
    blob = b"".join(
        b"".join([*(m.payload for m in req.incoming), *(m.payload for m in rep.outgoing),
                  *(m.payload for m in rep.retransmissions)])
        for req, rep in log)
    secrets = [RoundSecrets.generate(ROUND, fixed_seed=0, node=10_000 + 7 * i) for i in range(6)]
    messages = all_messages(relay.trace(), values, [PartyNoise(s.noise_secret, ROUND) for s in secrets])
    assert len(messages) > 6
    for y in messages + list(values):  # every plaintext a peer message carries
        chunk = y.astype(np.float64).tobytes()
        for j in range(0, len(chunk) - 16, 8):
            assert chunk[j:j + 16] not in blob


@pytest.mark.parametrize("omega, y", [(-1.0, None), (0.0, None), (100.0, None), (float("nan"), None),
                                      (None, float("inf")), (None, float("nan"))])
def test_a_final_message_with_a_bad_weight_or_value_is_refused(omega, y):
    values = np.random.default_rng(5).random((6, 3))
    T = 4

    def corrupt(i, commit, rep):
        if i == 2 and rep.final is not None:
            final = rep.final.copy() if y is None else np.full_like(rep.final, y)
            return replace(rep, final=final, final_omega=rep.final_omega if omega is None else omega)
        return rep

    relay, noise = run_local(values, T=T, corrupt=corrupt, final_retries=0)
    assert sorted(relay.finals) == [0, 1, 3, 4, 5] and relay.invalid_replies == 1
    assert all(0 < omega <= 6 for _, omega in relay.finals.values())
    check_replay(relay, noise, values)  # the others' finals are exactly the replayed ones


def test_malformed_commit_is_refused():
    relay = RoundRelay(4, 2, 3, InjectionSchedule.incremental(2), 1.0, 1.0)
    from flwr_inca.flower.relay import Outgoing, Reply

    reqs = relay.requests(1)
    size = relay.payload_bytes
    bad = {0: Reply(0, computed=0, outgoing=[Outgoing(0, 1, 0.7, b"x" * size, 1), Outgoing(0, 2, 0.7, b"x" * size, 1)]),
           1: Reply(1, computed=0, outgoing=[Outgoing(1, 0, 0.5, b"x" * 10, 1)]),
           2: Reply(2, computed=0, outgoing=[])}
    relay.ingest(1, bad, reqs)
    assert relay.online[1] == set() and relay.invalid_replies == 3
    assert relay.version == [-1, -1, -1, -1]  # computations are accepted only with a valid commit


def test_hkdf_is_rfc5869():
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    from flwr_inca.flower.crypto import hkdf_sha256

    # RFC 5869, test case 1 (first 32 bytes of its 42-byte output)
    ikm, salt, info = bytes([0x0B] * 22), bytes(range(13)), bytes(range(0xF0, 0xFA))
    assert hkdf_sha256(ikm, salt, info).hex() == \
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
    rng = np.random.default_rng(0)
    for _ in range(20):  # and the reference implementation
        ikm, salt, info = (rng.bytes(int(rng.integers(1, 80))) for _ in range(3))
        assert hkdf_sha256(ikm, salt, info) == HKDF(hashes.SHA256(), 32, salt, info).derive(ikm)


def test_crypto_binds_sender_receiver_round_iteration():
    a, b, c = KeyPair(), KeyPair(), KeyPair()
    k_ab = pair_key(a, b.public, 1)
    assert k_ab == pair_key(b, a.public, 1) and k_ab != pair_key(a, b.public, 2)
    payload = seal(k_ab, b"hello", associated_data(1, 2, 1, 5))
    assert open_sealed(k_ab, payload, associated_data(1, 2, 1, 5)) == b"hello"
    for ad in [associated_data(1, 3, 1, 5), associated_data(2, 1, 1, 5), associated_data(1, 2, 1, 6),
               associated_data(1, 2, 2, 5)]:
        with pytest.raises(PayloadRejected):
            open_sealed(k_ab, payload, ad)
    with pytest.raises(PayloadRejected):
        open_sealed(pair_key(a, c.public, 1), payload, associated_data(1, 2, 1, 5))
    with pytest.raises(PayloadRejected):
        open_sealed(k_ab, payload[:-1] + bytes([payload[-1] ^ 1]), associated_data(1, 2, 1, 5))  # always changed


def test_roster_encoding_and_a_request_without_roster():
    from flwr_inca.flower.relay import Request
    from flwr_inca.flower.wire import (
        ROSTER_ENTRY_BYTES,
        MissingRoster,
        decode_request,
        encode_request,
        pack_roster,
        unpack_roster,
    )

    keys = [KeyPair().public for _ in range(3)]
    ids = [7, 2**64 - 1, 12]
    blob = pack_roster(ids, keys)
    assert len(blob) == 3 * ROSTER_ENTRY_BYTES and unpack_roster(blob) == (ids, keys)
    for bad in (b"", blob[:-1], blob + b"x"):
        with pytest.raises(ValueError, match="bytes per node"):
            unpack_roster(bad)
    with pytest.raises(ValueError, match="32-byte public key"):
        pack_roster(ids, keys[:2])
    params = RoundParams(1, 2, 1, 0.5, 2.0, InjectionSchedule.incremental(2), ids, keys)
    data = encode_request(Request(1, 1, -1), params, with_roster=False)
    with pytest.raises(MissingRoster):  # the node asks the relay for the roster again
        decode_request(data)
    req, again = decode_request(data, (ids, keys))
    assert (again.roster, again.public_keys, again.round, req.party) == (ids, keys, 1, 1)
    full = decode_request(encode_request(Request(1, 1, -1), params))[1]
    assert (full.roster, full.public_keys) == (ids, keys)


def test_every_schedule_travels_in_requests_and_a_tail_costs_no_extra_bytes():
    import struct

    from flwr_inca.flower.relay import Request
    from flwr_inca.flower.wire import decode_request, encode_request

    keys, ids, T = [KeyPair().public for _ in range(2)], [3, 4], 8
    sizes = {}
    for schedule in (InjectionSchedule.incremental(T), InjectionSchedule.early(T),
                     InjectionSchedule.incremental(T, tail=3),
                     InjectionSchedule.custom(InjectionSchedule.incremental(T, tail=3).c[::-1].copy(),
                                              InjectionSchedule.incremental(T).Z)):
        params = RoundParams(1, T, 1, 0.5, 2.0, schedule, ids, keys)
        data = encode_request(Request(1, 1, -1), params)
        again = decode_request(data)[1].schedule
        assert again.name == schedule.name
        assert np.array_equal(again.c, schedule.c) and np.array_equal(again.Z, schedule.Z)
        sizes[schedule.name] = len(data)
    assert sizes["incremental:tail=3"] == sizes["incremental"] < sizes["custom"]
    # a tail longer than the iterations is a malformed header, refused
    params = RoundParams(1, T, 1, 0.5, 2.0, InjectionSchedule.incremental(T, tail=3), ids, keys)
    data = bytearray(encode_request(Request(1, 1, -1), params))
    offset = struct.calcsize("<4sqqqddB")
    data[offset] = 3 + T + 1
    with pytest.raises(ValueError, match="malformed request header"):
        decode_request(bytes(data))
