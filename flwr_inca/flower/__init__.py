"""Flower integration: ``IncaStrategy`` (ServerApp side) and ``IncaClient`` (ClientApp side).

Requires the ``flower`` extra (``pip install "flwr-inca[flower]"``).

Each name is imported when first used: a ClientApp process (the deployment engine starts one per message)
that needs only ``IncaClient`` does not load the strategy's privacy accounting.
"""

from .._lazy import lazy_exports

_WHERE = {"IncaClient": ".client", "IncaStrategy": ".strategy", "IncaBudgetExhausted": ".strategy",
          "Offenders": ".offenders", "RoundRecord": ".round", "PrivacyTarget": ".config", "MixingConfig": ".config",
          "RelayConfig": ".config", "PersistenceConfig": ".config"}

__all__ = list(_WHERE)

__getattr__, __dir__ = lazy_exports(__name__, _WHERE, globals())
