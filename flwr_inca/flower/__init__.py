"""Flower integration: ``IncaStrategy`` (ServerApp side) and ``IncaClient`` (ClientApp side).

Requires the ``flower`` extra (``pip install "flwr-inca[flower]"``).
"""

from .client import IncaClient
from .config import MixingConfig, PersistenceConfig, PrivacyTarget, RelayConfig
from .offenders import Offenders
from .round import RoundRecord
from .strategy import IncaBudgetExhausted, IncaStrategy

__all__ = ["IncaStrategy", "IncaClient", "IncaBudgetExhausted", "Offenders", "RoundRecord", "PrivacyTarget",
           "MixingConfig", "RelayConfig", "PersistenceConfig"]
