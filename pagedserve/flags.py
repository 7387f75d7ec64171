"""Command-line flags that default to environment variables, the one way every service reads them.

Every flag `--some-flag` has a variable `PAGEDSERVE_SOME_FLAG`: the flag wins over the variable, the
variable over the built-in default. An empty variable counts as unset (compose passes `VAR:` through
empty when the shell leaves it unset).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

ENV_PREFIX = "PAGEDSERVE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_var(flag: str) -> str:
    """`--kv-cache-memory` -> `PAGEDSERVE_KV_CACHE_MEMORY`."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}, got {text!r}")
    return value in _TRUE


class EnvFlags:
    """Adds flags to a parser, each defaulting to its PAGEDSERVE_* variable in env."""

    def __init__(self, parser: argparse.ArgumentParser, env: Mapping[str, str]):
        self.parser = parser
        self.env = env

    def _env_default(self, var: str, convert: Callable[[str], Any], default: Any) -> Any:
        text = self.env.get(var)
        if not text:
            return default
        try:
            return convert(text)
        except ValueError as exc:
            self.parser.error(f"{var}: {exc}")

    def add(
        self, flag: str, convert: Callable[[str], Any], help_text: str, default: Any = None, **kwargs
    ) -> None:
        var = env_var(flag)
        self.parser.add_argument(
            flag,
            dest=flag.lstrip("-").replace("-", "_"),
            type=convert,
            default=self._env_default(var, convert, default),
            help=f"{help_text} (env {var})",
            **kwargs,
        )

    def add_bool(self, flag: str, help_text: str, default: bool | None) -> None:
        var = env_var(flag)
        self.parser.add_argument(
            flag,
            dest=flag.lstrip("-").replace("-", "_"),
            action=argparse.BooleanOptionalAction,
            default=self._env_default(var, parse_bool, default),
            help=f"{help_text} (env {var})",
        )
