"""Keep third-party imports from configuring the user's logging.

Importing Opacus runs ``logging.basicConfig(...)`` (in ``opacus.utils.module_utils``): when the
root logger has no handler yet, that installs one, and from then on every record that propagates to
the root, Flower's included, is printed a second time (``11/23/2026 23:34:57:INFO:...``), DEBUG lines
too. A library must leave the root logger to the application, so :func:`install` puts a small import
hook on ``sys.meta_path`` that lets that module load normally and then removes the root handler(s)
its import added, and only those: a handler the user configured before or after is never touched.
Nothing is imported ahead of need (Opacus and torch stay lazy).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from types import ModuleType
from typing import Any

__all__ = ["install", "quiet_root_handlers"]

# modules whose import calls logging.basicConfig (checked against the installed Opacus 1.5)
_CONFIGURING_MODULES = frozenset({"opacus.utils.module_utils"})
_lock = threading.Lock()


class quiet_root_handlers:  # lower case: used like contextlib's helpers
    """Within the block, root handlers that appear are removed on exit (those present before stay)."""

    def __enter__(self) -> None:
        self._before = list(logging.getLogger().handlers)

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger()
        for handler in list(root.handlers):
            if handler not in self._before:
                root.removeHandler(handler)


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader; executes the module with :class:`quiet_root_handlers`."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with _lock, quiet_root_handlers():
            self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None):
        if fullname not in _CONFIGURING_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Put the import hook first on ``sys.meta_path`` (idempotent). Called when ``flwr_inca`` is imported.

    If Opacus was imported before ``flwr_inca``, its handler (if any) is the application's business
    and stays.
    """
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
