"""A party's mixing step and the relay's bookkeeping, in one process without Flower.

Runs relayed rounds (n parties, d = 7850, T = 10, k = 1, float32 messages, node-local storage in a
temporary directory) in two configurations, interleaved round by round:

* ``draw while mixing``: each step draws the noise it injects (``IncaClient(noise_ahead_bytes=0)``);
* ``noise ahead``: the round's unit noise is drawn into storage when the party joins (the default),
  and each step reads the two rows it needs.

Prints, per configuration, the median over rounds of the mean time of a party's call (decode the
request, ``handle_exchange``, encode the reply; the first exchange, which computes x + eta*, is
left out) and its ratio to the first configuration in the same run, and the relay's bookkeeping
per exchange (requests, encoding, decoding, ingest).

    python benchmarks/bench_party.py                 # n = 100, 5 rounds per configuration
    python benchmarks/bench_party.py --nodes 50 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from flwr_inca.flower.node import RoundSecrets, draw_noise_ahead, handle_exchange
from flwr_inca.flower.shared import RoundParams
from flwr_inca.flower.storage import DirectoryStore
from flwr_inca.flower.relay import RoundRelay, drive
from flwr_inca.flower.wire import decode_reply, decode_request, encode_reply, encode_request
from flwr_inca.protocol.schedules import InjectionSchedule

D, T, K = 7850, 10, 1
CONFIGS = ("draw while mixing", "noise ahead")


def one_round(n: int, config: str, root: str, seed: int) -> tuple[float, float]:
    """(ms per party call, ms of relay bookkeeping per exchange) of one round."""
    schedule = InjectionSchedule.incremental(T)
    roster = [1000 + i for i in range(n)]
    secrets = [RoundSecrets.generate(seed, fixed_seed=seed, node=node) for node in roster]
    stores = [DirectoryStore(os.path.join(root, f"node-{i}")) for i in range(n)]
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(n, D))
    for i in range(n):
        stores[i].save_value(seed, values[i])
        if config == "noise ahead":
            draw_noise_ahead(stores[i], secrets[i], T, D)
    params = RoundParams(seed, T, K, 0.1, 1.0, schedule, roster, [s.public_key for s in secrets], "float32")
    relay = RoundRelay(n, T, D, schedule, 0.1, 1.0, "float32")
    party_s, calls, relay_s = [0.0], [0], [0.0]

    def exchange(commit, requests):
        start = time.perf_counter()
        wire = [encode_request(req, params, with_roster=commit == 1) for req in requests]
        relay_s[0] += time.perf_counter() - start
        answers = {}
        for req, data in zip(requests, wire):
            i = req.party
            start = time.perf_counter()
            request, p = decode_request(data, (params.roster, params.public_keys))
            answers[i] = encode_reply(handle_exchange(request, p, i, secrets[i], stores[i]), has_roster=True)
            if commit > 1:
                party_s[0] += time.perf_counter() - start
                calls[0] += 1
        start = time.perf_counter()
        replies = {i: decode_reply(data, i)[0] for i, data in answers.items()}
        relay_s[0] += time.perf_counter() - start
        return replies

    timed_relay = {}
    for name in ("requests", "ingest"):
        method = getattr(relay, name)

        def timed(*args, _method=method):
            start = time.perf_counter()
            out = _method(*args)
            relay_s[0] += time.perf_counter() - start
            return out

        timed_relay[name] = timed
    relay.requests, relay.ingest = timed_relay["requests"], timed_relay["ingest"]
    drive(relay, exchange)
    if len(relay.finals) != n:
        raise RuntimeError(f"round {seed} ({config}): {len(relay.finals)} of {n} finals")
    return 1e3 * party_s[0] / calls[0], 1e3 * relay_s[0] / (T + 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.nodes < 2 or args.rounds < 1:
        p.error("--nodes must be >= 2 and --rounds >= 1")
    results = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.rounds):
            for c in CONFIGS:
                results[c].append(one_round(args.nodes, c, root, seed=1 + r))
    print(f"n = {args.nodes}, d = {D}, T = {T}, k = {K}, float32 messages; "
          f"medians over {args.rounds} rounds\n")
    print(f"{'configuration':<18} {'party call (ms)':>16} {'ratio':>6} {'relay per exchange (ms)':>24}")
    first = statistics.median(x[0] for x in results[CONFIGS[0]])
    for c in CONFIGS:
        call = statistics.median(x[0] for x in results[c])
        bookkeeping = statistics.median(x[1] for x in results[c])
        print(f"{c:<18} {call:>16.3f} {call / first:>6.2f} {bookkeeping:>24.2f}")


if __name__ == "__main__":
    main()
