"""A pool's log keeps room past its end (``prefixd.engine.log_room``): reserved at open and
charged, reserved again as the log grows (half of it used), sized to twice the last
checkpoint within the logs' share, refused by a full filesystem with one WARNING and kept
again once there is room, and punched when the pool closes."""

import os

from prefixd.engine.log_room import LOG_POOL_ROOM, LogRoom, LogRooms
from prefixd.storage.budget_ledger import BudgetLedger
from prefixd.storage.poolfile import free_bytes
from tests.crash.test_full_disk import tmpfs  # noqa: F401 - the fixture

MiB = 1 << 20


def held(path: str) -> int:
    return os.stat(path).st_blocks * 512


def grow(path: str, nbytes: int) -> None:
    with open(path, "ab") as f:  # as LMDB grows data.mdb: by writes at its end
        f.write(b"\x01" * nbytes)


def test_the_room_follows_the_log_and_is_punched_at_close(tmp_path):
    wal = str(tmp_path / "data.mdb")
    grow(wal, 64 << 10)
    ledger = BudgetLedger("disk", 64 * MiB)
    room = LogRoom(wal, "a", ledger, LogRooms(8 * MiB))
    room.reserve()
    assert ledger.used_by("a") == LOG_POOL_ROOM and held(wal) >= (64 << 10) + LOG_POOL_ROOM
    end = room.reserved_end
    grow(wal, LOG_POOL_ROOM // 4)
    assert room.keep() and room.reserved_end == end  # more than half left: nothing to do
    grow(wal, LOG_POOL_ROOM // 2)
    assert room.keep() and room.reserved_end == os.stat(wal).st_size + LOG_POOL_ROOM
    assert held(wal) >= room.reserved_end
    assert room.keep(checkpoint_bytes=3 * MiB)  # a checkpoint's worth: 2 x 3 MiB
    assert room.room == 6 * MiB and room.rooms.extra == 2 * MiB
    assert held(wal) >= os.stat(wal).st_size + 6 * MiB
    room.keep(checkpoint_bytes=100 * MiB)  # capped by the logs' share
    assert room.rooms.extra == 8 * MiB
    room.release(punch=True)
    assert ledger.used_bytes == 0 and room.rooms.extra == 0
    assert held(wal) < os.stat(wal).st_size + (64 << 10)


def test_a_full_filesystem_refuses_the_room_once_and_it_is_kept_again(tmpfs, caplog):  # noqa: F811
    state = tmpfs(16 * MiB)
    wal = os.path.join(state, "data.mdb")
    grow(wal, 4096)
    room = LogRoom(wal, "a", BudgetLedger("disk", 64 * MiB), LogRooms(0))
    room.reserve()
    filler = os.path.join(state, "filler")
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    os.posix_fallocate(fd, 0, free_bytes(state) - (64 << 10))
    os.close(fd)
    grow(wal, LOG_POOL_ROOM * 3 // 4)  # into its room: the filesystem had none to give
    with caplog.at_level("WARNING", logger="prefixd.engine.log_room"):
        assert not room.keep() and not room.keep()
    assert len([r for r in caplog.records if "cannot be kept" in r.getMessage()]) == 1
    os.unlink(filler)
    assert room.keep() and held(wal) >= os.stat(wal).st_size + LOG_POOL_ROOM
    room.release(punch=True)
