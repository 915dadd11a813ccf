"""The problems a CLI user can fix, printed as one line each with exit status 2 instead of a
traceback (a refused combination of settings, a bad value)."""

from __future__ import annotations

from pydantic import ValidationError

from ..settings import Settings

EXIT_CONFIG = 2


class CliError(Exception):
    """A problem the user can fix; printed as one line."""


def load_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as error:
        lines = [
            f"configuration error: {'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}"
            for e in error.errors()
        ]
        raise CliError("\n".join(lines)) from None
