"""Flower integration: ``IncaStrategy`` (ServerApp side) and ``IncaClient`` (ClientApp side).

Requires the ``flower`` extra (``pip install flwr-inca[flower]``).
"""

from .client import IncaClient
from .strategy import IncaStrategy, RoundRecord

__all__ = ["IncaStrategy", "IncaClient", "RoundRecord"]
