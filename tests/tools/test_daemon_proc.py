"""``prefixd.tools.daemon_proc``: the daemon child the demo and bench/e2e.py crash and restart."""

import pytest

from prefixd.tools.daemon_proc import DaemonFailed, DaemonProc


def test_kill9_then_start_serves_again_on_the_same_state_and_stop_is_clean():
    with DaemonProc.temporary(device=16, host=16, disk=16) as d:
        d.start()
        with pytest.raises(DaemonFailed, match="still runs"):
            d.start()  # one child at a time: a second start would not be a restart
        first = d.proc.pid
        d.kill9()
        assert not d.running()
        d.start()
        assert d.proc.pid != first and d.starts == 2
        assert d.stop() == 0
