"""``prefixd serve`` with a config file it cannot use: exit 1 and one log line naming the key,
never a traceback (``prefixd.daemon.cli``'s exit status)."""

from __future__ import annotations

import pytest

from tests.daemon.harness import DaemonProcess


@pytest.mark.parametrize("config, words", [
    ("[daemon]\nleese_s = 3.0\n", "unknown key 'leese_s' in [daemon]"),
    ("[engine]\nsync = \"sometimes\"\n", "engine.sync must be one of"),
    ("[engine\n", "is not valid TOML"),
])
def test_a_config_that_does_not_load_stops_the_start_with_one_line(config, words):
    """Regression: ``ConfigError`` is the config part's, not an engine error, so the start's
    ``except`` must name it; without it a bad file ends in a traceback."""
    daemon = DaemonProcess(config)
    try:
        log = daemon.start_refused()
        assert "not starting:" in log and words in log, log
        assert "Traceback" not in log, log
    finally:
        daemon.close()
