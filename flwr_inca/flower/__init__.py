"""Flower integration: ``IncaStrategy`` (ServerApp side) and ``IncaClient`` (ClientApp side).

Requires the ``flower`` extra (``pip install "flwr-inca[flower]"``).

Each name is imported when first used: a ClientApp process (the deployment engine starts one per message)
that needs only ``IncaClient`` does not load the strategy's privacy accounting.
"""

from importlib import import_module
from typing import Any

_WHERE = {"IncaClient": ".client", "IncaStrategy": ".strategy", "IncaBudgetExhausted": ".strategy",
          "Offenders": ".offenders", "RoundRecord": ".round", "PrivacyTarget": ".config", "MixingConfig": ".config",
          "RelayConfig": ".config", "PersistenceConfig": ".config"}

__all__ = ["IncaStrategy", "IncaClient", "IncaBudgetExhausted", "Offenders", "RoundRecord", "PrivacyTarget",
           "MixingConfig", "RelayConfig", "PersistenceConfig"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name], __name__), name)
    globals()[name] = value  # later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
