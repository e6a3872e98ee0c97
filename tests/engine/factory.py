"""``cache_factory``: DurableCaches over one temporary state directory, closed at the end."""

import contextlib
import os

from prefixd.engine import DurableCache


@contextlib.contextmanager
def cache_factory(tmp_path, layout, sizes, **defaults):
    """Yields ``make(sizes=..., layout=..., **kw) -> DurableCache`` (``kw`` over ``defaults``;
    shm files under ``tmp_path/shm``); every cache it made and left open is closed after."""
    made = []

    def make(sizes=sizes, layout=layout, **kw):
        kw = {**defaults, **kw}
        kw.setdefault("shm_dir", str(tmp_path / "shm"))
        os.makedirs(kw["shm_dir"], exist_ok=True)
        dc = DurableCache(str(tmp_path / "state"), layout, sizes, **kw)
        made.append(dc)
        return dc

    try:
        yield make
    finally:
        for dc in made:
            try:
                dc.close()
            except Exception:  # already closed, or the test left it failed on purpose
                pass
