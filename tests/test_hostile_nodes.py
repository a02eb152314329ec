"""One hostile or broken node cannot stop or drain training.

Unit level: one relayed round among simulated parties (the real node code, :func:`handle_exchange`), one
of which deviates: its honest reply is replaced on its way to the relay. Each attack must leave the
round running with the others, the deviating node excluded and named, at most its few direct victims
excluded with it, and the recorded trace exact (the finals replay in the core engine).

End to end: the same through Flower's simulation engine, with one hostile ClientApp among ten nodes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("cryptography")
pytest.importorskip("flwr")

from flwr_inca import InjectionSchedule, replay  # noqa: E402
from flwr_inca.flower.crypto import KeyPair, associated_data, pair_key, seal  # noqa: E402
from flwr_inca.flower.node import RoundSecrets, handle_exchange  # noqa: E402
from flwr_inca.flower.shared import RoundParams  # noqa: E402
from flwr_inca.flower.storage import MemoryStore  # noqa: E402
from flwr_inca.flower.offenders import LOST_FINAL, Offenders  # noqa: E402
from flwr_inca.flower.relay import Outgoing, Rejection, Reply, Request, RoundRelay, drive  # noqa: E402
from flwr_inca.protocol.party import PartyNoise, PartyState  # noqa: E402

ROUND = 4

# deviate(net, party, commit, request, honest_reply) -> the reply the relay gets (None: no reply)
Deviation = Callable[["Network", int, int, Request, Reply], Reply | None]


class Network:
    """``n`` parties of one round with node-local stores and fixed secrets, and the relay."""

    def __init__(self, values: np.ndarray, T: int = 5, k: int = 1, s_star: float = 0.3, s_delta: float = 4.0,
                 precision: str = "float64", final_retries: int = 2) -> None:
        self.values = values
        n, d = values.shape
        self.n, self.d, self.T, self.k = n, d, T, k
        self.schedule = InjectionSchedule.incremental(T)
        self.roster = [20_000 + 11 * i for i in range(n)]
        self.secrets = [RoundSecrets.generate(ROUND, fixed_seed=5, node=node) for node in self.roster]
        self.stores = [MemoryStore() for _ in range(n)]
        for i in range(n):
            self.stores[i].save_value(ROUND, values[i])
        self.params = RoundParams(ROUND, T, k, s_star, s_delta, self.schedule, self.roster,
                                  [s.public_key for s in self.secrets], precision)
        self.relay = RoundRelay(n, T, d, self.schedule, s_star, s_delta, precision, neighbors=k,
                                roster=self.roster)
        self.final_retries = final_retries
        self.seen: list[tuple[int, int, Request, Reply | None]] = []  # (party, commit, request, reply)

    def seal(self, sender: int, receiver: int, iteration: int, plaintext: bytes) -> bytes:
        """What ``sender`` would send ``receiver`` at ``iteration``, properly encrypted."""
        key = pair_key(KeyPair(self.secrets[sender].private_key), self.secrets[receiver].public_key, ROUND)
        ad = associated_data(self.roster[sender], self.roster[receiver], ROUND, iteration)
        return seal(key, plaintext, ad)

    def run(self, deviate: dict[int, Deviation] | None = None) -> RoundRelay:
        deviate = deviate or {}

        def exchange(commit: int, requests: list[Request]) -> dict[int, Reply]:
            replies = {}
            for req in requests:
                i = req.party
                rep = handle_exchange(req, self.params, i, self.secrets[i], self.stores[i])
                if i in deviate:
                    rep = deviate[i](self, i, commit, req, rep)
                self.seen.append((i, commit, req, rep))
                if rep is not None:
                    replies[i] = rep
            return replies

        drive(self.relay, exchange, final_retries=self.final_retries)
        return self.relay

    def check_replay(self) -> np.ndarray:
        """The recorded trace replays, in the core engine, to exactly the finals that were reported."""
        relay = self.relay
        trace = relay.trace()
        noise = PartyNoise.explicit([PartyNoise(s.noise_secret, ROUND) for s in self.secrets], self.d, self.T)
        res = replay(trace, self.values, seed=0, noise=noise, finalists=sorted(relay.finals))
        assert np.allclose(res.estimate, relay.estimate(), atol=1e-10, rtol=1e-10)
        return trace.online_mask()


def _values(n: int = 10, d: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, d))


def _assert_contained(net: Network, hostile: int, victims: int) -> None:
    """The round completed without the hostile party and at most ``victims`` others; nobody else lost."""
    relay = net.relay
    assert hostile in relay.offenders and hostile in relay.excluded
    others = set(relay.excluded) - {hostile}
    assert len(others) <= victims, relay.excluded
    assert sorted(relay.finals) == sorted(set(range(net.n)) - set(relay.excluded))
    assert relay.estimate() is not None and np.all(np.isfinite(relay.estimate()))


def _honest_iterations(net: Network, party: int) -> list[int]:
    return [int(t) for t in np.flatnonzero(net.check_replay()[:, party])]


# ---------------------------------------------------------------------------------------------- deviations
def crafted_retransmission(iteration: int, at_commit: int = 2) -> Deviation:
    """A retransmission nobody asked for, of a right-sized payload, for ``iteration``."""
    def deviate(net, i, commit, req, rep):
        if commit == at_commit:
            junk = Outgoing(i, (i + 1) % net.n, 0.0, bytes(net.relay.payload_bytes), iteration)
            rep = replace(rep, retransmissions=[*rep.retransmissions, junk])
        return rep
    return deviate


def fan_out_garbage(net, i, commit, req, rep):
    """Weight 1/n to every peer, right-sized random payloads (and random retransmissions)."""
    rng = np.random.default_rng([i, commit])
    size = net.relay.payload_bytes
    if commit <= net.T:
        rep = replace(rep, outgoing=[Outgoing(i, j, 1.0 / net.n, rng.bytes(size), commit)
                                     for j in range(net.n) if j != i])
    return replace(rep, retransmissions=[replace(m, payload=rng.bytes(size)) for m in rep.retransmissions])


def garbage(net, i, commit, req, rep):
    """The protocol's k neighbours and weights, but right-sized random payloads, retransmissions too."""
    rng = np.random.default_rng([i, commit])
    size = net.relay.payload_bytes
    return replace(rep, outgoing=[replace(m, payload=rng.bytes(size)) for m in rep.outgoing],
                   retransmissions=[replace(m, payload=rng.bytes(size)) for m in rep.retransmissions])


def sealed(y: float, omega: float = 0.5) -> Deviation:
    """Properly encrypted states whose every value is ``y`` (NaN, inf, huge), with weight ``omega``."""
    def deviate(net, i, commit, req, rep):
        def bad(m: Outgoing) -> Outgoing:
            state = PartyState(np.full(net.d, y), omega, m.iteration - 1, m.iteration)
            return replace(m, payload=net.seal(i, m.receiver, m.iteration,
                                               state.to_bytes(net.params.precision)))
        return replace(rep, outgoing=[bad(m) for m in rep.outgoing],
                       retransmissions=[bad(m) for m in rep.retransmissions])
    return deviate


def misaddressed(net, i, commit, req, rep):
    """Payloads sealed for another receiver (properly encrypted, bound to the wrong party); retransmissions
    withheld."""
    def other(m: Outgoing) -> Outgoing:
        wrong = next(j for j in range(net.n) if j not in (i, m.receiver))
        state = PartyState(np.zeros(net.d), 0.5, m.iteration - 1, m.iteration).to_bytes(net.params.precision)
        return replace(m, payload=net.seal(i, wrong, m.iteration, state))
    return replace(rep, outgoing=[other(m) for m in rep.outgoing], retransmissions=[])


def replayed(net, i, commit, req, rep):
    """Each commit replays the payloads of the party's first commit (same bytes, stale iteration)."""
    first = next((r for (p, c, _, r) in net.seen if p == i and c == 1 and r is not None and r.outgoing), None)
    if first is not None and commit > 1 and rep.outgoing:
        rep = replace(rep, outgoing=[replace(m, payload=first.outgoing[0].payload) for m in rep.outgoing])
    return replace(rep, retransmissions=[])


def false_rejections(net, i, commit, req, rep):
    """Claims every payload it receives failed authentication (it computes nothing)."""
    if req.task > 0 and req.incoming:
        return Reply(i, rejected=[(m.sender, int(Rejection.AUTHENTICATION)) for m in req.incoming],
                     retransmissions=rep.retransmissions)
    return rep


# ---------------------------------------------------------------------------------------------- attacks
@pytest.mark.parametrize("iteration", [6, -1, 10**12])
def test_a_crafted_retransmission_excludes_its_sender_and_never_crashes_the_relay(iteration):
    net = Network(_values(), T=5)
    net.run({3: crafted_retransmission(iteration)})
    _assert_contained(net, 3, victims=0)
    reason = net.relay.offenders[3]
    assert "not asked for" in reason and f"node {net.roster[4]}" in reason  # named by node id
    online = net.check_replay()
    assert online[1, 3] and not online[2:, 3].any()  # excluded from the exchange that committed to 2 on
    assert online[:, np.arange(10) != 3].all()  # nobody else lost an iteration


def test_weight_one_over_n_to_every_peer_is_an_invalid_commit():
    net = Network(_values(), T=5, k=1)
    net.run({0: fan_out_garbage})
    _assert_contained(net, 0, victims=0)
    assert "k = 1" in net.relay.offenders[0]
    online = net.check_replay()
    assert not online[1:, 0].any() and online[:, 1:].all()  # never delivered a single payload


@pytest.mark.parametrize("attack, words, first_bad", [
    (garbage, "failed authentication", 1),
    (sealed(float("nan")), "not finite", 1),
    (sealed(float("inf")), "not finite", 1),
    (sealed(1e300), "not finite", 1),  # finite, but sums of such would overflow: the receiver refuses it
    (sealed(0.0, omega=-1.0), "not finite", 1),  # a negative weight omega
    (misaddressed, "failed authentication", 1),
    (replayed, "failed authentication", 2),  # its first commit is honest
])
@pytest.mark.parametrize("k", [1, 2])
def test_bad_payloads_cost_the_round_at_most_the_senders_receivers_of_one_iteration(attack, words, first_bad,
                                                                                    k):
    net = Network(_values(12, seed=k), T=6, k=k)
    hostile = 5
    net.run({hostile: attack})
    relay = net.relay
    # the receivers of its first bad iteration refused its payloads; it was held (no further commit) until
    # it retransmitted; the retransmissions were refused again (or withheld): it and those receivers are out
    _assert_contained(net, hostile, victims=k)
    assert relay.disputes >= 1 and words in relay.offenders[hostile]
    for victim in set(relay.excluded) - {hostile}:
        assert str(net.roster[hostile]) in relay.excluded[victim]
    online = net.check_replay()  # the trace is exactly what happened
    assert online[net.T].sum() == net.n - len(relay.excluded)
    # online until its first bad payloads, held from their refusal on, then excluded
    assert online[:first_bad + 1, hostile].all() and not online[first_bad + 1:, hostile].any()


def test_a_receiver_that_refuses_everything_takes_only_one_iterations_senders_with_it():
    net = Network(_values(12, seed=3), T=6, k=1)
    hostile = 4
    net.run({hostile: false_rejections})
    relay = net.relay
    first = next(req for (p, c, req, rep) in net.seen if p == hostile and req.task > 0 and req.incoming)
    senders = {m.sender for m in first.incoming}
    # the relay cannot tell who lies: a dispute excludes both sides; the liar is then out, so it takes at
    # most the senders of that one iteration with it
    assert hostile in relay.excluded and 1 <= len(set(relay.excluded) & senders)
    assert set(relay.excluded) <= senders | {hostile}
    assert all(i in relay.offenders for i in relay.excluded)
    _assert_contained(net, hostile, victims=len(senders))
    net.check_replay()


def test_without_a_deviation_nobody_is_excluded():
    net = Network(_values(), T=5, k=2)
    net.run()
    assert net.relay.offenders == {} and net.relay.excluded == {} and net.relay.disputes == 0
    assert sorted(net.relay.finals) == list(range(10)) and net.check_replay().all()


# ---------------------------------------------------------------------------------------------- every field
def _at(commit: int, change: Callable[[Network, int, Request, Reply], Reply]) -> Deviation:
    """The honest reply, changed by ``change`` in the exchange committing to ``commit`` only."""
    def deviate(net, i, c, req, rep):
        return change(net, i, req, rep) if c == commit and rep is not None else rep
    return deviate


def _first_to(net: Network, i: int, req: Request, rep: Reply, **fields) -> Reply:
    return replace(rep, outgoing=[replace(rep.outgoing[0], **fields)] + rep.outgoing[1:])


REPLY_ATTACKS = {
    "another party's reply": (3, lambda net, i, req, rep: replace(rep, party=(i + 1) % net.n), "in place of"),
    "computed another iteration": (3, lambda net, i, req, rep: replace(rep, computed=req.task + 1),
                                   "its task"),
    "refused a payload it was not sent": (
        3, lambda net, i, req, rep: replace(rep, computed=-1, outgoing=[], rejected=[(i, 1)]), "not sent"),
    "refused with an unknown reason": (
        3, lambda net, i, req, rep: replace(rep, computed=-1, outgoing=[],
                                           rejected=[(req.incoming[0].sender, 9)]) if req.incoming else
        replace(rep, computed=-1, outgoing=[], rejected=[(0, 9)]), "9"),
    "refused and still committed": (
        3, lambda net, i, req, rep: replace(rep, rejected=[(req.incoming[0].sender, 1)]) if req.incoming else
        replace(rep, rejected=[(0, 1)]), ""),
    "asked for a restore with nothing to restore": (1, lambda net, i, req, rep: Reply(i, need_restore=True),
                                                    "never committed"),
    "no commit": (3, lambda net, i, req, rep: replace(rep, outgoing=[]), "at least one message"),
    "a message for another iteration": (3, lambda net, i, req, rep: _first_to(net, i, req, rep, iteration=2),
                                        "another iteration"),
    "a message to itself": (3, lambda net, i, req, rep: _first_to(net, i, req, rep, receiver=i), "itself"),
    "a message to nobody": (3, lambda net, i, req, rep: _first_to(net, i, req, rep, receiver=net.n),
                            "indices"),
    "a message of another sender": (
        3, lambda net, i, req, rep: _first_to(net, i, req, rep, sender=(i + 1) % net.n), "own messages"),
    "a short payload": (3, lambda net, i, req, rep: _first_to(net, i, req, rep, payload=b"x" * 10), "bytes"),
    "a payload that is not bytes": (3, lambda net, i, req, rep: _first_to(net, i, req, rep, payload=None),
                                    "NoneType"),
    "a weight of 0.4": (3, lambda net, i, req, rep: _first_to(net, i, req, rep, weight=0.4), "1/(k+1)"),
    "a weight of 1": (3, lambda net, i, req, rep: _first_to(net, i, req, rep, weight=1.0),
                      "column stochastic"),
    "a NaN weight": (3, lambda net, i, req, rep: _first_to(net, i, req, rep, weight=float("nan")), "(0, 1]"),
    "two messages to one receiver": (3, lambda net, i, req, rep: replace(rep, outgoing=rep.outgoing * 2),
                                     "duplicate"),
    "a final in the middle of the round": (
        3, lambda net, i, req, rep: replace(rep, final=np.zeros(net.d), final_omega=1.0), "not asked"),
    "messages after the last iteration": (
        6, lambda net, i, req, rep: replace(rep, outgoing=[Outgoing(i, (i + 1) % net.n, 0.5,
                                                                     bytes(net.relay.payload_bytes), 6)]),
        "after the last iteration"),
    "no final": (6, lambda net, i, req, rep: replace(rep, final=None, final_omega=None), "no final message"),
    "a final of another dimension": (
        6, lambda net, i, req, rep: replace(rep, final=np.zeros(net.d + 1)), "malformed final"),
    "a final with a string weight": (6, lambda net, i, req, rep: replace(rep, final_omega="1"), "omega"),
    "a reply the adapter could not read": (2, lambda net, i, req, rep: Reply(i, invalid="malformed reply: x"),
                                           "malformed reply: x"),
}


@pytest.mark.parametrize("name", sorted(REPLY_ATTACKS))
def test_every_field_of_a_reply_is_validated_and_an_invalid_reply_excludes_only_its_party(name):
    commit, change, words = REPLY_ATTACKS[name]
    net = Network(_values(8, seed=2), T=5, k=2)
    hostile = 6
    net.run({hostile: _at(commit, change)})
    relay = net.relay
    assert relay.invalid_replies == 1 and set(relay.excluded) == set(relay.offenders) == {hostile}
    assert words in relay.offenders[hostile] and relay.offenders[hostile].startswith("invalid reply")
    assert sorted(relay.finals) == [i for i in range(8) if i != hostile]
    online = net.check_replay()
    assert not online[min(commit, net.T + 1):, hostile].any() and online[:commit, hostile].all()
    assert online[:, np.arange(8) != hostile].all()  # nobody else lost an iteration


# ---------------------------------------------------------------------------------------------- disputes
def _silent_from(commit: int, inner: Deviation | None = None) -> Deviation:
    """Deviates with ``inner`` (if any), and never replies from the exchange committing to ``commit`` on."""
    def deviate(net, i, c, req, rep):
        if c >= commit:
            return None
        return rep if inner is None else inner(net, i, c, req, rep)
    return deviate


def test_a_sender_that_does_not_send_a_refused_payload_again_in_time_is_in_a_dispute():
    net = Network(_values(9, seed=4), T=6, k=1)
    # garbage at iteration 1, refused in the exchange committing to 2, then silent: a dropout that owes a
    # payload; its receiver waits RETRANSMIT_EXCHANGES exchanges for it
    net.run({2: _silent_from(3, garbage)})
    relay = net.relay
    assert relay.disputes == 1 and set(relay.excluded) == set(relay.offenders) and len(relay.excluded) == 2
    assert "not sent again within 2 exchanges" in relay.offenders[2]
    victim = next(i for i in relay.excluded if i != 2)
    online = net.check_replay()
    assert not online[2:, victim].any()  # waited from the refusal on, then excluded
    assert sorted(relay.finals) == sorted(set(range(9)) - {2, victim})


def test_receivers_waiting_for_an_excluded_sender_are_excluded_but_not_offenders():
    net = Network(_values(9, seed=5), T=6, k=2)
    # garbage at iteration 1; in the exchange where it must send it again, an invalid reply instead

    def deviate(net, i, commit, req, rep):
        if commit == 3:
            return replace(rep, party=i + 1)
        return garbage(net, i, commit, req, rep)

    net.run({3: deviate})
    relay = net.relay
    assert relay.offenders.keys() == {3} and relay.disputes == 0
    victims = set(relay.excluded) - {3}
    assert len(victims) == 2 and all("was excluded" in relay.excluded[v] for v in victims)
    net.check_replay()


def test_bad_payloads_of_the_last_iteration_are_sorted_out_in_the_final_retries():
    net = Network(_values(9, seed=6), T=4, k=2, final_retries=2)
    last = _at(4, lambda net, i, req, rep: garbage(net, i, 4, req, rep))  # garbage at iteration T only

    def deviate(net, i, commit, req, rep):
        rep = last(net, i, commit, req, rep)
        return replace(rep, retransmissions=[replace(m, payload=bytes(len(m.payload)))
                                             for m in rep.retransmissions])

    net.run({1: deviate})
    relay = net.relay
    # refused twice by the first receiver: a dispute; the second, refusing it again, is left waiting for
    # an excluded sender
    assert relay.disputes == 1 and len(relay.excluded) == 3
    assert len(relay.offenders) == 2 and 1 in relay.offenders
    online = net.check_replay()
    assert online.all()  # everybody was online throughout: the finals of three are missing
    assert relay.missing_finals() == sorted(relay.excluded)


def test_a_refusal_unresolved_when_the_round_ends_is_a_dispute():
    net = Network(_values(9, seed=6), T=4, k=1, final_retries=0)
    net.run({1: _at(4, lambda net, i, req, rep: garbage(net, i, 4, req, rep))})
    relay = net.relay
    assert relay.disputes == 1 and len(relay.offenders) == 2
    assert all("round ended" in why for why in relay.offenders.values())
    assert 1 not in relay.finals  # its final had arrived; it is one side of the dispute
    net.check_replay()


@pytest.mark.parametrize("attack", [garbage, sealed(float("nan")), false_rejections, misaddressed,
                                    crafted_retransmission(6), _at(3, REPLY_ATTACKS["a weight of 0.4"][1])])
def test_iterations_committed_earlier_never_change(attack):
    """The budget guard certifies iterations 1..u once the exchange committing to u is ingested: what
    happens later (exclusions, retransmissions) must never change them."""
    net = Network(_values(10, seed=7), T=6, k=2)
    snapshots = {}
    original = net.relay.ingest

    def ingest(commit, replies, requests):
        original(commit, replies, requests)
        if commit <= net.T:
            snapshots[commit] = [net.relay.step(t) for t in range(1, commit + 1)]

    net.relay.ingest = ingest
    net.run({5: attack})
    final = net.relay.trace()
    for u, steps in snapshots.items():
        for t, step in enumerate(steps, start=1):
            assert np.array_equal(step.online, final.steps[t - 1].online)
            for a, b in zip(step.messages.__dict__.values(), final.steps[t - 1].messages.__dict__.values()):
                assert np.array_equal(a, b)
    assert net.relay.excluded


# ---------------------------------------------------------------------------------------------- node, wire
def _flip_last_bit(payload: bytes) -> bytes:
    """The payload with its last bit flipped: always a change (overwriting a byte is none 1 time in 256)."""
    return payload[:-1] + bytes([payload[-1] ^ 1])


def test_a_receiver_refuses_what_an_honest_sender_cannot_send_naming_it_and_why():
    from flwr_inca.flower.node import state_limit

    net = Network(_values(3, d=5, seed=8), T=2, k=2)
    honest = PartyState(np.ones(5), 0.5, 0, 1)
    cases = {
        "fine": (net.seal(0, 2, 1, honest.to_bytes()), None),
        "tampered": (_flip_last_bit(net.seal(0, 2, 1, honest.to_bytes())), Rejection.AUTHENTICATION),
        "for another receiver": (net.seal(0, 1, 1, honest.to_bytes()), Rejection.AUTHENTICATION),
        "of another iteration": (net.seal(0, 2, 2, honest.to_bytes()), Rejection.AUTHENTICATION),
        "other dimension": (net.seal(0, 2, 1, PartyState(np.ones(4), 0.5, 0, 1).to_bytes()),
                            Rejection.MALFORMED),
        "not a state": (net.seal(0, 2, 1, b"\x01" * 20), Rejection.MALFORMED),
        "NaN": (net.seal(0, 2, 1, replace(honest, y=np.full(5, np.nan)).to_bytes()), Rejection.INVALID_VALUE),
        "-inf": (net.seal(0, 2, 1, replace(honest, y=np.full(5, -np.inf)).to_bytes()),
                 Rejection.INVALID_VALUE),
        "huge": (net.seal(0, 2, 1, replace(honest, y=np.full(5, 2 * state_limit(np.float64))).to_bytes()),
                 Rejection.INVALID_VALUE),
        "omega > n": (net.seal(0, 2, 1, replace(honest, omega=3.5).to_bytes()), Rejection.INVALID_VALUE),
        "omega NaN": (net.seal(0, 2, 1, replace(honest, omega=np.nan).to_bytes()), Rejection.INVALID_VALUE),
    }
    for name, (payload, expected) in cases.items():
        store = net.stores[2]
        handle_exchange(Request(2, 1, -1, task=0), net.params, 2, net.secrets[2], store)  # computes y^(0)
        req = Request(2, 2, 0, task=1, incoming=[Outgoing(0, 2, 1 / 3, payload, 1)], delivered_weight=1 / 3)
        rep = handle_exchange(req, net.params, 2, net.secrets[2], store)
        if expected is None:
            assert rep.rejected == [] and rep.computed == 1, name
        else:
            assert rep.rejected == [(0, int(expected))] and rep.computed == -1 and not rep.outgoing, name


def test_refusals_and_their_reasons_survive_the_wire():
    from flwr_inca.flower.wire import decode_reply, encode_reply

    rep = Reply(3, rejected=[(0, int(Rejection.AUTHENTICATION)), (7, int(Rejection.INVALID_VALUE))],
                retransmissions=[Outgoing(3, 1, 0.0, b"p" * 40, 2)])
    back, keeps = decode_reply(encode_reply(rep, has_roster=True), 3)
    assert back.rejected == rep.rejected and keeps and back.retransmissions == rep.retransmissions
    with pytest.raises(ValueError, match="truncated"):
        decode_reply(encode_reply(rep)[:-45], 3)


def test_a_refusal_is_settled_in_the_final_exchanges_even_when_the_receiver_left_the_round():
    # the receiver refuses at exchange 2 and is offline from then on; the bad payload is sent again at
    # exchange 3 = T: the receiver checks it in the final exchange although its computation no longer
    # counts, so the sender cannot escape by deviating late
    net = Network(_values(9, seed=9), T=3, k=1)
    net.run({2: garbage})
    relay = net.relay
    assert relay.disputes == 1 and 2 in relay.offenders and len(relay.offenders) == 2
    net.check_replay()


# ---------------------------------------------------------------------------------------------- across rounds
def test_offenders_are_barred_after_max_offences_in_distinct_rounds_and_logged(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="flwr")
    book = Offenders(max_offences=2)
    assert book.record(1, {7: "an invalid reply", 9: "one side of a dispute"}) == []
    assert book.record(1, {7: "counted once per round"}) == [] and book.count(7) == 1
    assert book.record(2, {7: "again"}) == [7] and book.barred == {7}
    assert book.record(3, {7: "and again"}) == [] and book.count(7) == 3  # still recorded
    assert book.admit(4, [5, 7, 9]) == [5, 9]
    text = caplog.text
    assert "node 7 deviated from the protocol (offence 2 of 2): again" in text
    assert "node 7 is barred from later rounds after 2 offences (rounds 1, 2)" in text
    assert "IncA round 4: node 7 not sampled: barred since round 2 (3 offences)" in text
    never = Offenders(max_offences=None)
    never.record(1, {3: "x"})
    never.record(2, {3: "y"})
    assert never.barred == frozenset() and never.admit(3, [3]) == [3]
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_offences"):
            Offenders(max_offences=bad)


def test_a_rounds_offences_by_node_id_and_lost_finals_only_when_the_round_failed(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="flwr")
    # a dispute at iteration 1 (two offenders, the sender's second receiver a victim), and party 7 loses its
    # final after the last iteration
    net = Network(_values(9, seed=10), T=3, k=2, final_retries=0)
    silent_final = _at(4, lambda net, i, req, rep: None)
    net.run({2: garbage, 7: silent_final})
    relay = net.relay
    assert relay.missing_finals() == [7] and len(relay.offenders) == 2 and len(relay.excluded) == 3
    book = Offenders()
    offences = book.record_round(1, net.roster, relay, failed=False)
    assert offences == {net.roster[i]: why for i, why in relay.offenders.items()}
    offences = book.record_round(2, net.roster, relay, failed=True)
    assert offences[net.roster[7]] == LOST_FINAL and len(offences) == 3
    victim = next(i for i in relay.excluded if i not in relay.offenders)
    assert f"node {net.roster[victim]} excluded from the rest of the round" in caplog.text
    assert book.barred == {net.roster[i] for i in relay.offenders}  # two rounds each


# ---------------------------------------------------------------------------------------------- end to end
HOSTILE_ENV = "INCA_TEST_HOSTILE_NODE"  # "<partition>:<attack of round 1>,<attack of round 2>,..."
E2E_NODES, E2E_T = 10, 3


def _e2e_plan() -> tuple[int, list[str]]:
    partition, _, attacks = os.environ.get(HOSTILE_ENV, "-1:").partition(":")
    return int(partition), attacks.split(",")


def hostile_mod(msg, context, call_next):
    """ClientApp mod: the node of the planned partition rewrites its mixing replies. ``fan-out``: weight 1/n
    to every other node, random right-sized payloads; ``garbage``: its k neighbours and weights, random
    payloads (retransmissions too); ``retransmit``: a retransmission nobody asked for, of iteration T + 1;
    ``withhold``: no final message (an error in every final exchange)."""
    from flwr.app import ConfigRecord

    from flwr_inca.flower.shared import INCA_KEY, MIX_ACTION
    from flwr_inca.flower.wire import FIELD, decode_reply, encode_reply, peek_request

    partition, attacks = _e2e_plan()
    if msg.metadata.message_type != f"train.{MIX_ACTION}" \
            or int(context.node_config["partition-id"]) != partition:
        return call_next(msg, context)
    rnd, commit, party = peek_request(msg.content.config_records[INCA_KEY][FIELD])
    attack = attacks[rnd - 1] if rnd <= len(attacks) else ""
    if attack == "withhold" and commit > E2E_T:
        raise RuntimeError("withholding the final message")
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    record = reply.content.config_records[INCA_KEY]
    if FIELD not in record or not attack:
        return reply
    rep, keeps = decode_reply(record[FIELD], party)
    size, rng = (len(rep.outgoing[0].payload) if rep.outgoing else 0), np.random.default_rng([rnd, commit])
    if attack == "fan-out" and rep.outgoing:
        rep.outgoing = [Outgoing(party, j, 1.0 / E2E_NODES, rng.bytes(size), commit)
                        for j in range(E2E_NODES) if j != party]
    elif attack == "garbage":
        rep.outgoing = [replace(m, payload=rng.bytes(len(m.payload))) for m in rep.outgoing]
        rep.retransmissions = [replace(m, payload=rng.bytes(len(m.payload))) for m in rep.retransmissions]
    elif attack == "retransmit" and commit == 2:
        rep.retransmissions.append(Outgoing(party, (party + 1) % E2E_NODES, 0.0, bytes(size), E2E_T + 1))
    reply.content.config_records[INCA_KEY] = ConfigRecord({FIELD: encode_reply(rep, keeps)})
    return reply


def _hostile_client_app():
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from flwr_inca.flower import IncaClient

    app = ClientApp(mods=[hostile_mod])
    inca = IncaClient(app, insecure_fixed_seed=3)

    @inca.train()
    def train(msg, context):
        pid, rnd = int(context.node_config["partition-id"]), int(msg.content["config"]["server-round"])
        rng = np.random.default_rng([pid, rnd])
        old = msg.content["arrays"].to_numpy_ndarrays()
        new = [(a + rng.normal(0.0, 0.3, a.shape)).astype(a.dtype) for a in old]
        metrics = MetricRecord({"num-examples": 1, "partition-id": pid})
        return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)

    return app


hostile_client = _hostile_client_app()  # at module level: the simulation's workers import it


@pytest.mark.flower
def test_one_hostile_node_in_a_flower_simulation_is_barred_and_every_round_trains(tmp_path, ray_cluster):
    pytest.importorskip("ray")
    import logging

    from flwr.app import ArrayRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flower_apps import on_the_session_cluster
    from flwr.simulation import run_simulation

    from flwr_inca.flower import IncaStrategy
    from flwr_inca.flower.shared import flatten_arrays

    hostile_pid, rounds = 0, 5
    os.environ[HOSTILE_ENV] = f"{hostile_pid}:fan-out,garbage,withhold,garbage,garbage"
    initial = [np.zeros((3, 4), dtype=np.float32), np.zeros(5, dtype=np.float32)]
    out: dict = {}
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("flwr").addHandler(handler)
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = IncaStrategy(iterations=E2E_T, sigma_star=0.2, sigma_delta=5.0, clip_norm=1.0,
                                precision="float64", ledger_path=tmp_path / "ledger.json", seed=4,
                                forward_client_metrics=True, fraction_evaluate=0.0, exchange_timeout=120,
                                min_available_nodes=E2E_NODES, min_train_nodes=E2E_NODES)
        strategy.offenders = Offenders(max_offences=3)
        models: dict = {}

        def keep(rnd, arrays):
            models[rnd] = flatten_arrays(arrays)[0]

        out["result"] = strategy.start(grid=grid, initial_arrays=ArrayRecord(initial), num_rounds=rounds,
                                       evaluate_fn=keep)
        out.update(strategy=strategy, models=models)

    try:
        run_simulation(server_app=app, client_app=hostile_client, num_supernodes=E2E_NODES,
                       backend_config=on_the_session_cluster(ray_cluster[0]))
    finally:
        os.environ.pop(HOSTILE_ENV, None)
        logging.getLogger("flwr").removeHandler(handler)
    assert "strategy" in out, "the ServerApp failed: see the log above"
    strategy, models = out["strategy"], out["models"]
    node = {int(m["partition-id"]): n for n, m in strategy.rounds[1].client_metrics.items()}[hostile_pid]
    # rounds 1 and 2: the hostile node deviated (an invalid commit, then refused payloads), was excluded
    # from the rest of the round, and the round trained with the others
    for rnd, words in [(1, "every party sends k = 1"), (2, "refused")]:
        record = strategy.rounds[rnd]
        assert node in record.roster and words in record.offenders[node], (rnd, record.offenders)
        assert not record.failed and record.update is not None and len(record.finalists) >= E2E_NODES - 2
        assert len(record.offenders) <= 2  # the hostile node, and in round 2 the receiver of its garbage
    # round 3: it took part in the last iteration and withheld its final message: a dropout, but one that
    # leaves the round's noise uncancelled, so the round fails (charged, model kept): its third offence
    three = strategy.rounds[3]
    assert "noise std" in three.failed and three.offenders == {node: LOST_FINAL}
    assert [o.round for o in strategy.offenders.offences[node]] == [1, 2, 3]
    assert strategy.offenders.barred == {node}
    # rounds 4 and 5: barred, not sampled; the others train
    for rnd in (4, 5):
        record = strategy.rounds[rnd]
        assert node not in record.roster and len(record.roster) == E2E_NODES - 1 and not record.failed
        assert record.offenders == {}
    assert any(f"node {node} not sampled: barred" in line for line in lines)
    assert any(f"node {node} is barred from later rounds after 3 offences" in line for line in lines)
    # every round was charged; only the round it could fail did not change the model, and it cannot fail
    # another: one node drains at most max_offences rounds, however it deviates
    assert strategy.ledger.rounds == rounds and strategy.rounds_trained == rounds - 1
    for r in range(1, rounds + 1):
        assert np.all(np.isfinite(models[r])) and np.array_equal(models[r], models[r - 1]) == (r == 3)
