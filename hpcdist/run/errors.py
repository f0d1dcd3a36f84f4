"""The error a setting that cannot work raises (run/config.py reports it in one line)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot work; reported as one line, exit code 2. ``field``: the setting
    it is about, where there is one (parse_config names the file a TOML value came from)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field
