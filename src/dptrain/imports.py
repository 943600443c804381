"""Resolve a user's `package.module:Name` into the object it names, with one-sentence errors."""

from __future__ import annotations

import importlib
from typing import Any

from dptrain.errors import ConfigError


def import_object(path: str, option: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{option} {path}: cannot import module {module_name} ({exc}); make it importable (pip install it or add its folder to PYTHONPATH)."
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{option} {path}: module {module_name} has no attribute {attr}; check the name after the colon.") from None
