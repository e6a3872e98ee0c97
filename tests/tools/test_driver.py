"""``prefixd.tools.driver``: the timed loops' collector pause."""

import gc

import pytest

from prefixd.tools.driver import gc_paused


def test_gc_paused_turns_the_collector_off_inside_and_back_on_after():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_gc_paused_turns_the_collector_back_on_when_the_loop_raises():
    with pytest.raises(ZeroDivisionError):
        with gc_paused():
            1 / 0
    assert gc.isenabled()
