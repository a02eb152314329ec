"""Packages that import each public name when first used (PEP 562), so that a process needing one part
(a ClientApp, a Ray actor, a ledger) does not load the rest."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, where: dict[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package``: a name of ``where`` (name -> the
    relative submodule that defines it, ``".ledger"``) is imported on first use and kept in ``namespace``
    (the package's ``globals()``), so that later lookups do not come here; any other name is an
    AttributeError."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(where[name], package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
