"""The one error of the config part."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting is out of range, unknown or of the wrong type, or a config file cannot be
    read; the message names the key and what to set it to. Raised when a settings class is
    built or a config file is loaded, and by the daemon for a socket it cannot set up."""
