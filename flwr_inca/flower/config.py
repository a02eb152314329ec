"""``IncaStrategy``'s settings: the shared groups of :mod:`flwr_inca.settings` (:class:`PrivacyTarget`,
:class:`MixingConfig`, :class:`PersistenceConfig`, the same objects the simulator takes) and Flower's own
:class:`RelayConfig` (timeouts and retries of the relayed exchanges).

Every field can also be given to ``IncaStrategy`` directly as a keyword (``IncaStrategy(max_epsilon=1.0,
iterations=20)``); the groups are for settings kept and shared as objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import check_int, check_real
from ..settings import GROUPS, MixingConfig, PersistenceConfig, PrivacyTarget

__all__ = ["CONFIG_GROUPS", "MixingConfig", "PersistenceConfig", "PrivacyTarget", "RelayConfig"]


@dataclass(frozen=True)
class RelayConfig:
    """The relayed mixing exchanges.

    Attributes:
        exchange_timeout: seconds to wait for the nodes in each mixing exchange; a node that has not
            answered by then is offline for that iteration (Algorithm 2).
        poll_interval: seconds between the first polls for replies in an exchange (a round makes T + 1
            exchanges or more, so mixing starts polling faster than Flower's ``send_and_receive``, 0.1 s in
            simulation); the wait then grows with the exchange's age, a tenth of it, up to
            ``max_poll_interval``, so a slow exchange (Flower's deployment engine: each node polls its
            SuperLink every 3 s) costs the SuperLink a few requests, not one every ``poll_interval``.
        max_poll_interval: the longest wait between two polls (seconds, >= ``poll_interval``): the most a
            reply can wait to be seen.
        final_retries: extra exchanges for final messages still missing after the final report.
        max_offences: a node that deviated from the protocol in this many rounds (invalid replies, payloads
            its receivers refused, a withheld final that failed a round) is no longer sampled (logged by
            node id; docs/reliability.md).
    """

    exchange_timeout: float = 60.0
    poll_interval: float = 0.01
    max_poll_interval: float = 1.0
    final_retries: int = 2
    max_offences: int = 2

    def __post_init__(self) -> None:
        check_real("exchange_timeout (seconds)", self.exchange_timeout, 0.0, 86400.0, low_open=True)
        check_real("poll_interval (seconds)", self.poll_interval, 0.0, self.exchange_timeout, low_open=True)
        check_real("max_poll_interval (seconds)", self.max_poll_interval, self.poll_interval, 3600.0)
        check_int("final_retries", self.final_retries, 0, 100)
        check_int("max_offences", self.max_offences, 1)


CONFIG_GROUPS = {**GROUPS, "relay": RelayConfig}
