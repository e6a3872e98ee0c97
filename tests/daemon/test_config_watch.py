"""``ConfigWatch``: the config file's watch stops cleanly however busy the file is, sees a
save through a symlink, and without a directory logs why and serves without a watch."""

import asyncio
import logging
import os
import threading

from prefixd.daemon.config_watch import ConfigWatch


def test_many_stops_while_the_directory_is_busy_log_nothing(tmp_path, caplog):
    """200 start/stop cycles while a thread keeps saving the file (and another beside it):
    no stop logs anything at WARNING or above, and the watch saw the saves."""
    path = tmp_path / "prefixd.toml"
    path.write_text("[daemon]\n")
    stop_writing = threading.Event()

    def writer():
        i = 0
        while not stop_writing.is_set():
            (tmp_path / "new").write_text(f"[daemon]\n# {i}\n")
            os.replace(tmp_path / "new", path)
            (tmp_path / "other.toml").write_text(str(i))
            i += 1

    async def cycles() -> int:
        seen = 0

        def on_change(reason: str) -> None:
            nonlocal seen
            seen += 1

        loop = asyncio.get_running_loop()
        for i in range(200):
            watch = ConfigWatch(str(path), loop, on_change)
            watch.start()
            await asyncio.sleep(0.002 * (i % 5))  # stop at varied points of the event stream
            watch.stop()
            watch.stop()  # idempotent
        return seen

    thread = threading.Thread(target=writer, daemon=True)
    caplog.set_level(logging.INFO)
    thread.start()
    try:
        seen = asyncio.run(cycles())
    finally:
        stop_writing.set()
        thread.join(30)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [f"{r.levelname} {r.name}: {r.getMessage()}" for r in loud[:5]]
    assert seen > 0, "the watch never saw the file change"


def test_a_save_through_a_symlink_is_seen_at_the_target(tmp_path):
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    target = real_dir / "prefixd.toml"
    target.write_text("[daemon]\n")
    link = tmp_path / "prefixd.toml"
    link.symlink_to(target)

    async def walk():
        seen = asyncio.Event()
        watch = ConfigWatch(str(link), asyncio.get_running_loop(), lambda reason: seen.set())
        watch.start()
        try:
            target.write_text("[daemon]\nlease_s = 4.0\n")  # written in place, at the target
            await asyncio.wait_for(seen.wait(), 30)
        finally:
            watch.stop()

    asyncio.run(walk())


def test_a_missing_directory_is_logged_and_leaves_no_watch(tmp_path, caplog):
    async def walk():
        watch = ConfigWatch(str(tmp_path / "absent" / "prefixd.toml"), asyncio.get_running_loop(),
                            lambda reason: None)
        watch.start()
        watch.stop()

    caplog.set_level(logging.INFO)
    asyncio.run(walk())
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "reload with SIGHUP" in errors[0], errors
